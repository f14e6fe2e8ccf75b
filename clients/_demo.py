"""`kvbridge registry demo`: a multi-turn conversation through the lease protocol, over gRPC.

A decode engine (a `HolderSession`) leases the KV it keeps after each turn; a prefill engine
asks for a verified, pinned read before each turn, exactly as the connector does. No model
runs: tokens are synthetic, but every call is a real RPC to a real registry (started in this
process unless `--registry` names one).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from typing import Any

import click

from kvbridge import blockhash
from kvbridge.auth import TOKEN_ENV
from kvbridge.clients._cli import address_callback
from kvbridge.clients._holder_session import GrantOutcomeUnknown, HolderSession
from kvbridge.clients._registry import RegistryClient, seconds
from kvbridge.registry.v1 import registry_pb2 as pb

BLOCK_SIZE = 16
FINGERPRINT = blockhash.engine_fingerprint({"model": "demo", "dtype": "float32", "tp": 1})


class _BackgroundRegistry:
    """A registry on 127.0.0.1:0 in a thread of this process."""

    def __init__(self, idle_ttl: float) -> None:
        self._idle_ttl = idle_ttl
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._main, name="demo-registry", daemon=True)

    def __enter__(self) -> _BackgroundRegistry:
        self._thread.start()
        if not self._ready.wait(10):
            raise click.ClickException("the demo registry did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _main(self) -> None:
        from kvbridge.clock import SystemClock
        from kvbridge.services.registry import LeaseTable, RegistryConfig, create_server

        async def run() -> None:
            config = RegistryConfig(listen="127.0.0.1:0", metrics_listen="",
                                    default_idle_ttl_s=self._idle_ttl,
                                    min_idle_ttl_s=min(1.0, self._idle_ttl))
            table = LeaseTable(config, SystemClock(), recovering=False)
            server = await create_server(config, table=table)
            await server.start()
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self.port = server.port
            self._ready.set()
            await self._stop.wait()
            await server.stop(0)

        asyncio.run(run())


def _describe_read(read: pb.AcquireReadResponse, reusable: int) -> str:
    if read.miss_reason != pb.MISS_REASON_UNSPECIFIED:
        reason = pb.MissReason.Name(read.miss_reason).removeprefix("MISS_REASON_").lower()
        where = f" at block {read.mismatch_block}" if reason == "hash_mismatch" else ""
        return f"miss ({reason}{where})"
    tail = f" + partial {read.partial_block_tokens}" if read.partial_block_tokens else ""
    stop = ""
    full_blocks = read.lease.token_count // BLOCK_SIZE
    if read.partial_block_tokens == 0 and read.matched_blocks < full_blocks:
        stop = f", history differs from block {read.mismatch_block}"
    return (f"hit {reusable} tokens ({read.matched_blocks} blocks{tail}{stop}) "
            f"from {read.holder.holder_id}, pin {seconds(read.pin.expires_in):.0f}s")


def run_demo(target: str, turns: int, idle_ttl: float, seed: int,
             emit: Any = click.echo) -> dict[str, Any]:
    rng = random.Random(seed)
    freed: list[str] = []
    client = RegistryClient(target, timeout=2.0, token=os.environ.get(TOKEN_ENV) or None)
    decode = HolderSession(client, holder_id="decode-0", nixl_host="127.0.0.1", nixl_port=5600,
                           block_size=BLOCK_SIZE, engine_fingerprint=FINGERPRINT,
                           on_reclaim=freed.extend, ttl=3.0)
    decode.start()
    tenant, conversation = "demo-tenant", f"conv-{rng.randrange(10**6)}"
    history = [rng.randrange(50000) for _ in range(rng.randrange(300, 500))]
    summary: dict[str, Any] = {"turns": []}
    for turn in range(1, turns + 1):
        if turn > 1:
            history += [rng.randrange(50000) for _ in range(rng.randrange(100, 160))]  # user
        edited = turn == turns and turns >= 4
        prompt = list(history)
        if edited:  # the client rewrites an earlier answer: reuse must stop there
            cut = len(prompt) // 2
            prompt[cut] = (prompt[cut] + 1) % 50000
        hashes = blockhash.block_hashes(prompt, BLOCK_SIZE, FINGERPRINT)
        read = client.acquire_read(tenant, conversation, hashes, min_tokens=64,
                                   reader_id="prefill-0")
        reusable = 0
        if read.miss_reason == pb.MISS_REASON_UNSPECIFIED:
            reusable = read.matched_tokens
            if read.partial_block_tokens:
                mine = blockhash.partial_block_hash(
                    prompt, read.lease.token_count, BLOCK_SIZE, FINGERPRINT, full_hashes=hashes)
                if mine == read.partial_block_hash:
                    reusable += read.partial_block_tokens
            client.release_read(read.pin.pin_id)
        answer = [rng.randrange(50000) for _ in range(rng.randrange(20, 60))]
        held = prompt + answer[:-1]  # the last sampled token has no KV yet
        blocks = -(-len(held) // BLOCK_SIZE)
        try:
            lease = decode.grant(tenant, conversation, f"decode-req-{turn}",
                                 list(range(turn * 1000, turn * 1000 + blocks)), len(held),
                                 blockhash.block_hashes(held, BLOCK_SIZE, FINGERPRINT,
                                                        include_partial=True),
                                 idle_ttl=idle_ttl)
            lease_text = f"lease {lease.lease_id} epoch {lease.epoch}" if lease else "no lease"
        except GrantOutcomeUnknown as unknown:  # a real engine would keep the blocks
            lease_text = f"grant outcome unknown ({unknown})"
        history = prompt + answer
        note = " (history edited)" if edited else ""
        emit(f"turn {turn}{note}: prompt {len(prompt)} tokens; prefill read: "
             f"{_describe_read(read, reusable)}; recompute {len(prompt) - reusable}; "
             f"decode keeps {len(held)} tokens -> {lease_text}")
        summary["turns"].append({"turn": turn, "prompt_tokens": len(prompt),
                                 "reused_tokens": reusable,
                                 "recomputed_tokens": len(prompt) - reusable})
        decode.heartbeat_once()
    superseded = len(freed)
    emit(f"superseded turns reclaimed by decode so far: {superseded}")
    emit(f"conversation goes idle for {idle_ttl + 0.5:.1f}s (idle TTL {idle_ttl:g}s) ...")
    time.sleep(idle_ttl + 0.5)
    decode.heartbeat_once()
    current = client.list_leases(tenant=tenant, conversation_id=conversation,
                                 include_inactive=True)
    states = sorted({pb.LeaseState.Name(x.state).removeprefix("LEASE_STATE_").lower()
                     for x in current.leases}) or ["gone"]
    emit(f"after idle: lease state {', '.join(states)}; decode freed {len(freed)} lease(s) "
         f"in total, holds {len(decode.held())}")
    decode.close()
    client.close()
    summary.update(reclaimed=len(freed), held_after_idle=len(decode.held()))
    return summary


@click.command("demo")
@click.option("--registry", default="", callback=address_callback(optional=True),
              help="use this registry (HOST:PORT) instead of starting one in-process")
@click.option("--turns", default=5, show_default=True, type=click.IntRange(1, 50),
              help="turns of the demo conversation")
@click.option("--idle-ttl", default=2.0, show_default=True, type=click.FloatRange(1.0, 60.0),
              help="lease idle TTL for the demo conversation, seconds")
@click.option("--seed", default=7, show_default=True,
              help="seed of the demo's random token ids")
def demo_command(registry: str, turns: int, idle_ttl: float, seed: int) -> None:
    """Walk a multi-turn conversation through the lease protocol and print each step."""
    if registry:
        summary = run_demo(registry, turns, idle_ttl, seed)
    else:
        with _BackgroundRegistry(idle_ttl) as reg:
            click.echo(f"registry listening on 127.0.0.1:{reg.port} (in-process)")
            summary = run_demo(f"127.0.0.1:{reg.port}", turns, idle_ttl, seed)
    reused = sum(t["reused_tokens"] for t in summary["turns"])
    total = sum(t["prompt_tokens"] for t in summary["turns"])
    click.echo(f"reused {reused} of {total} prompt tokens ({reused / total:.0%}) over "
               f"{turns} turns")
