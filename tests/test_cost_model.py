"""The prefill connector's read-or-recompute cost model (`kvbridge.connector._cost`), on a
fake clock: what it learns from observed requests and how it decides."""

from __future__ import annotations

import random

import pytest

from kvbridge.clock import FakeClock
from kvbridge.connector._cost import (
    BELOW_THRESHOLD,
    MIN_COMPUTE_SAMPLES,
    PROBE,
    READ,
    RECOMPUTE_CHEAPER,
    CostModel,
)

THRESHOLD = 64


class Engine:
    """A simulated engine: compute a + b*m + c*m*L seconds, reads r0 + r1*n, with noise."""

    def __init__(self, a: float = 0.004, b: float = 20e-6, c: float = 2e-9,
                 r0: float = 0.012, r1: float = 2e-6, noise: float = 0.03,
                 seed: int = 1) -> None:
        self.a, self.b, self.c, self.r0, self.r1 = a, b, c, r0, r1
        self.noise = noise
        self.rng = random.Random(seed)

    def _jitter(self, x: float) -> float:
        return x * (1 + self.rng.uniform(-self.noise, self.noise))

    def compute_s(self, m: int, context: int) -> float:
        return self._jitter(self.a + self.b * m + self.c * m * context)

    def read_s(self, n: int) -> float:
        return self._jitter(self.r0 + self.r1 * n)

    def marginal_s(self, n: int, context: int) -> float:
        return n * (self.b + self.c * context)

    def crossover(self, context_of: float = 1.0) -> int:
        """The reusable tokens (of a prompt that long) from which reading is faster."""
        n = 1
        while self.marginal_s(n, int(n * context_of)) <= self.r0 + self.r1 * n:
            n += 1
        return n


def model(clock: FakeClock, *, by_cost: bool = True, margin: float = 0.1,
          probe_interval_s: float = 60.0) -> CostModel:
    return CostModel(threshold=THRESHOLD, by_cost=by_cost, margin=margin,
                     probe_interval_s=probe_interval_s, now=clock.monotonic)


def turns(cost: CostModel, engine: Engine, rng: random.Random, count: int,
          clock: FakeClock) -> None:
    """A multi-turn workload as the engine sees it: first turns compute their whole prompt,
    later turns read their history (when the model decides so) and compute the new tokens."""
    for _ in range(count):
        context = rng.choice([256, 512, 1024, 2048, 4096])
        new = rng.randint(100, 200)
        history = context - new
        decision = cost.decide(history, context)
        if decision.read:
            cost.read(history, engine.read_s(history))
            cost.computed(new, new * context, engine.compute_s(new, context))
        else:
            cost.computed(context, context * context, engine.compute_s(context, context))
        clock.advance(1.0)


def test_learns_both_rates_from_observed_requests():
    clock = FakeClock()
    cost = model(clock)
    engine = Engine()
    rng = random.Random(7)
    for _ in range(40):
        m, context = rng.randint(16, 4096), rng.choice([512, 2048, 8192])
        m = min(m, context)
        cost.computed(m, m * context, engine.compute_s(m, context))
        n = rng.randint(16, 8192)
        cost.read(n, engine.read_s(n))
    for n, context in [(200, 512), (1000, 2048), (4000, 8192)]:
        assert cost.recompute_s(n, context) == pytest.approx(engine.marginal_s(n, context),
                                                             rel=0.15)
        assert cost.read_s(n) == pytest.approx(engine.r0 + engine.r1 * n, rel=0.1)
    est = cost.estimates(2048)
    assert est["read_fixed"] == pytest.approx(engine.r0, rel=0.15)
    assert est["read_per_token"] == pytest.approx(engine.r1, rel=0.15)
    assert est["recompute_fixed"] == pytest.approx(engine.a, abs=0.002)
    assert est["recompute_per_token"] == pytest.approx(engine.b + engine.c * 2048, rel=0.15)


