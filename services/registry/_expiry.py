"""`ExpiryWheel`: deadlines bucketed by a fixed granularity, for many items at ~8 bytes each.

A bucket holds the items whose deadline falls in it, and a heap orders the ids of the non-empty
buckets only. Adding is O(1) amortized; the due items come out bucket by bucket, at most a
budget per call. Items are never removed early: a caller whose item's deadline moved later
(a renewal) checks the real deadline when the item comes out and adds it again; this keeps
renewal O(1) and leaves one entry per item in the common case.

An item comes out at most one granularity after its deadline, plus however late `due` is called.
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

T = TypeVar("T")


class ExpiryWheel(Generic[T]):
    def __init__(self, granularity: float = 0.005) -> None:
        if granularity <= 0:
            raise ValueError("granularity must be positive")
        self._granularity = granularity
        self._buckets: dict[int, list[T]] = {}
        self._order: list[int] = []  # heap of the keys of _buckets
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, item: T, deadline: float) -> None:
        """Schedule `item` to come out of `due` once the clock reaches `deadline`."""
        key = math.ceil(deadline / self._granularity)
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = [item]
            heapq.heappush(self._order, key)
        else:
            bucket.append(item)
        self._size += 1

    def due(self, now: float, budget: int) -> list[T]:
        """Remove and return up to `budget` items whose bucket has been reached at `now`."""
        out: list[T] = []
        limit = math.floor(now / self._granularity)
        order, buckets = self._order, self._buckets
        while order and order[0] <= limit and len(out) < budget:
            key = order[0]
            bucket = buckets[key]
            room = budget - len(out)
            if len(bucket) <= room:
                out.extend(bucket)
                del buckets[key]
                heapq.heappop(order)
            else:
                out.extend(bucket[-room:])
                del bucket[-room:]
        self._size -= len(out)
        return out

    def next_deadline(self) -> float | None:
        """When the earliest non-empty bucket becomes due, or None if empty."""
        return self._order[0] * self._granularity if self._order else None
