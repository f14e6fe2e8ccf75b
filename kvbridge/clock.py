"""Clocks. Every time-dependent component takes a `Clock` so tests advance time, never sleep.

Durations cross the wire; absolute readings never do (DESIGN invariant 5). `monotonic()` is the
only clock used for deadlines; `wall()` only labels things for people (`*_time` fields, logs).

Deadlines run on a clock that counts the time a host spends suspended (Linux's
`CLOCK_BOOTTIME`), not on `time.monotonic()`, which stops while the host sleeps. The hosts of a
fleet agree on durations only if each counts all the time that passed: a registry whose clock
stopped would, on waking, still hand out leases whose holders had let them go at their hard
deadline (their blocks freed, perhaps reused), and a prefill engine's would still read under a
pin that had ended. Where the kernel has no such clock, `time.monotonic()` is used.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Protocol

#: Seconds on the clock deadlines use (see the module docstring); only differences mean anything.
monotonic: Callable[[], float]
if hasattr(time, "CLOCK_BOOTTIME"):
    monotonic = functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME)
else:  # not Linux
    monotonic = time.monotonic


def boot_id() -> str:
    """This kernel's boot id: processes that share it share `monotonic()` (one host, one
    boot); "" when unknown, which never matches."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards; only differences are meaningful."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch, for display only."""
        ...


class SystemClock:
    """The process's real clocks."""

    def monotonic(self) -> float:
        return monotonic()

    def wall(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds
