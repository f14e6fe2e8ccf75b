"""Input checks shared by the registry's operations. Each raises `InvalidArgument` naming the
field; callers run every check before their first mutation."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from kvbridge import blockhash
from kvbridge.errors import InvalidArgument
from kvbridge.ids import check_identifier

__all__ = ["InvalidArgument", "blocks", "duration", "hashes", "identifier", "in_range", "text"]

identifier = check_identifier


_TEXT = re.compile(r"[\x20-\x7e]*")


def text(field: str, value: str, max_length: int) -> None:
    """Free text for people: printable ASCII (spaces allowed), bounded."""
    if len(value) > max_length:
        raise InvalidArgument(field, f"longer than {max_length} characters", length=len(value))
    if _TEXT.fullmatch(value) is None:
        raise InvalidArgument(field, "must be printable ASCII")


def in_range(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(field, f"must be between {low} and {high}, got {value}")


def duration(field: str, seconds: float, low: float, high: float) -> None:
    if not math.isfinite(seconds) or not low <= seconds <= high:
        raise InvalidArgument(field, f"must be between {low:g}s and {high:g}s, got {seconds:g}s")


def hashes(field: str, value: bytes, max_blocks: int) -> int:
    if len(value) % blockhash.HASH_SIZE:
        raise InvalidArgument(
            field, f"length {len(value)} is not a multiple of {blockhash.HASH_SIZE}")
    n = len(value) // blockhash.HASH_SIZE
    if n > max_blocks:
        raise InvalidArgument(field, f"more than {max_blocks} blocks")
    return n


def blocks(prefix: str, block_ids: Sequence[int], token_count: int, hash_bytes: bytes,
           block_size: int, max_blocks: int) -> None:
    """A lease's blocks: 1..max of them, hashes one per block, tokens filling all but the last."""
    n = len(block_ids)
    if n == 0:
        raise InvalidArgument(prefix + "block_ids", "at least one block is required")
    if n > max_blocks:
        raise InvalidArgument(prefix + "block_ids", f"more than {max_blocks} blocks", count=n)
    if any(b < 0 or b > 0xFFFFFFFF for b in block_ids):
        raise InvalidArgument(prefix + "block_ids", "block ids must fit in 32 bits")
    if len(set(block_ids)) != n:  # a block listed twice would be freed twice
        raise InvalidArgument(prefix + "block_ids", "a block id is listed more than once")
    if not (n - 1) * block_size < token_count <= n * block_size:
        raise InvalidArgument(
            prefix + "token_count",
            f"{token_count} tokens do not fill {n} blocks of {block_size} "
            f"(need {(n - 1) * block_size + 1}..{n * block_size})")
    if hashes(prefix + "block_hashes", hash_bytes, max_blocks) != n:
        raise InvalidArgument(prefix + "block_hashes",
                              f"{len(hash_bytes) // blockhash.HASH_SIZE} hashes for {n} blocks")