def test_learns_from_steps_that_batch_several_requests():
    """Steps, not requests: a step's time is its batch's, so the model learns per-token costs
    from the step's total tokens and context area."""
    clock = FakeClock()
    cost = model(clock)
    engine = Engine(noise=0.02)
    rng = random.Random(23)
    for _ in range(60):
        batch = [(rng.randint(16, 1500), rng.choice([512, 2048, 4096]))
                 for _ in range(rng.randint(1, 4))]
        batch = [(min(m, context), context) for m, context in batch]
        seconds = engine.a + sum(engine.b * m + engine.c * m * context for m, context in batch)
        cost.computed(sum(m for m, _ in batch), sum(m * context for m, context in batch),
                      engine._jitter(seconds))
    for n, context in [(300, 512), (1500, 4096)]:
        assert cost.recompute_s(n, context) == pytest.approx(engine.marginal_s(n, context),
                                                             rel=0.15)


def test_switches_at_the_crossover():
    clock = FakeClock()
    cost = model(clock, margin=0.0)
    engine = Engine(noise=0.0)
    rng = random.Random(3)
    turns(cost, engine, rng, 60, clock)
    assert cost.ready()
    cross = engine.crossover()  # a prompt as long as its reusable tokens
    assert 100 < cross < 2000
    below = cost.decide(int(cross * 0.8), int(cross * 0.8))
    above = cost.decide(int(cross * 1.25), int(cross * 1.25))
    assert (below.read, below.reason) == (False, RECOMPUTE_CHEAPER)
    assert (above.read, above.reason) == (True, READ)
    assert below.read_s is not None and below.recompute_s is not None
    assert below.read_s > below.recompute_s
    # Before the lookup, the lookup's own time counts against the read.
    cost.looked_up(1.0)
    assert not cost.decide(int(cross * 1.25), int(cross * 1.25), before_lookup=True).read
    assert cost.decide(int(cross * 1.25), int(cross * 1.25)).read


def test_margin_keeps_a_read_that_is_barely_faster_off():
    clock = FakeClock()
    engine = Engine(noise=0.0)
    strict, loose = model(clock, margin=0.3), model(clock, margin=0.0)
    for cost in (strict, loose):
        turns(cost, engine, random.Random(5), 60, clock)
    n = int(engine.crossover() * 1.15)  # reading is ~10% faster here
    assert loose.decide(n, n).read
    assert not strict.decide(n, n).read


def test_recovers_when_compute_slows_down():
    clock = FakeClock()
    cost = model(clock)
    fast = Engine(b=2e-6, c=0.0, noise=0.0)  # compute so fast that reads never pay
    rng = random.Random(11)
    turns(cost, fast, rng, 40, clock)
    assert not cost.decide(2000, 2048).read
    slow = Engine(b=40e-6, c=0.0, noise=0.0)  # the machine got 20x slower at computing
    turns(cost, slow, rng, 30, clock)  # recomputing measures it: no probe needed
    assert cost.decide(2000, 2048).read


def test_recovers_when_reads_get_faster_by_probing():
    clock = FakeClock()
    cost = model(clock, probe_interval_s=60.0)
    slow_reads = Engine(r0=0.2, r1=2e-6, noise=0.0)
    rng = random.Random(13)
    turns(cost, slow_reads, rng, 20, clock)
    assert not cost.decide(2000, 2048).read
    fast_reads = Engine(r0=0.002, r1=2e-6, noise=0.0)  # e.g. a faster network in place
    probes = 0
    for _ in range(400):
        decision = cost.decide(2000, 2048)
        if decision.read:
            probes += decision.reason == PROBE
            cost.read(2000, fast_reads.read_s(2000))
        else:
            cost.computed(2048, 2048 * 2048, fast_reads.compute_s(2048, 2048))
        clock.advance(1.0)
        if decision.reason == READ:
            break
    assert decision.reason == READ
    # Reads were measured again only now and then: one probe a minute, a few of them.
    assert 1 <= probes <= 3


def test_no_probe_while_reads_are_sampled_recently():
    clock = FakeClock()
    cost = model(clock, probe_interval_s=60.0)
    turns(cost, Engine(r0=0.2, noise=0.0), random.Random(17), 20, clock)
    reasons = {cost.decide(2000, 2048).reason for _ in range(5)}
    assert reasons == {RECOMPUTE_CHEAPER}  # fewer declines than a probe waits for
    off = model(clock, probe_interval_s=0.0)
    turns(off, Engine(r0=0.2, noise=0.0), random.Random(17), 20, clock)
    for _ in range(50):
        clock.advance(10.0)
        assert off.decide(2000, 2048).reason == RECOMPUTE_CHEAPER  # probes off


