"""`RateLimiter`: token buckets per key (a caller), on an injected clock.

Used where one caller's calls cost the server more than a constant (a listing that walks a
tenant's leases, a watch stream that receives every event): each caller gets `rate` tokens per
second with bursts of `burst`, a call taking one (and a call that turned out larger, more), so
that one caller looping such calls cannot slow every other caller's reads. Buckets of callers
that have been idle long enough to be full again are dropped, so the table holds only recent
callers.
"""

from __future__ import annotations

from kvbridge.clock import Clock


class RateLimiter:
    def __init__(self, rate: float, burst: float, clock: Clock, *,
                 max_keys: int = 10_000) -> None:
        """`rate` tokens a second per key, at most `burst` saved up (0 rate: no limit)."""
        if rate < 0 or burst < 1:
            raise ValueError("need rate >= 0 and burst >= 1")
        self.rate, self.burst, self.clock = rate, burst, clock
        self._max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, as of when)

    def allow(self, key: str) -> float:
        """Take a token for `key`: 0.0 when allowed, else the seconds until one is there."""
        if not self.rate:
            return 0.0
        now = self.clock.monotonic()
        tokens = self._level(key, now)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
        if len(self._buckets) >= self._max_keys and key not in self._buckets:
            self._prune(now)
        self._buckets[key] = (tokens - 1.0, now)
        return 0.0

    def charge(self, key: str, tokens: float) -> None:
        """Take `tokens` more from `key` after a call that turned out to cost more than the
        one `allow` took (a listing's size is known only once it is built). The bucket may go
        below empty, by at most `burst`: the caller's next calls wait the debt off."""
        if not self.rate or tokens <= 0:
            return
        now = self.clock.monotonic()
        self._buckets[key] = (max(self._level(key, now) - tokens, -self.burst), now)

    def _level(self, key: str, now: float) -> float:
        """`key`'s tokens at `now`: what it had, refilled since, up to `burst`."""
        tokens, then = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - then) * self.rate)

    def _prune(self, now: float) -> None:
        """Drop buckets that are full again (their callers have been idle long enough)."""
        self._buckets = {k: v for k, v in self._buckets.items()
                         if now - v[1] < (self.burst - v[0]) / self.rate}
