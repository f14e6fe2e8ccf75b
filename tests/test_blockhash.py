"""The chained block hash: what each block's hash depends on, and prefix matching."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge import blockhash
from kvbridge.blockhash import HASH_SIZE

FP = "fp-a"
TOKENS = list(range(100, 120))  # 20 tokens: 5 full blocks of 4


def split(hashes: bytes) -> list[bytes]:
    assert len(hashes) % HASH_SIZE == 0
    return [hashes[i : i + HASH_SIZE] for i in range(0, len(hashes), HASH_SIZE)]


def brute_force_prefix(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(split(a), split(b), strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- block_hashes -----------------------------------------------------------------------------


def test_one_hash_per_full_block_and_deterministic() -> None:
    h = blockhash.block_hashes(TOKENS, 4, FP)
    assert len(h) == 5 * HASH_SIZE
    assert h == blockhash.block_hashes(list(TOKENS), 4, FP)
    assert len(set(split(h))) == 5  # equal-looking positions still hash apart (the chain)
    # a trailing partial block is left out unless asked for
    assert blockhash.block_hashes(TOKENS[:18], 4, FP) == h[: 4 * HASH_SIZE]
    with_partial = blockhash.block_hashes(TOKENS[:18], 4, FP, include_partial=True)
    assert len(with_partial) == 5 * HASH_SIZE
    assert with_partial[: 4 * HASH_SIZE] == h[: 4 * HASH_SIZE]
    assert with_partial[4 * HASH_SIZE :] != h[4 * HASH_SIZE :]
    # include_partial adds nothing when the tokens end on a block boundary
    assert blockhash.block_hashes(TOKENS, 4, FP, include_partial=True) == h
    assert blockhash.block_hashes([], 4, FP, include_partial=True) == b""


def test_repeated_token_blocks_hash_differently() -> None:
    h = split(blockhash.block_hashes([7] * 12, 4, FP))
    assert len(set(h)) == 3


@pytest.mark.parametrize(
    ("kwargs", "other"),
    [
        ({"fingerprint": FP}, {"fingerprint": "fp-b"}),
        ({"cache_salt": ""}, {"cache_salt": "salt"}),
        ({"cache_salt": "a"}, {"cache_salt": "b"}),
    ],
)
def test_fingerprint_and_salt_change_every_hash(kwargs: dict, other: dict) -> None:
    base = {"fingerprint": FP, "cache_salt": ""}
    a = split(blockhash.block_hashes(TOKENS, 4, **{**base, **kwargs}))
    b = split(blockhash.block_hashes(TOKENS, 4, **{**base, **other}))
    assert len(a) == len(b) == 5
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_block_size_changes_every_hash() -> None:
    # 16 tokens are 4 blocks of 4 or 2 blocks of 8; also block 0 of size 4 vs a root of size 8
    a = split(blockhash.block_hashes(TOKENS[:16], 4, FP))
    b = split(blockhash.block_hashes(TOKENS[:16], 8, FP))
    assert not set(a) & set(b)
    assert blockhash.root_hash(FP, 4) != blockhash.root_hash(FP, 8)
    # the same 4 tokens hashed as a full block of 4 and as a partial block of 8 differ
    full4 = blockhash.block_hashes(TOKENS[:4], 4, FP)
    partial8 = blockhash.block_hashes(TOKENS[:4], 8, FP, include_partial=True)
    assert len(full4) == len(partial8) == HASH_SIZE
    assert full4 != partial8


def test_root_hash_is_unambiguous_in_its_parts() -> None:
    # length-prefixed parts: moving characters between fingerprint and salt changes the root
    assert blockhash.root_hash("ab", 4, "c") != blockhash.root_hash("a", 4, "bc")
    assert blockhash.root_hash("a", 4) == blockhash.root_hash("a", 4, "")
    with pytest.raises(ValueError, match="block_size"):
        blockhash.root_hash(FP, 0)
    with pytest.raises(ValueError, match="block_size"):
        blockhash.block_hashes(TOKENS, -4, FP)


@pytest.mark.parametrize("k", range(5))
def test_token_change_at_block_k_changes_blocks_from_k_on_only(k: int) -> None:
    base = split(blockhash.block_hashes(TOKENS, 4, FP))
    for offset in (0, 3):  # first and last token of block k
        edited = list(TOKENS)
        edited[k * 4 + offset] += 1
        new = split(blockhash.block_hashes(edited, 4, FP))
        assert new[:k] == base[:k]
        assert all(x != y for x, y in zip(new[k:], base[k:], strict=True))


def test_engine_fingerprint_is_order_independent_and_sensitive() -> None:
    a = blockhash.engine_fingerprint({"model": "m", "dtype": "bf16", "tp": 2})
    assert a == blockhash.engine_fingerprint({"tp": 2, "dtype": "bf16", "model": "m"})
    assert a != blockhash.engine_fingerprint({"model": "m", "dtype": "fp8", "tp": 2})
    assert a != blockhash.engine_fingerprint({"model": "m", "dtype": "bf16", "tp": 4})
    assert len(a) == 2 * HASH_SIZE
    int(a, 16)


# ---- partial blocks ---------------------------------------------------------------------------


def test_partial_block_hash_matches_block_hashes_partial() -> None:
    for count in (1, 2, 3, 5, 9, 18, 19):
        expected = blockhash.block_hashes(TOKENS[:count], 4, FP, include_partial=True)
        got = blockhash.partial_block_hash(TOKENS, count, 4, FP)
        assert got == expected[-HASH_SIZE:], count
        # same answer with the prompt's full hashes given, and with the tokens beyond it
        full = blockhash.block_hashes(TOKENS, 4, FP)
        assert blockhash.partial_block_hash(TOKENS, count, 4, FP, full_hashes=full) == got
        assert blockhash.partial_block_hash(TOKENS[:count], count, 4, FP) == got


def test_partial_block_hash_equality_and_inequality() -> None:
    # lease: 10 tokens (2 full blocks + 2 tokens). A prompt that extends them shares the hash
    lease = blockhash.block_hashes(TOKENS[:10], 4, FP, include_partial=True)
    prompt = [*TOKENS[:10], 1, 2, 3]
    assert blockhash.partial_block_hash(prompt, 10, 4, FP) == lease[2 * HASH_SIZE :]
    # one token of the partial block differs: only the partial hash differs
    edited = list(prompt)
    edited[9] += 1
    assert blockhash.partial_block_hash(edited, 10, 4, FP) != lease[2 * HASH_SIZE :]
    assert blockhash.block_hashes(edited, 4, FP)[: 2 * HASH_SIZE] == lease[: 2 * HASH_SIZE]
    # a different length of the partial block never matches (length is hashed)
    assert blockhash.partial_block_hash(prompt, 9, 4, FP) != lease[2 * HASH_SIZE :]
    assert blockhash.partial_block_hash(prompt, 11, 4, FP) != lease[2 * HASH_SIZE :]
    # an earlier full block differing changes the partial hash too (the chain)
    early = list(prompt)
    early[0] += 1
    assert blockhash.partial_block_hash(early, 10, 4, FP) != lease[2 * HASH_SIZE :]
    # another engine or salt never matches
    assert blockhash.partial_block_hash(prompt, 10, 4, "fp-b") != lease[2 * HASH_SIZE :]
    assert blockhash.partial_block_hash(prompt, 10, 4, FP, "s") != lease[2 * HASH_SIZE :]


def test_partial_block_hash_none_cases() -> None:
    assert blockhash.partial_block_hash(TOKENS, 8, 4, FP) is None  # on a boundary
    assert blockhash.partial_block_hash(TOKENS, 0, 4, FP) is None
    assert blockhash.partial_block_hash(TOKENS[:5], 6, 4, FP) is None  # beyond the prompt


def test_partial_block_hash_ignores_too_short_full_hashes() -> None:
    got = blockhash.partial_block_hash(TOKENS, 13, 4, FP)
    short = blockhash.block_hashes(TOKENS[:4], 4, FP)  # 1 hash where 3 are needed
    assert blockhash.partial_block_hash(TOKENS, 13, 4, FP, full_hashes=short) == got


# ---- count_blocks / matching_prefix -----------------------------------------------------------


def test_count_blocks() -> None:
    assert blockhash.count_blocks(b"") == 0
    assert blockhash.count_blocks(bytes(HASH_SIZE * 3)) == 3
    for bad in (1, HASH_SIZE - 1, HASH_SIZE + 1, 3 * HASH_SIZE - 1):
        with pytest.raises(ValueError, match="multiple of 16"):
            blockhash.count_blocks(bytes(bad))


def test_matching_prefix_examples() -> None:
    h = blockhash.block_hashes(TOKENS, 4, FP)
    assert blockhash.matching_prefix(h, h) == 5
    assert blockhash.matching_prefix(h, b"") == 0
    assert blockhash.matching_prefix(b"", h) == 0
    assert blockhash.matching_prefix(h, h[: 3 * HASH_SIZE]) == 3
    assert blockhash.matching_prefix(h[: 2 * HASH_SIZE], h) == 2
    for k in range(5):
        edited = list(TOKENS)
        edited[k * 4 + 2] = 0
        assert blockhash.matching_prefix(h, blockhash.block_hashes(edited, 4, FP)) == k
    other = blockhash.block_hashes(TOKENS, 4, "fp-b")
    assert blockhash.matching_prefix(h, other) == 0


def hash_lists() -> st.SearchStrategy[list[bytes]]:
    # few distinct values so that matches and mismatches at every position are both common
    return st.lists(st.sampled_from([bytes([i]) * HASH_SIZE for i in range(3)]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(a=hash_lists(), b=hash_lists(), common=hash_lists())
def test_matching_prefix_against_brute_force(a: list[bytes], b: list[bytes],
                                             common: list[bytes]) -> None:
    x, y = b"".join(common + a), b"".join(common + b)
    got = blockhash.matching_prefix(x, y)
    assert got == brute_force_prefix(x, y)
    assert got >= len(common)
    assert got == blockhash.matching_prefix(y, x)


@settings(max_examples=300, deadline=None)
@given(a=hash_lists(), b=hash_lists(), common=hash_lists(), limit=st.integers(0, 14),
       tail=st.binary(max_size=40))
def test_matching_prefix_with_a_limit_and_a_tail(a: list[bytes], b: list[bytes],
                                                 common: list[bytes], limit: int,
                                                 tail: bytes) -> None:
    """The registry passes a lease's packed payload (hashes, then block ids) and its block
    count: bytes past the limit never count, whatever they are, and memoryviews compare as
    bytes do."""
    x, y = b"".join(common + a), b"".join(common + b)
    want = min(brute_force_prefix(x, y), limit)
    blocks = len(x) // HASH_SIZE
    assert blockhash.matching_prefix(x + tail, y, min(limit, blocks)) == min(want, blocks)
    assert blockhash.matching_prefix(x, y, limit) == want
    assert blockhash.matching_prefix(memoryview(x), memoryview(y), limit) == want
    assert blockhash.matching_prefix(x, memoryview(y)) == brute_force_prefix(x, y)
    assert blockhash.matching_prefix(memoryview(x), y) == brute_force_prefix(x, y)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=24),
       edits=st.lists(st.tuples(st.integers(0, 23), st.integers(0, 3)), max_size=3),
       block_size=st.sampled_from([1, 3, 4]))
def test_matching_prefix_of_real_prompts(tokens: list[int], edits: list[tuple[int, int]],
                                         block_size: int) -> None:
    edited = list(tokens)
    for pos, value in edits:
        if pos < len(edited):
            edited[pos] = value
    ours = blockhash.block_hashes(tokens, block_size, FP)
    theirs = blockhash.block_hashes(edited, block_size, FP)
    k = blockhash.matching_prefix(ours, theirs)
    # k full blocks match exactly when the first k * block_size tokens are equal
    same = 0
    while same < len(tokens) and tokens[same] == edited[same]:
        same += 1
    assert k == min(same, len(tokens)) // block_size