def test_reads_any_size_until_a_read_is_measured_then_the_threshold_until_ready():
    """Reading is how the read model learns: until a read is measured every stretch is read
    (with prefill's prefix cache on, what a turn can read is often a block or two, under the
    threshold: gated by it, no read would ever be measured). Then the threshold decides until
    the compute model has samples too."""
    clock = FakeClock()
    cost = model(clock)
    assert not cost.ready() and cost.floor() == THRESHOLD
    assert cost.decide(THRESHOLD - 1, 1000).reason == READ
    assert cost.decide(1, 1000).read and not cost.decide(0, 1000).read
    cost.read(40, 0.002)
    assert not cost.ready()  # compute samples are missing: the fallback, today's threshold
    assert cost.decide(THRESHOLD - 1, 1000).reason == BELOW_THRESHOLD
    assert cost.decide(THRESHOLD, 1000).read
    for _ in range(MIN_COMPUTE_SAMPLES):
        cost.computed(1000, 1000 * 1000, 0.5)
    assert cost.ready() and cost.floor() == 1


def test_threshold_mode_ignores_measurements():
    clock = FakeClock()
    cost = model(clock, by_cost=False)
    turns(cost, Engine(r0=5.0, noise=0.0), random.Random(19), 30, clock)
    assert not cost.ready()
    assert cost.decide(THRESHOLD, 4096).read  # reads are 5 s, but the threshold decides
    assert cost.decide(THRESHOLD - 1, 4096).reason == BELOW_THRESHOLD


def test_bad_samples_are_ignored():
    clock = FakeClock()
    cost = model(clock)
    cost.computed(0, 0, 1.0)
    cost.computed(100, 100 * 100, 0.0)
    cost.read(0, 1.0)
    cost.read(100, -1.0)
    assert cost.estimates() == {}
    assert not cost.ready()


def test_one_probe_per_interval_even_when_it_is_never_measured():
    """While a probe is due, requests pass the check before their lookup, but only the first
    to decide after it probes; a probe whose read is never measured (a miss, a failure, a new
    engine) does not leave every later request reading."""
    clock = FakeClock()
    cost = model(clock, probe_interval_s=60.0)
    turns(cost, Engine(r0=0.2, noise=0.0), random.Random(29), 20, clock)
    for _ in range(cost.probe_after):
        assert cost.decide(2000, 2048).reason == RECOMPUTE_CHEAPER
    clock.advance(61.0)
    in_flight = [cost.decide(2000, 2048, before_lookup=True) for _ in range(5)]
    assert {d.reason for d in in_flight} == {PROBE}  # all may look up
    after = [cost.decide(2000, 2048) for _ in range(5)]
    assert [d.reason for d in after] == [PROBE] + [RECOMPUTE_CHEAPER] * 4
    for _ in range(50):  # the probe's read never measured: no more probes this interval
        clock.advance(1.0)
        assert cost.decide(2000, 2048).reason == RECOMPUTE_CHEAPER


def test_reads_of_nearly_one_size_do_not_extrapolate_to_seconds():
    """Reads of a turn's answer past prefill's own cache are a block or two each, and their
    times on a loaded engine swing by tens of ms. Fitted freely, two such reads made a steep
    line with a negative intercept: seconds estimated for a longer read, 0 for a shorter one
    (and every later read refused). The fit keeps both parameters non-negative."""
    cost = model(FakeClock())
    for _ in range(MIN_COMPUTE_SAMPLES):
        cost.computed(256, 256 * 1200, 0.2)
    cost.read(64, 0.005)
    cost.read(70, 0.120)
    slowest_per_token = 0.120 / 64
    assert 0 < cost.read_s(16) <= 16 * slowest_per_token
    assert cost.read_s(300) <= 300 * slowest_per_token
    assert all(v >= 0 for v in cost.estimates().values())


