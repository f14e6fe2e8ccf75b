"""Engine launching helpers that need no vLLM: the engine command lines and core pinning."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvbridge.engines import (
    POLLER_NICE,
    Engine,
    EngineSpec,
    control_plane_cpus,
    demote_busy_pollers,
    freeze_tree,
    pin_to_core,
    start_engine,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")

_TREE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_pin_to_core_moves_every_thread_of_the_process_tree() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        cpu = max(os.sched_getaffinity(0))
        moved = pin_to_core(proc.pid, cpu)
        threads = [(pid, int(tid)) for pid in (proc.pid, child)
                   for tid in os.listdir(f"/proc/{pid}/task")]
        assert len(threads) >= 3  # the parent's two threads and the child's one
        for _, tid in threads:
            assert os.sched_getaffinity(tid) == {cpu}
        if len(os.sched_getaffinity(0)) > 1:
            assert moved == len(threads)
        assert pin_to_core(proc.pid, cpu) == 0  # nothing left to move
    finally:
        for pid in (child, proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


_POLLER = """
import threading, time
def spin():
    while True:
        pass
spinner = threading.Thread(target=spin, daemon=True)
spinner.start()
sleeper = threading.Thread(target=time.sleep, args=(60,), daemon=True)
sleeper.start()
time.sleep(0.2)
print(spinner.native_id, sleeper.native_id, flush=True)
time.sleep(60)
"""


def test_demote_busy_pollers_renices_a_spinning_helper_thread_only() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _POLLER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    spinner, sleeper = map(int, proc.stdout.readline().split())
    try:
        nice = os.getpriority(os.PRIO_PROCESS, proc.pid)
        assert demote_busy_pollers(proc.pid, sample_s=0.5) == [spinner]
        assert os.getpriority(os.PRIO_PROCESS, spinner) == POLLER_NICE
        for tid in (proc.pid, sleeper):  # the main thread computes: never demoted
            assert os.getpriority(os.PRIO_PROCESS, tid) == nice
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_demote_busy_pollers_finds_a_poller_that_shares_its_core() -> None:
    """Engines that share a core share it among their pollers: with two more spinning on the
    same core, the engine's poller gets about a third of it and is still a poller."""
    cpu = min(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", _POLLER], stdout=subprocess.PIPE,
                              text=True) for _ in range(3)]
    try:
        spinners = []
        for proc in procs:
            assert proc.stdout is not None
            spinners.append(int(proc.stdout.readline().split()[0]))
            pin_to_core(proc.pid, cpu)
        assert demote_busy_pollers(procs[0].pid, sample_s=1.0) == [spinners[0]]
        assert os.getpriority(os.PRIO_PROCESS, spinners[0]) == POLLER_NICE
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_control_plane_runs_off_the_engine_cores_or_anywhere() -> None:
    allowed = os.sched_getaffinity(0)
    assert control_plane_cpus(set(allowed)) == allowed  # no core left: never one engine's
    if len(allowed) > 1:
        engine = {min(allowed)}
        assert control_plane_cpus(engine) == allowed - engine


class _SleeperSpec(EngineSpec):
    def command(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def test_an_engine_has_its_own_process_group_in_the_callers_session(tmp_path: Path) -> None:
    """Its own group, so that stopping it stops its whole tree; the caller's session, so that
    the kernel's autogroup scheduling (one equal share per session) does not override the
    priorities that keep pollers and engines below the control plane on a shared core."""
    engine = start_engine(_SleeperSpec("decode", "/m", 1, 2, "d0", nice=10), tmp_path)
    try:
        assert os.getpgid(engine.process.pid) == engine.process.pid
        assert os.getsid(engine.process.pid) == os.getsid(0)
        deadline = time.monotonic() + 10  # `nice` sets it, then execs the engine
        while os.getpriority(os.PRIO_PROCESS, engine.process.pid) < 10:
            assert time.monotonic() < deadline, "the engine was never niced"
            time.sleep(0.05)
    finally:
        engine.stop(timeout=10)
    assert engine.process.returncode is not None


def test_freeze_tree_stops_and_resumes_the_whole_tree() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())

    def states(want: bool) -> list[bool]:
        """Whether each process is stopped, once both are as wanted or after 2 s (signal
        delivery is asynchronous)."""
        out: list[bool] = []
        for _ in range(200):
            out = []
            for pid in (proc.pid, child):
                with open(f"/proc/{pid}/stat") as f:
                    out.append(f.read().rsplit(")", 1)[1].split()[0] == "T")
            if out == [want, want]:
                break
            time.sleep(0.01)
        return out

    try:
        assert freeze_tree(proc.pid, True) == 2
        assert states(True) == [True, True]
        assert freeze_tree(proc.pid, False) == 2
        assert states(False) == [False, False]
    finally:
        for pid in (child, proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_stock_nixl_engines_get_vllms_own_connector_and_no_kvbridge_settings() -> None:
    spec = EngineSpec("prefill", "/m", 1, 2, "p0", connector="nixl", bidirectional=True,
                      prefix_caching=True)
    config = spec.kv_transfer_config()
    assert config["kv_connector"] == "NixlConnector"
    assert "kv_connector_module_path" not in config
    assert config["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True,
                                                   "kv_recompute_threshold": 64}
    cmd = spec.command()
    assert "--enable-prefix-caching" in cmd and "--no-enable-prefix-caching" not in cmd
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == config


def test_kvbridge_prefill_has_prefix_caching_on_by_default() -> None:
    """Its own cache serves a prompt's leading blocks; reads from decode bring the rest (in
    one request, synchronously too)."""
    spec = EngineSpec("prefill", "/m", 1, 2, "p0", registry="127.0.0.1:1")
    assert "--enable-prefix-caching" in spec.command()
    assert "--no-enable-prefix-caching" not in spec.command()
    assert spec.kv_transfer_config()["kv_connector"] == "KVBridgeConnector"
    off = EngineSpec("prefill", "/m", 1, 2, "p0", registry="127.0.0.1:1", prefix_caching=False)
    assert "--no-enable-prefix-caching" in off.command()
    decode = EngineSpec("decode", "/m", 1, 2, "d0", registry="127.0.0.1:1")
    assert "--no-enable-prefix-caching" not in decode.command()
    with pytest.raises(ValueError, match="connector must be"):
        EngineSpec("decode", "/m", 1, 2, "d0", connector="lmcache")


def test_stopping_an_engine_removes_its_temp_folder(tmp_path: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvb-"))
    (tmp / "torchinductor").mkdir()
    (tmp / "torchinductor" / "kernel.so").write_bytes(b"x" * 1024)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    engine = Engine(EngineSpec("prefill", "/m", 1, 2, "p0"), proc, tmp_path / "p0.log", tmp)
    engine.stop(timeout=10)
    assert proc.returncode is not None
    assert not tmp.exists()
