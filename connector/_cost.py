"""Read or recompute: what each costs on this engine, learned from its own recent requests.

Whether reading decode's KV back beats recomputing it depends on the model, the hardware and
the prompt: a small model, or a short history on a fast accelerator, recomputes faster than a
read's round trip; a long history on a large model reads many times faster. A fixed threshold
of reusable tokens is wrong somewhere on every deployment, so the prefill connector measures.

Two linear models, fitted by exponentially weighted least squares (recent requests count most,
so the estimates follow the machine when its speed changes):

- compute: an engine step's time (scheduled to its output, less its synchronous reads' waits)
  is ``a + b*T + c*A`` for ``T`` tokens computed in the step and ``A`` the sum over its requests
  of their tokens times their context (attention over the context makes each token dearer as a
  prompt grows). Steps, not requests: requests share steps, and a request's own time would be
  its batch's. Recomputing ``n`` more tokens of an ``L``-token prompt adds ``n * (b + c*L)`` to
  the step that computes it: the fixed part ``a`` is paid either way, as at least the prompt's
  last token is computed here.
- read: the time a read adds to its request is ``r0 + r1*n``: a fixed part (the round trip, the
  scheduling around the read) and the bytes over the transfer rate (bytes are proportional to
  tokens on one engine: the KV of a token is the same size everywhere in the prompt).

A read is taken when it is expected to be faster by a margin. Until a read has been measured,
every reusable stretch is read, whatever its size: reading is how the read model learns. Then,
until the compute model has samples too, the fixed threshold decides (reads of at least
``threshold`` tokens), as it does for those who ask for it (``decision="threshold"``). While the
estimates say
recompute, one read now and then (a probe) measures the read again, so that a transfer that got
faster is noticed; recomputing keeps the compute model current on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Feature scales: tokens in thousands, token-context products in millions, so that the
# normal equations stay well conditioned.
_TOKENS = 1024.0
_AREA = 1024.0 * 1024.0
# Relative damping of the normal equations: a direction the samples do not tell apart (all
# prompts of one length, say) is split between the parameters instead of blowing up.
_DAMPING = 1e-3
# Every parameter is a time or a rate, never negative. Unconstrained, samples of nearly one
# size (reads of a turn's answer, a block or two) fit a line as well with a steep slope and a
# negative intercept as with a flat one, and the steep one, extrapolated to a longer read,
# estimated seconds for what takes milliseconds (and read nothing more for the rest of a run).
# Per sample: the weight of older samples (about ten recent requests carry the estimate).
DECAY = 0.9
MIN_COMPUTE_SAMPLES = 3
MIN_READ_SAMPLES = 1
# A read this far off its estimate means the transfer changed (another path, a loaded
# network): what was learned before weighs this much from then on (at once for a faster read,
# from the second in a row for a slower one, see _CLIP). Reads are sampled
# seldom while the estimates say recompute (a probe a minute), so waiting for the decay alone
# would take many probes.
_SURPRISE = 2.0
_FORGET = 0.1
# A sample slower than this many times its estimate counts as this many times, and a read
# that slow changes the regime only when the next read is too: one stall (a step that opened a
# NIXL connection, a read that waited for one) had carried both estimates to seconds for the
# next few dozen requests. A real slow-down is followed within a few samples all the same.
_CLIP = 4.0

READ = "hit"
PROBE = "probe"
BELOW_THRESHOLD = "below_threshold"
RECOMPUTE_CHEAPER = "recompute_cheaper"


class _Fit:
    """y = theta . x, theta >= 0, by exponentially weighted least squares with a little
    damping."""

    def __init__(self, size: int, decay: float) -> None:
        self.size = size
        self.decay = decay
        self.gram = [[0.0] * size for _ in range(size)]
        self.moment = [0.0] * size
        self.square = 0.0  # the weighted sum of y squared: the residual of a candidate theta
        self.samples = 0
        self._theta: list[float] | None = None

    def add(self, x: list[float], y: float) -> None:
        d = self.decay
        for i in range(self.size):
            self.moment[i] = d * self.moment[i] + x[i] * y
            row = self.gram[i]
            for j in range(self.size):
                row[j] = d * row[j] + x[i] * x[j]
        self.square = d * self.square + y * y
        self.samples += 1
        self._theta = None

    def forget(self, factor: float) -> None:
        """Weigh everything learned so far by `factor` (a change of regime)."""
        for i in range(self.size):
            self.moment[i] *= factor
            self.gram[i] = [v * factor for v in self.gram[i]]
        self.square *= factor
        self._theta = None

    def theta(self) -> list[float]:
        """Non-negative (damped) least squares: of the fits over each subset of the parameters
        (the others held at 0), the one with no negative parameter that leaves the least
        damped residual. The constrained optimum is the free fit over its own positive set, so
        trying all 2^size subsets finds it, which for three parameters is cheaper than an
        iterative solver."""
        if self._theta is None:
            best, best_residual = [0.0] * self.size, self.square
            for mask in range(1, 1 << self.size):
                free = [i for i in range(self.size) if mask >> i & 1]
                a = [[self.gram[i][j] for j in free] + [self.moment[i]] for i in free]
                for k in range(len(free)):
                    a[k][k] += _DAMPING * a[k][k] + 1e-12
                solved = _solve(a)
                if any(v < 0 for v in solved):
                    continue
                theta = [0.0] * self.size
                for i, v in zip(free, solved, strict=True):
                    theta[i] = v
                # The damped objective, as solved (the damping is part of what is minimized).
                residual = self._residual(theta) + sum(
                    (_DAMPING * self.gram[i][i] + 1e-12) * theta[i] ** 2 for i in free)
                if residual < best_residual:
                    best, best_residual = theta, residual
            self._theta = best
        return self._theta

    def _residual(self, theta: list[float]) -> float:
        """The weighted squared error of `theta` over the samples."""
        fitted = sum(theta[i] * self.gram[i][j] * theta[j]
                     for i in range(self.size) for j in range(self.size))
        return self.square - 2 * sum(t * m for t, m in zip(theta, self.moment, strict=True)) \
            + fitted


def _solve(a: list[list[float]]) -> list[float]:
    """Gauss-Jordan on an augmented, symmetric positive definite system (n <= 3)."""
    n = len(a)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col] / p
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    return [a[i][n] / a[i][i] for i in range(n)]


@dataclass(frozen=True)
class Decision:
    read: bool
    reason: str  # READ, PROBE, BELOW_THRESHOLD or RECOMPUTE_CHEAPER
    read_s: float | None = None  # the estimates it was made on (None: not learned yet)
    recompute_s: float | None = None


class CostModel:
    """Decides read or recompute for a request's reusable tokens (scheduler thread only)."""

    def __init__(self, *, threshold: int, by_cost: bool, margin: float, probe_interval_s: float,
                 now: Callable[[], float], probe_after: int = 10) -> None:
        self.threshold = threshold
        self.by_cost = by_cost
        self.margin = margin
        self.probe_interval_s = probe_interval_s
        self.probe_after = probe_after
        self._now = now
        self._compute = _Fit(3, DECAY)
        self._read = _Fit(2, DECAY)
        self._lookup_s: float | None = None
        self._last_read = now()
        self._declined_since_read = 0
        self._slow_run = 0  # surprisingly slow reads in a row, up to the last one
        # Two slow reads in a row made the read model forget the faster past. Both may have
        # waited on one stall, and while the estimate says recompute no read measures again
        # until a probe (a minute): the next decision that would decline reads once more
        # first, and only a third slow read in a row confirms the slower regime.
        self._recheck = False
        self.clipped = 0  # samples taken as _CLIP times their estimate

    # ---- what was measured -------------------------------------------------------------------

    def computed(self, tokens: int, area: int, seconds: float) -> None:
        """A step computed `tokens` tokens in `seconds`; `area`: the sum over its requests of
        their tokens times their context (a single request: tokens * its prompt's length)."""
        if tokens > 0 and seconds > 0:
            x = [1.0, tokens / _TOKENS, area / _AREA]
            if self._compute.samples >= MIN_COMPUTE_SAMPLES:
                expected = sum(t * v for t, v in zip(self._compute.theta(), x, strict=True))
                if expected > 0 and seconds > _CLIP * expected:
                    seconds = _CLIP * expected
                    self.clipped += 1
            self._compute.add(x, seconds)

    def read(self, tokens: int, seconds: float) -> None:
        """A read of `tokens` tokens added `seconds` to its request."""
        if tokens > 0 and seconds >= 0:
            slow = False
            self._recheck = False  # whatever it was for, a read is measured now
            if self._read.samples >= MIN_READ_SAMPLES:
                expected = self.read_s(tokens)
                slow = seconds > expected * _SURPRISE
                self._slow_run = self._slow_run + 1 if slow else 0
                if seconds < expected / _SURPRISE or self._slow_run >= 2:
                    self._read.forget(_FORGET)
                    self._recheck = self._slow_run == 2 and self.probe_interval_s > 0
                if expected > 0 and seconds > _CLIP * expected:
                    seconds = _CLIP * expected
                    self.clipped += 1
            self._read.add([1.0, tokens / _TOKENS], seconds)
            self._last_read = self._now()
            self._declined_since_read = 0

    def looked_up(self, seconds: float) -> None:
        """A registry lookup took `seconds` (paid only by requests that look up)."""
        if self._lookup_s is None:
            self._lookup_s = seconds
        else:
            self._lookup_s = DECAY * self._lookup_s + (1 - DECAY) * seconds

    # ---- estimates ---------------------------------------------------------------------------

    def ready(self) -> bool:
        return (self.by_cost and self._compute.samples >= MIN_COMPUTE_SAMPLES
                and self._read.samples >= MIN_READ_SAMPLES)

    def recompute_s(self, tokens: int, context: int) -> float:
        """Expected time to compute `tokens` more tokens of a `context`-token prompt."""
        _, b, c = self._compute.theta()
        return max(tokens * (b / _TOKENS + c * context / _AREA), 0.0)

    def read_s(self, tokens: int) -> float:
        """Expected time a read of `tokens` tokens adds."""
        r0, r1 = self._read.theta()
        return max(r0 + r1 * tokens / _TOKENS, 0.0)

    def estimates(self, context: int = 1024) -> dict[str, float]:
        """The current estimates, for gauges: fixed parts and per-token rates (seconds)."""
        out: dict[str, float] = {}
        if self._compute.samples:
            a, _, _ = self._compute.theta()
            out["recompute_fixed"] = a
            out["recompute_per_token"] = self.recompute_s(1, context)
        if self._read.samples:
            r0, r1 = self._read.theta()
            out["read_fixed"] = r0
            out["read_per_token"] = r1 / _TOKENS
        if self._lookup_s is not None:
            out["lookup"] = self._lookup_s
        return out

    # ---- deciding ----------------------------------------------------------------------------

    def floor(self) -> int:
        """Prompts shorter than this are never looked up: the threshold, while the threshold
        decides; by cost, a prompt too short to pay for a read is found so by `decide`."""
        return 1 if self.ready() else self.threshold

    def decide(self, tokens: int, context: int, *, before_lookup: bool = False) -> Decision:
        """Read `tokens` reusable tokens of a `context`-token prompt, or recompute them.
        `before_lookup`: the most the request could read, asked before the registry lookup
        (whose cost then counts against the read)."""
        if not self.ready():
            if tokens >= max(self.threshold, 1) or (tokens > 0 and self._unmeasured()):
                return Decision(True, READ)
            return Decision(False, BELOW_THRESHOLD)
        recompute = self.recompute_s(tokens, context)
        read = self.read_s(tokens) + ((self._lookup_s or 0.0) if before_lookup else 0.0)
        if read <= (1.0 - self.margin) * recompute:
            return Decision(True, READ, read, recompute)
        if self._recheck or self._probe_due():
            if not before_lookup:
                # This request probes: the next one waits its interval again, whether or not
                # this read gets measured (it may miss, fail, or go to a new engine).
                self._last_read = self._now()
                self._declined_since_read = 0
                self._recheck = False
            return Decision(True, PROBE, read, recompute)
        self._declined_since_read += 1
        return Decision(False, RECOMPUTE_CHEAPER, read, recompute)

    def _unmeasured(self) -> bool:
        """By cost, no read measured yet: every reusable stretch is read, whatever its size.
        Reading is how the read model learns, and with prefix caching on, what a turn can
        read past prefill's own cache is often under the threshold (the previous answer, a
        block or two): gated by it, no read would ever be measured, nor any such stretch read."""
        return self.by_cost and self._read.samples < MIN_READ_SAMPLES

    def _probe_due(self) -> bool:
        return (self.probe_interval_s > 0 and self._declined_since_read >= self.probe_after
                and self._now() - self._last_read >= self.probe_interval_s)