def test_steps_of_nearly_one_shape_do_not_inflate_the_compute_rate():
    """Steps that each compute one prompt of about the same length: tokens and tokens times
    context move together. Fitted freely, the fixed part went negative (-0.7 s) and the
    per-token rate four times what the steps took."""
    cost = model(FakeClock())
    cost.read(64, 0.01)
    steps = ((256, 1200, 0.20), (260, 1210, 0.35), (250, 1190, 0.18), (262, 1220, 0.36))
    for tokens, context, seconds in steps:
        cost.computed(tokens, tokens * context, seconds)
    assert cost.estimates()["recompute_fixed"] >= 0
    assert 0.18 <= cost.recompute_s(256, 1200) <= 0.36


def test_the_fit_is_the_free_one_where_that_is_non_negative():
    """Samples a model with positive parameters made: the constrained fit is the free fit,
    and recovers them."""
    cost = model(FakeClock())
    engine = Engine(noise=0.0)
    rng = random.Random(3)
    for _ in range(30):
        n, context = rng.randint(50, 3000), rng.randint(500, 4000)
        cost.read(n, engine.read_s(n))
        cost.computed(n, n * context, engine.compute_s(n, context))
    for n in (32, 500, 4000):
        assert cost.read_s(n) == pytest.approx(engine.r0 + engine.r1 * n, rel=0.02)
        assert cost.recompute_s(n, 2048) == pytest.approx(engine.marginal_s(n, 2048), rel=0.02)


def test_one_stall_does_not_carry_the_estimates_off():
    """A step that opened a NIXL connection took seconds, and so did a read that waited for
    it: each is taken as at most four times its estimate, and one slow read alone does not
    make the model forget what it learned. Reads of a turn's answer stay the faster choice."""
    clock = FakeClock()
    cost = model(clock)
    engine = Engine()
    turns(cost, engine, random.Random(5), 40, clock)
    before_read, before_compute = cost.read_s(64), cost.recompute_s(64, 1500)
    cost.computed(300, 300 * 1500, 3.0)  # the stalled step
    cost.read(64, 4.0)  # the read that waited
    assert cost.clipped == 2
    # Taken whole, these two samples had moved the estimates to hundreds of ms.
    assert cost.read_s(64) < 4 * before_read < 0.1
    assert cost.recompute_s(64, 1500) < 4 * before_compute < 0.1
    # A second slow read in a row is a new regime: the model follows it.
    cost.read(64, 4.0)
    cost.read(64, 4.0)
    assert cost.read_s(64) > 4 * before_read


def test_a_slower_regime_from_two_reads_is_checked_by_one_more():
    """Two slow reads in a row (both may have waited on one stall) move the read estimate past
    recomputing. The next decision reads once more instead of declining reads for a probe
    interval: a fast read brings the estimate back; a third slow one confirms it, and reads
    wait for the interval's probe again."""
    for third, expect in ((0.007, READ), (4.0, RECOMPUTE_CHEAPER)):
        clock = FakeClock()
        cost = model(clock, probe_interval_s=60.0)
        turns(cost, Engine(r0=0.005, r1=2e-6, noise=0.0), random.Random(3), 40, clock)
        assert cost.decide(1000, 1024).reason == READ
        cost.read(1000, 0.05)
        cost.read(1000, 4.0)
        first = cost.decide(1000, 1024)
        assert first.reason == PROBE and first.read_s > first.recompute_s
        assert cost.decide(1000, 1024).reason == RECOMPUTE_CHEAPER  # one probe, not more
        cost.read(1000, third)
        assert cost.decide(1000, 1024).reason == expect
        if expect == RECOMPUTE_CHEAPER:
            assert {cost.decide(1000, 1024).reason for _ in range(20)} == {RECOMPUTE_CHEAPER}
            # The slower regime stands: a slow probe of the interval is not checked again.
            clock.advance(61.0)
            assert cost.decide(1000, 1024).reason == PROBE
            cost.read(1000, 4.0)
            assert {cost.decide(1000, 1024).reason for _ in range(20)} == {RECOMPUTE_CHEAPER}


def test_no_recheck_when_probes_are_off():
    clock = FakeClock()
    cost = model(clock, probe_interval_s=0.0)
    turns(cost, Engine(r0=0.005, r1=2e-6, noise=0.0), random.Random(3), 40, clock)
    cost.read(1000, 0.05)
    cost.read(1000, 4.0)
    assert cost.decide(1000, 1024).reason == RECOMPUTE_CHEAPER
