"""The chained block hash: the one definition used by the registry, the connector and tests.

A KV block is reusable only if the tokens it was computed from are exactly the tokens of the new
prompt at the same position, by the same model and engine layout. So each block's hash covers:

- a root derived from the engine fingerprint (model, dtype, KV layout: see `engine_fingerprint`),
  the block size, and the cache salt, so two engines that differ never match;
- the previous block's hash (the chain), so a block matches only if every earlier block did;
- the block's token ids.

A trailing partial block (fewer than `block_size` tokens) is hashed the same way over its tokens;
since its length is part of the input, it matches only a prefix of exactly that many tokens.

Hashes are 16-byte BLAKE2b digests, concatenated in block order into one `bytes` on the wire and
in memory (`HASH_SIZE` bytes per block).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence

HASH_SIZE = 16
_VERSION = b"kvbridge-blockhash-v1"


def engine_fingerprint(fields: Mapping[str, object]) -> str:
    """A stable hex fingerprint of whatever determines the KV layout and values.

    Pass e.g. model name and revision, dtype, KV cache dtype, tensor-parallel size, number of
    layers and heads. Keys are sorted, so the order does not matter.
    """
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode(), digest_size=HASH_SIZE).hexdigest()


def root_hash(fingerprint: str, block_size: int, cache_salt: str = "") -> bytes:
    """The chain's seed: what every block hash of this engine configuration depends on."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    h = hashlib.blake2b(digest_size=HASH_SIZE)
    h.update(_VERSION)
    for part in (fingerprint.encode(), str(block_size).encode(), cache_salt.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def _link(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=HASH_SIZE)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("I", tokens).tobytes())
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: str,
    cache_salt: str = "",
    *,
    include_partial: bool = False,
) -> bytes:
    """Concatenated hashes of the full blocks of `token_ids` (and the partial one if asked)."""
    parent = root_hash(fingerprint, block_size, cache_salt)
    out = bytearray()
    n = len(token_ids)
    full_end = n - n % block_size
    for start in range(0, full_end, block_size):
        parent = _link(parent, token_ids[start : start + block_size])
        out += parent
    if include_partial and full_end < n:
        out += _link(parent, token_ids[full_end:])
    return bytes(out)


def partial_block_hash(
    token_ids: Sequence[int],
    token_count: int,
    block_size: int,
    fingerprint: str,
    cache_salt: str = "",
    *,
    full_hashes: bytes | None = None,
) -> bytes | None:
    """The hash of the partial block that ends at `token_count`, over this prompt's tokens.

    Returns None when `token_count` ends on a block boundary or exceeds the prompt. Passing the
    prompt's `full_hashes` (from `block_hashes`) avoids rehashing the chain.
    """
    if token_count > len(token_ids) or token_count % block_size == 0:
        return None
    full_blocks = token_count // block_size
    if full_blocks == 0:
        parent = root_hash(fingerprint, block_size, cache_salt)
    elif full_hashes is not None and len(full_hashes) >= full_blocks * HASH_SIZE:
        parent = full_hashes[(full_blocks - 1) * HASH_SIZE : full_blocks * HASH_SIZE]
    else:
        chain = block_hashes(token_ids[: full_blocks * block_size], block_size, fingerprint,
                             cache_salt)
        parent = chain[-HASH_SIZE:]
    return _link(parent, token_ids[full_blocks * block_size : token_count])


def count_blocks(hashes: bytes) -> int:
    """Number of block hashes in a concatenation; raises if the length is not a multiple."""
    if len(hashes) % HASH_SIZE:
        raise ValueError(f"block hashes must be a multiple of {HASH_SIZE} bytes, got {len(hashes)}")
    return len(hashes) // HASH_SIZE


def matching_prefix(ours: bytes | memoryview, theirs: bytes | memoryview,
                    limit: int | None = None) -> int:
    """How many leading blocks two hash concatenations share (at most `limit` blocks, when
    given: `ours` may then run on past its hashes, as a lease's packed payload does)."""
    n = min(len(ours), len(theirs)) // HASH_SIZE
    if limit is not None:
        n = min(n, limit)
    size = n * HASH_SIZE
    # The common case, everything compared matches, in one memcmp without copying `ours` (the
    # registry's hit path compares a lease's 64 blocks here). Memoryviews compare item by item
    # (about 6 us for 64 blocks against 0.5 us as bytes), so they are copied to bytes first.
    b = bytes(theirs[:size]) if len(theirs) != size or type(theirs) is not bytes else theirs
    if type(ours) is bytes and ours.startswith(b):
        return n
    a = bytes(ours[:size])
    if a == b:
        return n
    lo, hi = 0, n  # invariant: blocks [0, lo) match, block hi-1 region contains a mismatch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * HASH_SIZE] == b[: mid * HASH_SIZE]:
            lo = mid
        else:
            hi = mid
    return lo
