"""`RateLimiter`: per-caller token buckets, and the debt of a call that cost more than one."""

from __future__ import annotations

import pytest

from kvbridge.clock import FakeClock
from kvbridge.ratelimit import RateLimiter


def test_a_charge_puts_the_caller_in_debt_by_at_most_its_burst() -> None:
    clock = FakeClock()
    limiter = RateLimiter(1.0, 2, clock)
    assert limiter.allow("a") == 0.0  # 1 token left
    limiter.charge("a", 10)  # a call that cost 11: the debt stops at one burst
    assert limiter.allow("a") == pytest.approx(3.0)  # from -2 back to 1, at 1 a second
    assert limiter.allow("b") == 0.0  # another caller's bucket is its own
    clock.advance(3.0)
    assert limiter.allow("a") == 0.0


def test_a_bucket_in_debt_is_not_forgotten_before_it_refills() -> None:
    # Buckets full again are dropped when the table is full; one still paying off a debt must
    # stay, or dropping it would hand its caller a full burst.
    clock = FakeClock()
    limiter = RateLimiter(1.0, 2, clock, max_keys=1)
    limiter.allow("a")
    limiter.charge("a", 3)  # -2: full again 4 s from now
    clock.advance(2.5)  # (a burst's own refill time, 2 s, has passed)
    assert limiter.allow("b") == 0.0  # the table is full: it prunes
    assert limiter.allow("a") == pytest.approx(0.5)


def test_no_rate_means_no_limit_and_no_debt() -> None:
    limiter = RateLimiter(0.0, 1, FakeClock())
    limiter.charge("a", 100)
    assert all(limiter.allow("a") == 0.0 for _ in range(10))
