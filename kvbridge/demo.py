"""`kvbridge demo`: a multi-turn conversation through the gateway, turn by turn: TTFT, the
prompt tokens prefill took from its own prefix cache (local), read back from decode (reused)
and computed (recomputed), and the
conversation's lease after the turn. It runs twice by default: once naming its conversation
(`conversation_id`), as a client written for kvbridge does, and once naming none, as the
OpenAI SDK, agent frameworks and chat front-ends do: the gateway then finds the conversation
from the request's own history (`X-Kvbridge-Conversation-Source`)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp
import click

from kvbridge import aio

_WORDS = ("the model keeps a cache of keys and values for every token it has seen so that "
          "the next turn of a conversation does not compute the whole history again when a "
          "user asks a question an agent calls a tool and reads the answer then writes "
          "code tests it and explains what changed in the plan for the release").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def run_demo(gateway: str, *, turns: int = 5, model: str = "", as_json: bool = False,
                   api_key: str = "demo-key", conversation_id: str = "",
                   first_words: int = 400, turn_words: int = 100, max_tokens: int = 24,
                   think_s: float = 1.0, keep: bool = False, seed: int = 0,
                   ways: tuple[str, ...] = ("with-id", "without-id")) -> list[dict[str, Any]]:
    """Run the conversation once per way ("with-id": it names its conversation; "without-id":
    the gateway finds it by content); print one line (or JSON record) per turn; return the
    records."""
    records: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=600)
    auth = {"Authorization": f"Bearer {api_key}"}
    async with aiohttp.ClientSession(timeout=timeout, headers=auth) as http:
        if not model:
            async with http.get(f"{gateway}/v1/models") as resp:
                data = await _json_or_fail(resp, "GET /v1/models")
            if not data.get("data"):
                raise click.ClickException("the gateway lists no model: are engines attached?")
            model = data["data"][0]["id"]
        for n, way in enumerate(ways):
            records += await _conversation(
                http, gateway, model, way, turns=turns, as_json=as_json,
                conversation_id=conversation_id if way == "with-id" else "",
                first_words=first_words, turn_words=turn_words, max_tokens=max_tokens,
                think_s=think_s, keep=keep, seed=seed + n)
    return records


async def _conversation(http: aiohttp.ClientSession, gateway: str, model: str, way: str, *,
                        turns: int, as_json: bool, conversation_id: str, first_words: int,
                        turn_words: int, max_tokens: int, think_s: float, keep: bool,
                        seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    named = way == "with-id"
    conversation = (conversation_id or f"demo-{int(time.time())}-{rng.randrange(10**6)}"
                    if named else "")
    records: list[dict[str, Any]] = []
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": _text(rng, first_words)}]
    if not as_json:
        what = (f"conversation {conversation}" if named
                else "a conversation that names no id (the gateway finds it by content)")
        click.echo(f"{what} on {model} via {gateway}")
        click.echo(f"{'turn':>4} {'prompt':>6} {'ttft_ms':>8} {'local':>5} {'reused':>6} "
                   f"{'recomputed':>10}  {'found':<10} {'decode':<10} lease after the turn")
    for turn in range(1, turns + 1):
        record = await _turn(http, gateway, model, messages, conversation if named else "",
                             max_tokens)
        record["turn"], record["way"] = turn, way
        if not named:  # the id the gateway found (or gave) this turn: for its lease only
            conversation = record["conversation_id"]
        if think_s:
            await asyncio.sleep(think_s)  # the user reads; decode grants its lease meanwhile
        record["lease"] = None
        if conversation:
            async with http.get(f"{gateway}/v1/conversations/{conversation}") as resp:
                record["lease"] = (await resp.json()) if resp.status == 200 else None
        answer = record.pop("answer")
        records.append(record)
        _print_turn(record, as_json)
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": _text(rng, turn_words)})
    released = 0
    if not keep and conversation:
        async with http.delete(f"{gateway}/v1/conversations/{conversation}") as resp:
            released = (await resp.json()).get("released", 0) if resp.status == 200 else 0
    prompt = sum(r["prompt_tokens"] for r in records)
    reused = sum(r["reused_tokens"] for r in records)
    local = sum(r["local_tokens"] for r in records)
    if not as_json:
        share = f" ({reused / prompt:.0%})" if prompt else ""
        cached = f", {local} from prefill's own cache," if local else ""
        click.echo(f"{way}: reused {reused} of {prompt} prompt tokens{share} from decode"
                   f"{cached} over {turns} turns"
                   + ("" if keep else f"; conversation ended, {released} lease released"))
    return records


async def _turn(http: aiohttp.ClientSession, gateway: str, model: str,
                messages: list[dict[str, str]], conversation: str, max_tokens: int
                ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if conversation:
        body["conversation_id"] = conversation
    start = time.perf_counter()
    ttft = 0.0
    answer: list[str] = []
    usage: dict[str, Any] = {}
    async with http.post(f"{gateway}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise click.ClickException(f"turn failed: HTTP {resp.status}: "
                                       f"{(await resp.text())[:500]}")
        headers = resp.headers
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if not ttft and choice.get("delta") and "role" not in choice["delta"]:
                    ttft = time.perf_counter() - start  # the first token, even an empty one
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    answer.append(piece)
            usage = chunk.get("usage") or usage
    return {"ttft_ms": round(ttft * 1000, 1),
            "prefill_ms": float(headers.get("X-Kvbridge-Prefill-Ms", 0)),
            "prompt_tokens": int(usage.get("prompt_tokens", 0)),
            "completion_tokens": int(usage.get("completion_tokens", 0)),
            "reused_tokens": int(headers.get("X-Kvbridge-Reused-Tokens", 0)),
            "local_tokens": int(headers.get("X-Kvbridge-Local-Tokens", 0)),
            "recomputed_tokens": int(headers.get("X-Kvbridge-Recomputed-Tokens", 0)),
            "decision": headers.get("X-Kvbridge-Decision", ""),
            "prefill_instance": headers.get("X-Kvbridge-Prefill-Instance", ""),
            "decode_instance": headers.get("X-Kvbridge-Decode-Instance", ""),
            "decode_reason": headers.get("X-Kvbridge-Decode-Reason", ""),
            "source": headers.get("X-Kvbridge-Conversation-Source", ""),
            "conversation_id": headers.get("X-Kvbridge-Conversation-Id", ""),
            "answer": "".join(answer)}


def _print_turn(record: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(record, sort_keys=True))
        return
    lease = record["lease"]
    state = (f"{lease['state']} epoch {lease['epoch']}, {lease['tokens']} tokens on "
             f"{lease['holder']}, {lease['expires_in_s']:.0f}s left" if lease else "none")
    click.echo(f"{record['turn']:>4} {record['prompt_tokens']:>6} {record['ttft_ms']:>8.1f} "
               f"{record['local_tokens']:>5} {record['reused_tokens']:>6} "
               f"{record['recomputed_tokens']:>10}  "
               f"{record['source']:<10} {record['decode_instance']:<10} {state}")


async def _json_or_fail(resp: aiohttp.ClientResponse, what: str) -> dict[str, Any]:
    if resp.status != 200:
        raise click.ClickException(f"{what}: HTTP {resp.status}: {(await resp.text())[:300]}")
    data = await resp.json()
    return data if isinstance(data, dict) else {}


@click.command("demo")
@click.option("--gateway", default="http://127.0.0.1:8080", show_default=True,
              envvar="KVBRIDGE_GATEWAY", help="gateway base URL [env KVBRIDGE_GATEWAY]")
@click.option("--turns", default=5, show_default=True, type=click.IntRange(1, 100),
              help="turns of the conversation")
@click.option("--model", default="", help="model name (default: the gateway's first)")
@click.option("--api-key", default="demo-key", show_default=True, envvar="KVBRIDGE_API_KEY",
              help="bearer API key: it decides the tenant [env KVBRIDGE_API_KEY]")
@click.option("--conversation-id", default="", help="the named run's id (default: a new one)")
@click.option("--ways", type=click.Choice(["both", "with-id", "without-id"]), default="both",
              show_default=True,
              help="run the conversation naming its id, naming none (found by content), or both")
@click.option("--think-s", default=1.0, show_default=True, type=click.FloatRange(min=0),
              help="pause between turns")
@click.option("--keep", is_flag=True, help="do not release the conversation's KV at the end")
@click.option("--json", "as_json", is_flag=True, help="one JSON record per turn")
def demo_command(gateway: str, turns: int, model: str, api_key: str, conversation_id: str,
                 ways: str, think_s: float, keep: bool, as_json: bool) -> None:
    """Run a multi-turn conversation through a running gateway (`kvbridge up --cpu-engines`)
    and print, per turn, TTFT, reused and recomputed prompt tokens, and the lease's state."""
    try:
        aio.run(run_demo(gateway.rstrip("/"), turns=turns, model=model, as_json=as_json,
                         api_key=api_key, conversation_id=conversation_id, think_s=think_s,
                         keep=keep, ways=("with-id", "without-id") if ways == "both"
                         else (ways,)))
    except aiohttp.ClientError as err:
        raise click.ClickException(f"cannot reach the gateway at {gateway}: {err}; is "
                                   "`kvbridge up --cpu-engines` running?") from err
