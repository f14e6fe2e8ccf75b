"""The clock deadlines run on counts the time a host spends suspended (`kvbridge.clock`).

A host cannot be suspended from a test, but a Linux time namespace can start a process whose
CLOCK_BOOTTIME is ahead of its CLOCK_MONOTONIC, as on a host that slept: every deadline the
registry, the holder session and the connector keep must then read the former."""

from __future__ import annotations

import importlib
import inspect
import shutil
import subprocess
import sys
import time

import pytest

from kvbridge.clock import SystemClock, monotonic

# Modules whose deadlines another host's depend on: they read `kvbridge.clock.monotonic` only.
_DEADLINE_MODULES = ["kvbridge.clients._base", "kvbridge.clients._holder_session",
                     "kvbridge.services.registry._redis", "kvbridge.services.registry._core",
                     "kvbridge.services.registry._redis_clock",
                     "kvbridge.services.registry._redis_events"]
_CONNECTOR_MODULES = ["kvbridge.connector._prefill", "kvbridge.connector._decode",
                      "kvbridge.connector._connector", "kvbridge.connector._pin_guard"]

SLEPT_S = 1000

# Each deadline clock, less time.monotonic(), in a process that "slept" SLEPT_S seconds.
_PROBE = """
import time
from kvbridge.clock import SystemClock
from kvbridge.clients._holder_session import HolderSession
session = HolderSession(None, holder_id="d", nixl_host="127.0.0.1", nixl_port=1, block_size=16,
                        engine_fingerprint="f", on_reclaim=lambda ids, cause: None)
clocks = {"system": SystemClock().monotonic, "holder_session": session.clock.monotonic}
try:
    import vllm  # noqa: F401
except ImportError:
    pass
else:
    from kvbridge.connector import _connector, _decode, _prefill
    from kvbridge.connector._pin_guard import PinGuard
    clocks.update(prefill=_prefill.monotonic, decode=_decode.monotonic,
                  scheduler_pin_ends=_connector.monotonic, pin_guard=PinGuard(2.0)._clock)
for name, clock in clocks.items():
    print(name, clock() - time.monotonic())
"""


def _time_namespaces() -> bool:
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--time", "--boottime", "1", "true"],
                           capture_output=True, check=False)
    return probe.returncode == 0


def test_the_deadline_clock_is_the_one_that_counts_suspend() -> None:
    if not hasattr(time, "CLOCK_BOOTTIME"):
        pytest.skip("no CLOCK_BOOTTIME here: deadlines use time.monotonic()")
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    ours, system = monotonic(), SystemClock().monotonic()
    after = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert before <= ours <= system <= after


def _deadline_modules() -> list[str]:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return _DEADLINE_MODULES
    return _DEADLINE_MODULES + _CONNECTOR_MODULES


@pytest.mark.parametrize("name", _deadline_modules())
def test_deadline_modules_read_no_other_clock(name: str) -> None:
    """Wired by identity and by source: a call site put back on `time.monotonic()` or the
    event loop's clock fails here even on a host that never slept (where the clocks agree)."""
    module = importlib.import_module(name)
    source = inspect.getsource(module)
    for other in ("time.monotonic(", "loop.time(", "time.perf_counter("):
        assert other not in source, f"{name} reads {other}): deadlines use kvbridge.clock"
    if "monotonic" in vars(module):
        assert module.monotonic is monotonic


def test_the_pin_guard_checks_on_the_deadline_clock() -> None:
    pytest.importorskip("vllm", reason="the engine extra is not installed")
    from kvbridge.connector._pin_guard import PinGuard
    assert PinGuard(2.0)._clock is monotonic


@pytest.mark.skipif(not _time_namespaces(),
                    reason="needs `unshare --time` (Linux time namespaces, as root)")
def test_every_deadline_clock_counts_the_time_a_host_slept() -> None:
    # The namespace's offset adds to whatever this host (or an outer namespace) has slept.
    slept_before = time.clock_gettime(time.CLOCK_BOOTTIME) - time.monotonic()
    out = subprocess.run(
        ["unshare", "--time", "--boottime", str(SLEPT_S), sys.executable, "-c", _PROBE],
        capture_output=True, text=True, check=True, timeout=120).stdout
    ahead = {name: float(value) for name, value in (line.split() for line in out.splitlines())}
    assert {"system", "holder_session"} <= set(ahead)
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        assert {"prefill", "decode", "scheduler_pin_ends", "pin_guard"} <= set(ahead)
    for name, value in ahead.items():
        assert abs(value - slept_before - SLEPT_S) < 1.0, \
            f"{name}'s clock stops while the host sleeps"
