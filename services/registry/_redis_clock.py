"""The fleet's clock, as a replica of the Redis store keeps track of it.

Time is Redis's own, read inside each function call (`begin` in lua/store.lua), plus a fix
stored in `<prefix>clock` that undoes a step of Redis's clock (an NTP step, a failover to a
host whose clock differs). Each call sends what this replica knows of that clock against its
own monotonic clock; a reply stamped with a clock outside it has seen a step, which the replica
confirms with the call's round trip and undoes by storing a fix (`clockfix`). So pins and
leases keep their deadlines across a step, and replicas need no clock agreement.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from kvbridge.clock import Clock
from kvbridge.errors import Unavailable

log = structlog.get_logger("kvbridge.registry")

_UNREACHABLE_LOG_EVERY = 5.0
# How far Redis's clock and this process's monotonic clock may drift apart, in seconds per
# second (NTP slews a clock by at most 500 ppm): what this replica knows of Redis's clock
# widens by this much with the time since it last saw it.
_CLOCK_DRIFT = 1e-3
_CLOCK_FIX_MAX_RTT = 0.1  # a step is fixed from a call of at most this round trip (seconds)


def _widened(bounds: tuple[float, float, float, bytes], at: float) -> tuple[float, float]:
    """Clock bounds learned at `bounds[2]`, widened by the drift allowed until `at`."""
    widen = max(at - bounds[2], 0.0) * _CLOCK_DRIFT
    return bounds[0] - widen, bounds[1] + widen


class FleetClock:
    """The part of `RedisStore` that checks and fixes the fleet's clock."""

    clock: Clock
    prefix: str
    _redis: aioredis.Redis | None
    _closing: bool
    # What this replica knows of the fleet clock: (lo, hi, at, gen) bounds of (that clock -
    # our monotonic clock) as of our monotonic `at`, learned under the fix of generation
    # `gen`; see `_clock_check`.
    _clock_bounds: tuple[float, float, float, bytes] | None
    _clock_fixing: bool  # a fix is being stored
    _last_clock_log: float
    clock_steps: int  # steps of Redis's clock this replica confirmed (and fixed)

    def _init_clock(self) -> None:
        self._clock_bounds = None
        self._clock_fixing = False
        self._last_clock_log = float("-inf")
        self.clock_steps = 0

    async def _run(self, operation: str, *args: Any) -> list[Any]:
        raise NotImplementedError  # RedisStore's

    def _chore(self, coro: Coroutine[Any, Any, None]) -> None:
        raise NotImplementedError  # RedisStore's

    def _unreachable(self, during: str, exc: Exception) -> None:
        raise NotImplementedError  # RedisStore's

    async def advance_clock(self, seconds: float) -> None:
        """Move the fleet's clock (every replica on this namespace) forward: for tests, which
        advance time instead of sleeping."""
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        assert self._redis is not None
        await self._redis.hincrbyfloat(self.prefix + "clock", "off", seconds)

    async def step_redis_clock(self, seconds: float) -> None:
        """Step Redis's own clock (as an NTP step or a failover to another host would), which
        the replicas must notice and undo: for tests."""
        assert self._redis is not None
        await self._redis.hincrbyfloat(self.prefix + "clock", "tstep", seconds)

    def _clock_context(self, sent: float) -> tuple[str, str, bytes]:
        """What a call sent at `sent` tells its function of the clock: the bounds (lo, hi;
        empty before the first reply) and the fix's generation they were learned under."""
        bounds = self._clock_bounds
        if bounds is None:
            return "", "", b""
        b_lo, b_hi = _widened(bounds, sent)
        return f"{b_lo:.6f}", f"{b_hi:.6f}", bounds[3]

    def _clock_check(self, stamp: list[bytes], sent: float, lo: str, hi: str) -> None:
        """Learn the fleet clock from a reply's stamp (NOW, the clock, the fix's generation)
        or, when the function found the clock outside what this replica knew of it (then also
        Redis's clock), confirm the step and store the fix that undoes it.

        Each reply bounds (fleet clock - monotonic clock): the function ran after the call was
        sent and before its reply came. Bounds meet (intersect) over replies, widened by the
        drift allowed since; replies that disagree with them (a step below the function's
        threshold) or come under another fix start them anew."""
        recv = self.clock.monotonic()
        base, gen = float(stamp[1]), stamp[2]
        if len(stamp) == 3:
            s_lo, s_hi = base - recv, base - sent
            bounds = self._clock_bounds
            if bounds is not None and bounds[3] == gen:
                b_lo, b_hi = _widened(bounds, sent)
                n_lo, n_hi = max(b_lo, s_lo), min(b_hi, s_hi)
                if n_lo <= n_hi:
                    s_lo, s_hi = n_lo, n_hi
            self._clock_bounds = (s_lo, s_hi, sent, gen)
            return
        # The call ran at sent + lo (the function's BASE); Redis's clock said `raw`.
        off = float(stamp[3]) - base  # > 0: Redis's clock is ahead of what we know of it
        rtt = recv - sent
        # Back: certain (a call cannot run before it is sent). Forward: certain once more than
        # the round trip (the call ran before its reply came), plus what we did not know. A fix
        # is only as good as the call's round trip: only a quick one stores it.
        certain = off < 0 or off > rtt + (float(hi) - float(lo)) + 0.01
        if not certain or rtt > _CLOCK_FIX_MAX_RTT:
            if recv - self._last_clock_log >= _UNREACHABLE_LOG_EVERY:
                self._last_clock_log = recv
                log.warning("redis_clock_unconfirmed", ahead_s=round(off, 6),
                            round_trip_s=round(rtt, 6),
                            hint="Redis's clock is not where this replica expected it, and the "
                                 "call took too long to tell a step: it ran at the earliest "
                                 "time it could have")
            return
        if self._clock_fixing or self._closing:
            return
        self._clock_fixing = True
        self._chore(self._store_clock_fix(gen, off))

    async def _store_clock_fix(self, gen: bytes, step: float) -> None:
        try:
            reply = await self._run("clockfix", gen, f"{-step:.6f}")
            if int(reply[2]):
                self.clock_steps += 1
                log.warning("redis_clock_step", step_s=round(step, 6),
                            hint="Redis's clock stepped (NTP, a failover to another host): "
                                 "the fleet's clock keeps its pace; pins and leases keep "
                                 "their deadlines")
        except (Unavailable, RedisError, OSError) as exc:
            self._unreachable("clockfix", exc)
        finally:
            self._clock_fixing = False
