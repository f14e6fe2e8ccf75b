"""`kvbridge bench registry`: the registry's control-plane figures, beside a trivial echo service.

Starts a registry and a trivial grpc.aio echo service, each in a process of its own, and drives
them from this one, so that the registry is measured against the limit of this machine's gRPC
stack in the same run (ratios, not absolute numbers, are what transfer between machines):

- acquire-read latency (p50/p99) at a fixed offered rate (open loop), against 64-block leases,
  and the echo service's at the same rate: each offered alone in 0.25 s windows taken in turn
  (so that each sees the offered rate, and a stall of the machine falls on both), requests
  built ahead of time for both and replies left as bytes while timed (every registry reply is
  checked after its round); the same through the client library beside them;
- the highest sustained AcquireRead rate (closed loop, many calls in flight), and the echo's;
- with `--auth`, the same two figures (keys ending `_auth`) for a second registry that
  authenticates every call by bearer token (as deployed; the first runs in insecure local
  mode), a reader token limited to the bench's tenant, interleaved with the others;
- lease renewals per second through the batched RenewLeases;
- resident memory per lease, from the registry's RSS before and after granting N leases;
- how late expiry fires (p99), from the registry's own lateness figure on EXPIRED events,
  with the N leases still live in the expiry queue;
- the lookup by content (issue 34): PinLease by history keys at the offered rate, hits and
  misses, beside the echo, on a registry of its own holding N leases across
  `--lookup-tenants` tenants.

Every lease is granted with history keys as the gateway grants them
(`kvbridge.history.grant_keys` of a `--lookup-messages` history), so that the memory per lease
includes the lookup index.

With `--backend redis` or `redis-cluster`, the same figures (but the list flood and the lookup)
for 1..`--replicas` registry replicas sharing one Redis or a Redis Cluster, with each
primary's commands and function calls over the AcquireRead rounds (`primary_commands`,
`primary_fcalls`) and over the whole configuration (`_all`). The registry shards a cluster's
state by tenant, so the leases there are dealt over `--tenants` tenants: with one, every read
would go to one primary.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import grpc

from kvbridge import aio, grpc_env, history
from kvbridge.clients._registry import AsyncRegistryClient, seconds
from kvbridge.clients._registry import duration as duration_pb
from kvbridge.errors import KvbridgeError
from kvbridge.registry.v1 import registry_pb2 as pb

ECHO_METHOD = "/kvbridge.bench.Echo/Echo"
ACQUIRE_METHOD = "/kvbridge.registry.v1.RegistryService/AcquireRead"
PIN_METHOD = "/kvbridge.registry.v1.RegistryService/PinLease"
_PORT_LINE = re.compile(r"^(?:PORT (\d+)|.*\"listen\": \"[^\"]*:(\d+)\")")


def _identity(b: bytes) -> bytes:
    return b


def _history_root(tenant: str, conversation: int) -> bytes:
    """A synthetic conversation's own root: its history keys are derived from it."""
    return hashlib.blake2b(f"{tenant}/{conversation}".encode(), digest_size=16).digest()


def _history_key(root: bytes, boundary: int) -> bytes:
    """The conversation's history key at message `boundary` (0: after its first message).
    Keys are opaque 16-byte values to the registry: derived per boundary here (the same keys
    at the same boundaries for every turn of the conversation, each turn's request continuing
    the one before), not chained over message text as `history.request_keys` chains them,
    which would cost the driver a hash per message and change nothing the registry sees."""
    return hashlib.blake2b(boundary.to_bytes(4, "little"), key=root,
                           digest_size=history.KEY_SIZE).digest()


def _grant_boundaries(messages: int) -> list[int]:
    """Which of a `messages`-message history's boundaries `history.grant_keys` picks for the
    lease (0-based, shortest prefix first)."""
    picked = history.grant_keys([j.to_bytes(history.KEY_SIZE, "big") for j in range(messages)])
    return [int.from_bytes(k, "big") for k in history.split(picked)]


def _lease_history(root: bytes, boundaries: Sequence[int]) -> bytes:
    """The history keys a lease is granted with (GrantLeaseRequest.history_keys)."""
    return b"".join(_history_key(root, j) for j in boundaries)


def _request_history(root: bytes, messages: int) -> bytes:
    """A request's history keys, one per message boundary (PinLeaseRequest.history_keys)."""
    return b"".join(_history_key(root, j) for j in range(messages))


async def _flood_main(port: int, tenant: str, polite: bool) -> None:
    """Another tenant's client looping ListLeases filtered by its own tenant, as fast as the
    registry lets it (`polite`: waiting as long as a refusal's retry_after_s says, as a client
    should) or as fast as it answers, refusals included; until killed. Prints how many calls
    it made ("LISTED answered refused") after each of its first calls, then every 20."""
    client = AsyncRegistryClient(f"127.0.0.1:{port}", timeout=30, retries=0)
    print("PORT 0", flush=True)
    answered = refused = 0
    while True:
        try:
            await client.list_leases(tenant=tenant, include_inactive=True, page_size=1000)
            answered += 1
        except KvbridgeError as err:
            refused += 1
            wait = float(err.metadata.get("retry_after_s", 0)) if polite else 0.0
            await asyncio.sleep(wait)
        if answered + refused <= 3 or (answered + refused) % 20 == 0:  # the first at once
            print(f"LISTED {answered} {refused}", flush=True)


async def _echo_main() -> None:
    """A trivial grpc.aio echo service (the baseline), printing its port."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler("kvbridge.bench.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, _identity, _identity)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


@dataclass
class _Proc:
    popen: subprocess.Popen[str]
    port: int

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.popen.pid}/status").read_text()
        kib = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))  # type: ignore[union-attr]
        return kib * 1024

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _spawn(args: list[str], env: dict[str, str] | None = None) -> _Proc:
    popen = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **(env or {})})
    assert popen.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if not line:
            break
        m = _PORT_LINE.match(line)
        if m:
            return _Proc(popen, int(m.group(1) or m.group(2)))
    popen.kill()
    raise RuntimeError(f"{args[:4]} did not start: {popen.stdout.read()[-2000:]}")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


async def _open_loop(call: Callable[[int], Awaitable[Any]], rate: float, duration: float
                     ) -> list[float]:
    """Issue calls at a fixed offered rate regardless of replies; return latencies in ms."""
    latencies: list[float] = []
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        start = time.perf_counter()
        await call(i)
        latencies.append((time.perf_counter() - start) * 1000)

    tasks = []
    n = int(rate * duration)
    t0 = loop.time()
    for i in range(n):
        delay = t0 + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return latencies


async def _open_loop_alternating(calls: tuple[Callable[[int], Awaitable[Any]], ...],
                                 rate: float, duration: float, window: float = 0.25
                                 ) -> list[list[float]]:
    """Offer each call `rate` per second for `duration` seconds in all, in short windows taken
    in turn (A for `window` s, then B, then A, ...): each service sees exactly the offered
    rate with the other idle, and a stall of this machine that lasts longer than a window
    falls on both. Returns each call's latencies in ms."""
    latencies: list[list[float]] = [[] for _ in calls]
    windows = max(round(duration / window), 1)
    first = [0] * len(calls)
    for _ in range(windows):
        for which, call in enumerate(calls):
            base = first[which]

            def numbered(i: int, call: Callable[[int], Awaitable[Any]] = call,
                         base: int = base) -> Awaitable[Any]:
                return call(base + i)

            latencies[which] += await _open_loop(numbered, rate, window)
            first[which] += int(rate * window)
    return latencies


async def _closed_loop(call: Callable[[int], Awaitable[Any]], concurrency: int,
                       duration: float, first: int = 0) -> float:
    """Keep `concurrency` calls in flight for `duration`; return completed calls per second.
    Calls are numbered from `first`."""
    done = 0
    stop_at = time.perf_counter() + duration

    async def worker(w: int) -> None:
        nonlocal done
        i = first + w
        while time.perf_counter() < stop_at:
            await call(i)
            done += 1
            i += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / (time.perf_counter() - start)


async def _bounded(coros: Callable[[int], Awaitable[Any]], n: int, concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await coros(i)

    await asyncio.gather(*(one(i) for i in range(n)))


@dataclass
class _Registries:
    """The registry processes measured (one, or replicas sharing a Redis) and how to read the
    memory their leases take (the process's RSS, or Redis's used_memory)."""

    procs: list[_Proc]
    memory_bytes: Callable[[], int]
    cpu_seconds: Callable[[], float]
    redis: bool = False
    # Per Redis primary, in order: (commands processed, function calls) so far; the deltas
    # over the AcquireRead rounds show whether every primary serves the reads.
    primary_counts: Callable[[], list[tuple[int, int]]] | None = None

    @property
    def ports(self) -> list[int]:
        return [p.port for p in self.procs]


# The secured registry's token table (`--auth`): an admin sets up, a reader limited to the
# bench's tenant reads (as a prefill engine would).
_ADMIN_TOKEN = "bench-admin-" + uuid.uuid4().hex
_READER_TOKEN = "bench-reader-" + uuid.uuid4().hex
_TOKENS = f"{_ADMIN_TOKEN} admin; {_READER_TOKEN} reader tenants=bench name=bench-reader"


def _grpc_env() -> dict[str, str]:
    """The gRPC settings every process measured here runs with: this process's
    GRPC_EXPERIMENTS when it has one (`kvbridge bench registry` sets kvbridge's default, unless
    the operator chose), else kvbridge's default, as `kvbridge registry serve` would."""
    return {"GRPC_EXPERIMENTS": os.environ.get("GRPC_EXPERIMENTS",
                                               grpc_env.DEFAULT_SERVER_EXPERIMENTS)}


def _registry_proc(leases: int, extra: Sequence[str] = (), secured: bool = False) -> _Proc:
    proc = _spawn([sys.executable, "-m", "kvbridge.cli", "registry", "serve",
                   *(() if secured else ("--insecure",)),
                   "--listen", "127.0.0.1:0", "--metrics-listen", "",
                   "--log-level", "info", "--log-format", "json",
                   "--max-leases", str(leases * 2 + 100000), *extra],
                  env={**_grpc_env(), **({"KVBRIDGE_AUTH_TOKENS": _TOKENS} if secured else {})})
    # The registry logs nothing per RPC; drain its output so a burst of warnings cannot block.
    assert proc.popen.stdout is not None
    threading.Thread(target=proc.popen.stdout.read, daemon=True).start()
    return proc


async def _run(leases: int, blocks: int, rate: float, duration: float, concurrency: int,
               rounds: int, log: Callable[[str], None],
               registries: _Registries | None = None, secured: bool = False,
               lookup_tenants: int = 1000, lookup_messages: int = 200, tenants: int = 1
               ) -> dict[str, Any]:
    """`tenants`: the measured leases (and so the reads) are dealt round robin over this many
    tenants; one ("bench") unless the store shards by tenant and every shard must serve."""
    block_size = 16
    # The side registries' leases are all the bench tenant's (the reader token's only one).
    assert tenants == 1 or not secured, "side registries read one tenant"

    def tenant_of(i: int) -> str:
        return "bench" if tenants == 1 else _tenant(i, tenants)

    # The lookup by content is measured on the memory backend, on a registry of its own (its
    # leases spread over many tenants, the first registry's all in one).
    lookup: _Proc | None = None
    if registries is None:
        single = _registry_proc(leases)
        registries = _Registries([single], single.rss_bytes, single.cpu_seconds)
        lookup = _registry_proc(leases)
    registry = registries.procs[0]
    # The echo runs with the registries' gRPC settings, so that it stays the gRPC floor they
    # are compared with.
    echo = _spawn([sys.executable, "-c",
                   "from kvbridge import aio; from kvbridge.benchmarks.registry_bench import"
                   " _echo_main; aio.run(_echo_main())"], env=_grpc_env())
    # Side registries (memory backend), measured beside the first, their keys ending in
    # _SUFFIX: `secured`, one that authenticates every call (_auth).
    sides: dict[str, _Proc] = {}
    if secured:
        sides["auth"] = _registry_proc(4096, secured=True)
    boundaries = _grant_boundaries(lookup_messages)
    out: dict[str, Any] = {"leases": leases, "blocks_per_lease": blocks,
                           "offered_rate_rps": rate, "replicas": len(registries.procs),
                           "tenants": tenants,
                           # every lease's history keys: those of a history this long
                           "history_messages": lookup_messages,
                           "history_keys_per_lease": len(boundaries),
                           # gRPC (every process here runs this one) and its core settings
                           "grpc_version": grpc.__version__,
                           "grpc_experiments": _grpc_env()["GRPC_EXPERIMENTS"]}
    try:
        client = AsyncRegistryClient(f"127.0.0.1:{registry.port}", timeout=30, retries=0)
        await client.register_holder("bench-decode", "127.0.0.1", 5600, block_size,
                                     "bench-fingerprint", ttl=300)
        block_ids = list(range(blocks))
        tokens = blocks * block_size
        hashes = [os.urandom(16 * blocks) for _ in range(256)]  # varied payloads, cheap to make
        # Each lease's history keys, as the gateway grants them for a `lookup_messages`-message
        # history: keys of their own (no two conversations share a system prompt here), so
        # that every key takes its own entry in the registry's index. Made ahead of time.
        lease_keys = [_lease_history(_history_root("bench", i), boundaries)
                      for i in range(leases)]

        async def grant(i: int, tenant: str = "", ttl: float = 3600.0) -> str:
            tenant = tenant or tenant_of(i)
            resp = await client.grant_lease(
                "bench-decode", tenant, f"conv-{i}", f"req-{i}", block_ids, tokens,
                hashes[i % 256], idle_ttl=ttl, max_lifetime=max(ttl, 3600.0),
                request_id=f"{tenant}-{i}", history_keys=lease_keys[i % leases])
            return str(resp.lease.lease_id)

        # Warm up code paths and the allocator, then measure memory per lease.
        # Over as many tenants as the measured leases, so that every shard is warmed.
        await _bounded(lambda i: grant(i, "warmup-" + tenant_of(i)), 2000, concurrency)
        await asyncio.sleep(0.5)
        rss0 = registries.memory_bytes()
        log(f"granting {leases} leases of {blocks} blocks ...")
        t = time.perf_counter()
        lease_ids: list[str] = [""] * leases

        async def grant_into(i: int) -> None:
            lease_ids[i] = await grant(i)

        await _bounded(grant_into, leases, concurrency)
        out["grants_per_s"] = round(leases / (time.perf_counter() - t))
        await asyncio.sleep(0.5)
        mem = registries.memory_bytes()
        out["rss_mb"] = round(mem / 2**20, 1)
        out["bytes_per_lease"] = round((mem - rss0) / leases)
        log(f"  {out['grants_per_s']} grants/s, {out['bytes_per_lease']} bytes/lease "
            f"(history index included)")
        lookup_probe: _LookupProbe | None = None
        if lookup is not None:
            lookup_probe = await _lookup_setup(lookup, leases, lookup_tenants, lookup_messages,
                                               boundaries, block_ids, tokens, hashes,
                                               concurrency, out, log)

        # Batched renewals.
        batch = 1000
        renewed = 0

        async def renew(i: int) -> None:
            nonlocal renewed
            start = (i * batch) % leases
            resp = await client.renew_leases(lease_ids[start:start + batch])
            renewed += resp.renewed_count

        t = time.perf_counter()
        calls = max(leases // batch, 1) * 2
        await _bounded(renew, calls, 4)
        out["renewals_per_s"] = round(renewed / (time.perf_counter() - t))
        log(f"  {out['renewals_per_s']} renewals/s")

        # Expiry lateness: short-TTL leases among the long-lived ones, observed via Watch.
        lateness: list[float] = []
        # 1,000 grants/s for 2 s, or half what this backend grants per second if less (an
        # overloaded store measures its queue, not its expiry).
        probe_rate = min(1000.0, out["grants_per_s"] / 2)
        probes = int(probe_rate * 2.0)

        async def watch() -> None:
            async for event in client.watch_leases(tenant="expiry-probe"):
                if event.type == pb.LEASE_EVENT_TYPE_EXPIRED:
                    lateness.append(seconds(event.lateness) * 1000)
                    if len(lateness) >= probes:
                        return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        await _open_loop(lambda i: grant(i, "expiry-probe", 1.0), probe_rate, 2.0)
        await asyncio.wait_for(watcher, timeout=30)
        out["expiry_late_p50_ms"] = round(_pct(lateness, 0.5), 3)
        out["expiry_late_p99_ms"] = round(_pct(lateness, 0.99), 3)
        log(f"  expiry late p99 {out['expiry_late_p99_ms']} ms")

        # The driver's own garbage collector must not stall the latency phases: everything
        # made so far (100k lease ids, payloads) is moved out of its reach.
        gc.collect()
        gc.freeze()

        # The hot path: AcquireRead for a 64-block prompt that matches, then its release.
        prompts = {i: hashes[i % 256] + os.urandom(16 * 8) for i in range(256)}

        async def acquire(i: int) -> None:
            k = i % leases
            resp = await client.acquire_read(tenant_of(k), f"conv-{k}", prompts[k % 256],
                                             min_tokens=64, pin_ttl=1.0, reader_id="bench",
                                             request_id=uuid.uuid4().hex)
            if resp.miss_reason != pb.MISS_REASON_UNSPECIFIED:
                raise RuntimeError(f"unexpected miss {resp.miss_reason}")

        # The registry's capacity, driven as the echo is: requests serialized ahead of time
        # (each with a request id of its own, so that no read is answered from the retry
        # cache), replies left as bytes; every 16th is parsed and must be a hit. The client
        # library's own cost is measured separately (client_max_rps).
        # With replicas, calls go round robin over them.
        raw_channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}")
                        for port in registries.ports]
        raw_calls = [ch.unary_unary(ACQUIRE_METHOD, request_serializer=_identity,
                                    response_deserializer=_identity) for ch in raw_channels]
        templates = [pb.AcquireReadRequest(
            tenant=tenant_of(k), conversation_id=f"conv-{k}", block_hashes=prompts[k % 256],
            min_tokens=64, pin_ttl=duration_pb(1.0), reader_id="bench").SerializeToString()
            for k in range(min(leases, 4096))]
        run = uuid.uuid4().hex[:16]

        def check_hit(reply: bytes) -> None:
            resp = pb.AcquireReadResponse.FromString(reply)
            if resp.miss_reason != pb.MISS_REASON_UNSPECIFIED or not resp.pin.pin_id:
                raise RuntimeError(f"unexpected miss {resp.miss_reason}")

        async def acquire_bytes(i: int, calls: Sequence[Callable[..., Awaitable[bytes]]]
                                = raw_calls, metadata: Any = None) -> bytes:
            request_id = f"{run}{i:016x}".encode()  # field 7 (request_id), 32 bytes
            reply: bytes = await calls[i % len(calls)](
                templates[i % len(templates)] + b"\x3a\x20" + request_id, timeout=30,
                metadata=metadata)
            return reply

        async def acquire_raw(i: int, calls: Sequence[Callable[..., Awaitable[bytes]]]
                              = raw_calls, metadata: Any = None) -> None:
            reply = await acquire_bytes(i, calls, metadata)
            if i % 16 == 0:
                check_hit(reply)

        # Each side registry holds the leases the raw calls read (conv-0 .. conv-4095); the
        # secured one is set up by an admin and read by a reader limited to the tenant.
        side_calls: dict[str, tuple[Sequence[Callable[..., Awaitable[bytes]]], Any]] = {}
        for name, proc in sides.items():
            admin = AsyncRegistryClient(f"127.0.0.1:{proc.port}", timeout=30, retries=0,
                                        token=_ADMIN_TOKEN if name == "auth" else None)
            await admin.register_holder("bench-decode", "127.0.0.1", 5600, block_size,
                                        "bench-fingerprint", ttl=300)

            async def grant_side(i: int, admin: AsyncRegistryClient = admin) -> None:
                await admin.grant_lease(
                    "bench-decode", "bench", f"conv-{i}", f"req-{i}", block_ids, tokens,
                    hashes[i % 256], idle_ttl=3600.0, max_lifetime=3600.0,
                    request_id=f"bench-{i}")

            await _bounded(grant_side, len(templates), concurrency)
            await admin.close()
            side_channel = grpc.aio.insecure_channel(f"127.0.0.1:{proc.port}")
            raw_channels.append(side_channel)  # closed with the others
            side_calls[name] = (
                [side_channel.unary_unary(ACQUIRE_METHOD, request_serializer=_identity,
                                          response_deserializer=_identity)],
                (("authorization", f"Bearer {_READER_TOKEN}"),) if name == "auth" else None)

        # The same measurements against the trivial echo service, interleaved round by round
        # with the registry's so that the machine's noise falls on both alike.
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{echo.port}")
        echo_call = channel.unary_unary(ECHO_METHOD, request_serializer=_identity,
                                        response_deserializer=_identity)
        payload = os.urandom(16 * (blocks + 8))

        async def ping(i: int) -> None:
            await echo_call(payload, timeout=30)

        # Latency probes, registry and echo alike: requests built ahead of time, replies left
        # as bytes while timed, so that this process's own cost (it shares the machine's two
        # cores) is the same for both; every registry reply is then checked (a hit with a pin)
        # after its round, untimed. The client library's latency is reported beside them.
        probe_base = 1 << 40  # request ids of their own: no probe is a retry of another call
        probe_replies: list[bytes] = []

        async def acquire_probe(i: int) -> None:
            probe_replies.append(await acquire_bytes(probe_base + i))

        # name: (call for throughput, process)
        targets: dict[str, tuple[Callable[[int], Awaitable[Any]], Callable[[], float]]] = {
            "acquire": (acquire_raw, registries.cpu_seconds), "echo": (ping, echo.cpu_seconds)}
        latency_calls: dict[str, Callable[[int], Awaitable[Any]]] = {
            "acquire": acquire_probe, "echo": ping, "client": acquire}
        for name, (rpc, metadata) in side_calls.items():

            async def acquire_side(i: int, rpc: Any = rpc, metadata: Any = metadata) -> None:
                await acquire_raw(i, rpc, metadata)

            async def acquire_side_probe(i: int, rpc: Any = rpc,
                                         metadata: Any = metadata) -> None:
                probe_replies.append(await acquire_bytes(probe_base + i, rpc, metadata))

            targets[f"acquire_{name}"] = (acquire_side, sides[name].cpu_seconds)
            latency_calls[f"acquire_{name}"] = acquire_side_probe
        latencies: dict[str, list[float]] = {name: [] for name in latency_calls}
        rates: dict[str, list[float]] = {name: [] for name in latency_calls}
        cpu: dict[str, list[float]] = {name: [] for name in targets}
        for call, _ in targets.values():
            await _closed_loop(call, concurrency, 1.0)  # warm-up
        await _closed_loop(acquire, concurrency, 0.5)
        per_round = max(duration / rounds, 0.5)
        run_offset = 10_000_000  # past the warm-up's request ids
        counts0 = registries.primary_counts() if registries.primary_counts else None
        for r in range(rounds):
            # Latency: each service offered `rate` in short windows taken in turn, so each
            # sees the offered rate alone and a stall of this shared machine hits all alike.
            windows = await _open_loop_alternating(tuple(latency_calls.values()), rate, per_round)
            probe_base += 10_000_000
            for reply in probe_replies:
                check_hit(reply)
            probe_replies.clear()
            for name, values in zip(latency_calls, windows, strict=True):
                latencies[name] += values
            for name, (call, cpu_seconds) in targets.items():
                cpu0 = cpu_seconds()
                rps = await _closed_loop(call, concurrency, per_round, first=run_offset)
                run_offset += 10_000_000
                rates[name].append(rps)
                cpu[name].append((cpu_seconds() - cpu0) / (rps * per_round) * 1e6)
            rates["client"].append(await _closed_loop(acquire, concurrency, per_round))
            log(f"  round {r + 1}/{rounds}: acquire {rates['acquire'][-1]:.0f} RPC/s "
                f"(through the client library {rates['client'][-1]:.0f}), "
                f"echo {rates['echo'][-1]:.0f} RPC/s; p99 so far: acquire "
                f"{_pct(latencies['acquire'], 0.99):.2f} ms, echo "
                f"{_pct(latencies['echo'], 0.99):.2f} ms"
                + "".join(f"; {name} {rates['acquire_' + name][-1]:.0f} RPC/s, p99 "
                          f"{_pct(latencies['acquire_' + name], 0.99):.2f} ms" for name in sides))
        if registries.primary_counts and counts0 is not None:
            out.update(_primary_deltas(counts0, registries.primary_counts()))
            log(f"  per primary, during the AcquireRead rounds: commands "
                f"{out['primary_commands']}, function calls {out['primary_fcalls']}")
        if not registries.redis:
            out.update(await _list_flood(client, registry.port, grant, acquire_probe,
                                         probe_replies, check_hit, rate, duration, log))
        if lookup_probe is not None:
            out.update(await lookup_probe.measure(ping, rate, duration, concurrency, log))
        await client.close()
        await channel.close()
        for ch in raw_channels:
            await ch.close()
        out["acquire_read_p50_ms"] = round(_pct(latencies["acquire"], 0.5), 3)
        out["acquire_read_p99_ms"] = round(_pct(latencies["acquire"], 0.99), 3)
        out["client_acquire_read_p50_ms"] = round(_pct(latencies["client"], 0.5), 3)
        out["client_acquire_read_p99_ms"] = round(_pct(latencies["client"], 0.99), 3)
        out["echo_p50_ms"] = round(_pct(latencies["echo"], 0.5), 3)
        out["echo_p99_ms"] = round(_pct(latencies["echo"], 0.99), 3)
        out["max_rps"] = round(statistics.median(rates["acquire"]))
        out["client_max_rps"] = round(statistics.median(rates["client"]))
        out["echo_max_rps"] = round(statistics.median(rates["echo"]))
        out["server_cpu_us_per_rpc"] = round(statistics.median(cpu["acquire"]))
        out["echo_server_cpu_us_per_rpc"] = round(statistics.median(cpu["echo"]))
        log(f"  acquire-read p50 {out['acquire_read_p50_ms']} ms p99 "
            f"{out['acquire_read_p99_ms']} ms, max {out['max_rps']} RPC/s; echo p99 "
            f"{out['echo_p99_ms']} ms, max {out['echo_max_rps']} RPC/s")
        out["acquire_p99_vs_echo"] = round(out["acquire_read_p99_ms"] / out["echo_p99_ms"], 2)
        out["max_rps_vs_echo"] = round(out["max_rps"] / out["echo_max_rps"], 2)
        for name in sides:
            key = "acquire_" + name
            out[f"acquire_read_p50_ms_{name}"] = round(_pct(latencies[key], 0.5), 3)
            out[f"acquire_read_p99_ms_{name}"] = round(_pct(latencies[key], 0.99), 3)
            out[f"max_rps_{name}"] = round(statistics.median(rates[key]))
            out[f"server_cpu_us_per_rpc_{name}"] = round(statistics.median(cpu[key]))
            out[f"acquire_p99_vs_echo_{name}"] = round(
                out[f"acquire_read_p99_ms_{name}"] / out["echo_p99_ms"], 2)
            out[f"max_rps_vs_echo_{name}"] = round(out[f"max_rps_{name}"] / out["echo_max_rps"],
                                                   2)
            log(f"  {_SIDE_NAMES[name]}: acquire-read p50 {out[f'acquire_read_p50_ms_{name}']} "
                f"ms p99 {out[f'acquire_read_p99_ms_{name}']} ms, max "
                f"{out[f'max_rps_{name}']} RPC/s, {out[f'server_cpu_us_per_rpc_{name}']} us CPU "
                f"per call")
    finally:
        for proc in [*registries.procs, *sides.values(), *([lookup] if lookup else [])]:
            proc.stop()
        echo.stop()
    return out


async def _list_flood(client: AsyncRegistryClient, port: int,
                      grant: Callable[[int, str], Awaitable[str]],
                      probe: Callable[[int], Awaitable[None]], replies: list[bytes],
                      check_hit: Callable[[bytes], None], rate: float, duration: float,
                      log: Callable[[str], None]) -> dict[str, Any]:
    """AcquireRead p99 at `rate` while another tenant (100 leases of its own, among the
    registry's many) loops ListLeases from a process of its own, and in the same run without
    it: windows with no flood, a client that waits as refusals say (the `_under_list_flood`
    figures), and one that never waits (`_under_rude_list_flood`: every refusal is a call
    too), taken in turn (the idle flood process stopped with SIGSTOP)."""
    await _bounded(lambda i: grant(i, "flood"), 100, 16)
    floods: dict[str, _Proc] = {}
    counts: dict[str, list[int]] = {}  # the flood's listings answered and refused, as printed
    for kind in ("polite", "rude"):
        # At the lowest CPU priority: a flooding tenant's client runs on machines of its own,
        # so its CPU is not the registry's; here it shares two cores with the registry and
        # the probe, and at an equal priority its own loop would be most of what is measured.
        proc = floods[kind] = _spawn([
            "nice", "-n", "19", sys.executable, "-c", "from kvbridge import aio; from "
            "kvbridge.benchmarks.registry_bench import _flood_main; "
            f"aio.run(_flood_main({port}, 'flood', {kind == 'polite'}))"], env=_grpc_env())
        proc.popen.send_signal(signal.SIGSTOP)
        counts[kind] = [0, 0]

        def follow(stdout: Any = proc.popen.stdout, got: list[int] = counts[kind]) -> None:
            for line in stdout:
                if line.startswith("LISTED "):
                    got[:] = [int(x) for x in line.split()[1:3]]

        threading.Thread(target=follow, daemon=True).start()
    base = 1 << 44
    windows: dict[str, list[float]] = {"quiet": [], "polite": [], "rude": []}
    try:
        for w in range(max(round(duration / 0.5), 3)):
            kind = ("quiet", "polite", "rude")[w % 3]
            for name, proc in floods.items():
                proc.popen.send_signal(signal.SIGCONT if name == kind else signal.SIGSTOP)
            await asyncio.sleep(0.05)  # the window's flood (or none) runs when it opens
            for _ in range(100):  # a flood that has not listed yet (it starts at the lowest
                if kind == "quiet" or counts[kind] != [0, 0]:  # priority): the window waits
                    break
                await asyncio.sleep(0.05)

            def numbered(i: int, first: int = base + w * 1_000_000) -> Awaitable[None]:
                return probe(first + i)

            windows[kind].extend(await _open_loop(numbered, rate, 0.5))
    finally:
        for proc in floods.values():
            proc.popen.send_signal(signal.SIGCONT)  # a stopped process would not see the stop
            proc.stop()
    for reply in replies:
        check_hit(reply)
    replies.clear()
    quiet = round(_pct(windows["quiet"], 0.99), 3)
    out: dict[str, Any] = {"acquire_read_p99_ms_without_list_flood": quiet}
    for kind, suffix in (("polite", ""), ("rude", "rude_")):
        p99 = round(_pct(windows[kind], 0.99), 3)
        out[f"acquire_read_p99_ms_under_{suffix}list_flood"] = p99
        out[f"{suffix}list_flood_p99_ratio"] = round(p99 / quiet, 2)
        out[f"{suffix}list_flood_answered"], out[f"{suffix}list_flood_refused"] = counts[kind]
    log(f"  under a ListLeases flood: acquire-read p99 "
        f"{out['acquire_read_p99_ms_under_list_flood']} ms against {quiet} ms without "
        f"({out['list_flood_p99_ratio']}x; listings {counts['polite'][0]} answered, "
        f"{counts['polite'][1]} refused); a flood that ignores refusals: "
        f"{out['acquire_read_p99_ms_under_rude_list_flood']} ms "
        f"({out['rude_list_flood_p99_ratio']}x; {counts['rude'][1]} refusals)")
    return out


def _tenant(k: int, tenants: int) -> str:
    """The tenant of the lookup registry's lease `k` (leases dealt round robin)."""
    return f"tenant-{k % tenants:04d}"


async def _lookup_setup(proc: _Proc, leases: int, tenants: int, messages: int,
                        boundaries: Sequence[int], block_ids: Sequence[int], tokens: int,
                        hashes: Sequence[bytes], concurrency: int, out: dict[str, Any],
                        log: Callable[[str], None]) -> _LookupProbe:
    """Grant the lookup registry `leases` leases across `tenants` tenants, each with the
    history keys of a `messages`-message conversation of its own, and build the lookups."""
    tenants = min(tenants, leases)
    client = AsyncRegistryClient(f"127.0.0.1:{proc.port}", timeout=30, retries=0)
    await client.register_holder("bench-decode", "127.0.0.1", 5600, 16, "bench-fingerprint",
                                 ttl=300)

    def root(k: int) -> bytes:
        return _history_root(_tenant(k, tenants), k // tenants)

    async def grant(k: int, keys: bytes, tenant: str) -> None:
        await client.grant_lease(
            "bench-decode", tenant, f"conv-{k // tenants}", f"req-{k}", block_ids, tokens,
            hashes[k % 256], idle_ttl=3600.0, max_lifetime=3600.0, request_id=f"{tenant}-{k}",
            history_keys=keys)

    warm = [_lease_history(_history_root("warmup", k), boundaries) for k in range(2000)]
    await _bounded(lambda k: grant(k, warm[k], "warmup"), len(warm), concurrency)
    keys = [_lease_history(root(k), boundaries) for k in range(leases)]
    await asyncio.sleep(0.5)
    rss0 = proc.rss_bytes()
    log(f"lookup registry: granting {leases} leases across {tenants} tenants, "
        f"{len(boundaries)} history keys each ...")
    await _bounded(lambda k: grant(k, keys[k], _tenant(k, tenants)), leases, concurrency)
    await asyncio.sleep(0.5)
    out["lookup_bytes_per_lease"] = round((proc.rss_bytes() - rss0) / leases)
    await client.close()
    # Lookups, serialized ahead of time: a hit's request continues lease k by two messages
    # (its keys at every boundary, the lease's last among them); a miss's carries exactly the
    # same keys under the next tenant, which holds leases of its own: identical history
    # (identical keys, even) in another tenant must not match.
    probes = min(leases, 2048)
    hits: list[bytes] = []
    misses: list[bytes] = []
    expected: list[tuple[str, str]] = []
    for j in range(probes):
        k = j * leases // probes
        request = _request_history(root(k), messages + 2)
        for tenant, into in ((_tenant(k, tenants), hits), (_tenant(k + 1, tenants), misses)):
            into.append(pb.PinLeaseRequest(
                tenant=tenant, history_keys=request, pin_ttl=duration_pb(1.0),
                reader_id="bench").SerializeToString())
        expected.append((_tenant(k, tenants), f"conv-{k // tenants}"))
    out.update({"lookup_leases": leases, "lookup_tenants": tenants,
                "lookup_request_keys": messages + 2})
    return _LookupProbe(proc.port, hits, misses, expected, messages)


@dataclass
class _LookupProbe:
    """PinLease by history keys on the lookup registry, driven as the AcquireRead probes are:
    requests built ahead of time (each with a request id of its own), replies left as bytes
    while timed and checked afterwards. Pins are asked for 1 s (as the AcquireRead probes'):
    at the offered rate, at most about that many live at once."""

    port: int
    hits: list[bytes]
    misses: list[bytes]
    expected: list[tuple[str, str]]  # hits[j]'s lease: tenant, conversation
    messages: int

    async def measure(self, ping: Callable[[int], Awaitable[None]], rate: float,
                      duration: float, concurrency: int, log: Callable[[str], None]
                      ) -> dict[str, Any]:
        """Hits, misses and the echo, each offered `rate` in windows taken in turn."""
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        call = channel.unary_unary(PIN_METHOD, request_serializer=_identity,
                                   response_deserializer=_identity)
        run = uuid.uuid4().hex[:16]
        hit_replies: list[tuple[int, bytes]] = []
        miss_replies: list[tuple[int, bytes]] = []

        async def send(templates: list[bytes], i: int) -> bytes:
            request_id = f"{run}{i:016x}".encode()  # field 6 (request_id), 32 bytes
            reply: bytes = await call(templates[i % len(templates)] + b"\x32\x20" + request_id,
                                      timeout=30)
            return reply

        async def hit(i: int) -> None:
            hit_replies.append((i % len(self.hits), await send(self.hits, i)))

        async def miss(i: int) -> None:
            miss_replies.append((i % len(self.misses), await send(self.misses, (1 << 40) + i)))

        try:
            for first, templates in ((1 << 44, self.hits), (1 << 45, self.misses)):
                async def warm(i: int, templates: list[bytes] = templates) -> None:
                    await send(templates, i)

                await _closed_loop(warm, concurrency, 0.5, first=first)
            windows = await _open_loop_alternating((hit, miss, ping), rate, duration)
        finally:
            await channel.close()
        found = missed = 0
        for j, reply in hit_replies:
            resp = pb.PinLeaseResponse.FromString(reply)
            lease = resp.read.lease
            found += (resp.read.miss_reason == pb.MISS_REASON_UNSPECIFIED
                      and bool(resp.read.pin.pin_id) and resp.match.whole
                      and resp.match.keys_matched == self.messages
                      and (lease.tenant, lease.conversation_id) == self.expected[j])
        for _, reply in miss_replies:
            resp = pb.PinLeaseResponse.FromString(reply)
            missed += (resp.read.miss_reason == pb.MISS_REASON_NO_LEASE
                       and not resp.read.pin.pin_id and not resp.HasField("match"))
        hit_ms, miss_ms, echo_ms = windows
        out: dict[str, Any] = {
            "lookup_p50_ms": round(_pct(hit_ms, 0.5), 3),
            "lookup_p99_ms": round(_pct(hit_ms, 0.99), 3),
            "lookup_miss_p50_ms": round(_pct(miss_ms, 0.5), 3),
            "lookup_miss_p99_ms": round(_pct(miss_ms, 0.99), 3),
            "lookup_echo_p99_ms": round(_pct(echo_ms, 0.99), 3),
            # outcomes: every hit must pin the lease it continues, every miss find nothing
            "lookup_hits": len(hit_replies), "lookup_hits_found": found,
            "lookup_misses": len(miss_replies), "lookup_misses_missed": missed}
        out["lookup_p99_vs_echo"] = round(out["lookup_p99_ms"] / out["lookup_echo_p99_ms"], 2)
        out["lookup_miss_p99_vs_hit"] = round(out["lookup_miss_p99_ms"] / out["lookup_p99_ms"],
                                              2)
        log(f"  lookup by content: p50 {out['lookup_p50_ms']} ms p99 {out['lookup_p99_ms']} ms "
            f"({found}/{len(hit_replies)} found); a miss p99 {out['lookup_miss_p99_ms']} ms "
            f"({missed}/{len(miss_replies)} missed); echo p99 {out['lookup_echo_p99_ms']} ms")
        if found != len(hit_replies) or missed != len(miss_replies):
            log("  lookup by content: WRONG OUTCOMES (see lookup_hits_found, "
                "lookup_misses_missed)")
        return out


_SIDE_NAMES = {"auth": "with bearer tokens"}


TARGETS = [
    ("acquire_read_p99_ms", "<=", 2.0, "acquire-read p99 at the offered rate (ms)"),
    ("max_rps", ">=", 4000, "sustained AcquireRead RPC/s"),
    ("renewals_per_s", ">=", 20000, "batched renewals/s"),
    ("bytes_per_lease", "<=", 3072,
     "resident bytes per 64-block lease, its history keys indexed (issue 34)"),
    ("expiry_late_p99_ms", "<=", 50, "expiry lateness p99 (ms)"),
    ("list_flood_p99_ratio", "<=", 1.5,
     "acquire-read p99 while another tenant loops ListLeases / without"),
    ("lookup_p99_ms", "<=", 1.0,
     "lookup by content (PinLease by history keys) p99 at the offered rate (ms)"),
]
AUTH_TARGETS = [
    ("acquire_read_p99_ms_auth", "<=", 2.0,
     "acquire-read p99 at the offered rate, bearer tokens (ms)"),
    ("max_rps_auth", ">=", 4000, "sustained AcquireRead RPC/s, bearer tokens"),
]
REDIS_TARGETS = [
    ("acquire_read_p99_ms", "<=", 2.0, "acquire-read p99 at 1,000 RPC/s on Redis (ms)"),
]


REDIS_CLUSTER_TARGETS = [(key, op, bound, what.replace("on Redis", "on a Redis Cluster"))
                         for key, op, bound, what in REDIS_TARGETS]


def _stop_popen(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process this bench started, by its PID: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def _start_redis_server(exe: str, workdir: str, extra: Sequence[str] = ()
                        ) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server on a free 127.0.0.1 port (no persistence, its files in `workdir`) that
    answers PING, and its port. Tried again on another port if it does not start: a port
    probed free may be taken before the server binds it."""
    for _attempt in range(5):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", workdir, *extra], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return proc, port
            except OSError:
                pass
            time.sleep(0.05)
        _stop_popen(proc)
    raise click.ClickException(f"could not start {exe} on a free port")


class _Redis:
    """The Redis the replicas share, and a client of each of its primaries (their own figures
    are read from each): one server (`--backend redis`) or a Redis Cluster
    (`--backend redis-cluster`). Given by URL, or started here on free 127.0.0.1 ports (no
    persistence, files in a temporary directory), then stopped by PID."""

    def __init__(self, url: str, cluster: bool, primaries: int = 3) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []  # the servers started here
        self.dir = ""
        self.clients: list[Any] = []  # a redis.Redis per primary, in (host, port) order
        try:
            if not url:
                url = self._start(cluster, primaries)
            self.url = url
            self._connect(cluster)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _exe(name: str) -> str:
        exe = shutil.which(name)
        if exe is None:
            raise click.ClickException(
                f"--backend redis and redis-cluster need {name} on PATH (apt-get install -y "
                "redis-server) or --redis-url")
        return exe

    def _start(self, cluster: bool, primaries: int) -> str:
        exe = self._exe("redis-server")
        self.dir = tempfile.mkdtemp(prefix="kvbridge-bench-redis-")
        if not cluster:
            proc, port = _start_redis_server(exe, self.dir)
            self.procs.append(proc)
            return f"redis://127.0.0.1:{port}/0"
        ports = []
        for k in range(primaries):
            proc, port = _start_redis_server(exe, self.dir, (
                "--cluster-enabled", "yes",
                "--cluster-config-file", os.path.join(self.dir, f"nodes-{k}.conf"),
                "--cluster-node-timeout", "5000"))
            self.procs.append(proc)
            ports.append(port)
        # Equal slot ranges, as the registry's shard namespaces expect for an even spread.
        made = subprocess.run(
            [self._exe("redis-cli"), "--cluster", "create",
             *(f"127.0.0.1:{port}" for port in ports), "--cluster-replicas", "0",
             "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if made.returncode != 0:
            raise click.ClickException(f"redis-cli --cluster create failed: "
                                       f"{(made.stdout + made.stderr)[-2000:]}")
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)

    def _connect(self, cluster: bool) -> None:
        import redis

        if not cluster:
            self.clients = [redis.Redis.from_url(self.url)]
        else:
            from kvbridge.services.registry._redis_url import cluster_parts

            seeds, plain = cluster_parts(self.url)

            def node(host: str, port: int) -> Any:
                # The URL's options (user, password, TLS) with this node's address.
                pool = redis.ConnectionPool.from_url(plain)
                pool.connection_kwargs.update(host=host, port=port)
                return redis.Redis(connection_pool=pool)

            self.clients = self._primaries(seeds, node)
        deadline = time.monotonic() + 20
        while True:
            try:
                for client in self.clients:
                    client.ping()
                    # Every primary must see every slot served before the replicas start.
                    if cluster and client.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                        raise redis.RedisError("cluster_state is not ok")
                break
            except redis.RedisError as exc:
                if time.monotonic() > deadline:
                    raise click.ClickException(f"Redis at {self.url} is not ready: {exc}"
                                               ) from None
                time.sleep(0.1)

    @staticmethod
    def _primaries(seeds: Sequence[tuple[str, int]], node: Callable[[str, int], Any]
                   ) -> list[Any]:
        """A client of each primary that serves slots, from the first seed that lists them."""
        import redis

        failures = []
        for seed_host, seed_port in seeds:
            seed = node(seed_host, seed_port)
            try:
                nodes = seed.execute_command("CLUSTER NODES")
            except redis.RedisError as exc:
                failures.append(f"{seed_host}:{seed_port}: {exc}")
                continue
            finally:
                seed.close()
            found = []
            for address, info in nodes.items():
                flags = info["flags"].split(",")
                if "master" in flags and "fail" not in flags and info["slots"]:
                    host, _, port = address.partition("@")[0].rpartition(":")
                    found.append((host or seed_host, int(port)))
            if found:
                return [node(host, port) for host, port in sorted(found)]
            failures.append(f"{seed_host}:{seed_port}: no primary serves slots")
        raise click.ClickException(f"no Redis Cluster primaries found: {'; '.join(failures)}")

    def used_memory(self) -> int:
        return sum(int(c.info("memory")["used_memory"]) for c in self.clients)

    def cpu_seconds(self) -> float:
        # Only the servers started here: someone else's Redis's CPU is not ours to read.
        total = 0.0
        for proc in self.procs:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def counts(self) -> list[tuple[int, int]]:
        """Per primary: (commands processed, function calls) since it started."""
        out = []
        for client in self.clients:
            stats = client.info("commandstats")
            fcalls = sum(int(stats.get(name, {}).get("calls", 0))
                         for name in ("cmdstat_fcall", "cmdstat_fcall_ro"))
            out.append((int(client.info("stats")["total_commands_processed"]), fcalls))
        return out

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        for proc in self.procs:
            _stop_popen(proc)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _primary_deltas(before: list[tuple[int, int]], after: list[tuple[int, int]],
                    suffix: str = "") -> dict[str, Any]:
    """Each primary's commands and function calls between two `_Redis.counts`, and the spread
    of the commands over the primaries (the most over the fewest: 1.0 is an even share)."""
    commands = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    fcalls = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    return {f"primary_commands{suffix}": commands, f"primary_fcalls{suffix}": fcalls,
            f"primary_command_spread{suffix}":
                round(max(commands) / min(commands), 2) if min(commands) > 0 else None}


def _run_redis(leases: int, replicas: int, redis: _Redis, namespace: str, shards: int,
               run: Callable[[_Registries], dict[str, Any]]) -> dict[str, Any]:
    """`run` against `replicas` registry replicas sharing `redis` (one namespace of `shards`
    shards). The primaries' counts are taken over the whole configuration (`_all`: replicas'
    start, grants, renewals, expiry, reads) as well as over the AcquireRead rounds."""
    counts0 = redis.counts()
    procs = [_registry_proc(leases, ["--backend", "redis", "--redis-url", redis.url,
                                     "--redis-namespace", namespace,
                                     "--redis-shards", str(shards)])
             for _ in range(replicas)]

    def cpu() -> float:  # the replicas and Redis together serve each call
        return sum(p.cpu_seconds() for p in procs) + redis.cpu_seconds()

    out = run(_Registries(procs, redis.used_memory, cpu, redis=True,
                          primary_counts=redis.counts))
    out.update(_primary_deltas(counts0, redis.counts(), "_all"))
    out.update({"redis_url": redis.url, "redis_shards": shards,
                "redis_primaries": len(redis.clients)})
    return out


def _report(result: dict[str, Any], targets: list[tuple[str, str, float, str]]) -> None:
    for key, value in result.items():
        click.echo(f"{key:<26} {value}")
    click.echo("targets:")
    if "max_rps_auth" in result:
        targets = targets + AUTH_TARGETS
    for key, op, bound, what in targets:
        value = result[key]
        ok = value <= bound if op == "<=" else value >= bound
        click.echo(f"  {'met ' if ok else 'MISS'} {what}: {value} (target {op} {bound})")
    if "primary_commands" in result:
        click.echo(f"per primary ({result['redis_primaries']}, {result['redis_shards']} "
                   f"shard(s), {result['tenants']} tenant(s)), during the AcquireRead rounds: "
                   f"commands {result['primary_commands']} (most/fewest "
                   f"{result['primary_command_spread']}), function calls "
                   f"{result['primary_fcalls']}; over the whole configuration: commands "
                   f"{result['primary_commands_all']}")


@click.command("registry")
@click.option("--leases", default=100_000, show_default=True, type=click.IntRange(min=1000),
              help="live leases for the memory and expiry figures")
@click.option("--blocks", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="blocks per lease")
@click.option("--rate", default=1000.0, show_default=True, type=click.FloatRange(min=1),
              help="offered AcquireRead (and echo) rate for the latency figures, RPC/s")
@click.option("--duration", default=6.0, show_default=True, type=click.FloatRange(min=0.5),
              help="seconds of latency and of throughput measurement per service, all rounds")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 20),
              help="registry and echo phases alternate this many times")
@click.option("--concurrency", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="calls in flight for the closed-loop phases")
@click.option("--backend", type=click.Choice(["memory", "redis", "redis-cluster"]),
              default="memory", show_default=True,
              help="redis: also measure 1..--replicas registry replicas sharing one Redis, "
                   "beside the memory backend, in the same run; redis-cluster: the same on a "
                   "Redis Cluster (3 primaries started here unless --redis-url names one), "
                   "tenants sharded over its primaries, with each primary's command counts")
@click.option("--replicas", default=2, show_default=True, type=click.IntRange(1, 4),
              help="with --backend redis or redis-cluster: the most replicas measured")
@click.option("--redis-url", default="",
              help="with --backend redis: an existing Redis to use (default: start "
                   "redis-server on a free port); with redis-cluster: an existing cluster, "
                   "redis+cluster://HOST:PORT[,HOST:PORT...] (default: start 3 redis-servers "
                   "on free ports and join them with redis-cli --cluster create)")
@click.option("--redis-shards", type=click.IntRange(1, 1024), default=None,
              help="with --backend redis or redis-cluster: the replicas' --redis-shards, the "
                   "shards tenants are spread over  [default: the cluster's primaries; 1 on "
                   "one Redis]")
@click.option("--tenants", type=click.IntRange(min=1), default=None,
              help="with --backend redis or redis-cluster: tenants the Redis configurations' "
                   "leases, and so their reads, are dealt over round robin. A tenant lives on "
                   "one shard, so a cluster needs many for every primary to serve the reads; "
                   "the memory backend's leases stay in one tenant  [default: 1000 with "
                   "redis-cluster, 1 with redis]")
@click.option("--redis-leases", default=20_000, show_default=True,
              type=click.IntRange(min=1000),
              help="with --backend redis or redis-cluster: live leases in each Redis "
                   "configuration (each is granted through a Lua script; memory and expiry "
                   "figures are per lease)")
@click.option("--auth", "secured", is_flag=True,
              help="also measure a registry that authenticates every call by bearer token "
                   "(memory backend), interleaved with the others; its figures end in _auth")
@click.option("--lookup-tenants", default=1000, show_default=True,
              type=click.IntRange(min=2),
              help="tenants the lookup registry's --leases leases are spread over")
@click.option("--lookup-messages", default=200, show_default=True,
              type=click.IntRange(1, 4000),
              help="messages of each lease's history: every lease is granted with the "
                   "history keys the gateway picks for it, and a lookup continues one by two "
                   "messages")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def registry_bench(leases: int, blocks: int, rate: float, duration: float, concurrency: int,
                   rounds: int, backend: str, replicas: int, redis_url: str,
                   redis_shards: int | None, tenants: int | None, redis_leases: int,
                   secured: bool, lookup_tenants: int, lookup_messages: int,
                   as_json: bool) -> None:
    """Measure the registry beside a trivial gRPC echo service (about a minute; with
    --backend redis or redis-cluster, a few more). Memory backend: one JSON object. Redis:
    one object per configuration, keyed memory, redis_1, ..., redis_N (redis-cluster:
    redis_cluster_1, ..., redis_cluster_N), each Redis one with its primaries' command
    counts (primary_commands: one per primary, in address order)."""

    def log(msg: str) -> None:
        click.echo(msg, err=True)

    if backend == "memory":
        result = aio.run(_run(leases, blocks, rate, duration, concurrency, rounds, log,
                              secured=secured, lookup_tenants=lookup_tenants,
                              lookup_messages=lookup_messages))
        if as_json:
            click.echo(json.dumps(result, sort_keys=True))
        else:
            _report(result, TARGETS)
        return

    cluster = backend == "redis-cluster"
    if redis_url and ("+cluster://" in redis_url) != cluster:
        raise click.UsageError(
            "--backend redis-cluster takes a redis+cluster:// --redis-url" if cluster else
            "a redis+cluster:// --redis-url needs --backend redis-cluster")
    tenants = tenants or (1000 if cluster else 1)
    results: dict[str, dict[str, Any]] = {}
    log("== memory backend")
    results["memory"] = aio.run(_run(leases, blocks, rate, duration, concurrency, rounds, log,
                                     secured=secured, lookup_tenants=lookup_tenants,
                                     lookup_messages=lookup_messages))
    redis = _Redis(redis_url, cluster)
    shards = redis_shards or len(redis.clients)
    what = "redis_cluster" if cluster else "redis"
    try:
        for n in range(1, replicas + 1):
            log(f"== {what.replace('_', ' ')}, {n} replica(s), {shards} shard(s), "
                f"{tenants} tenant(s)")

            def measure(registries: _Registries) -> dict[str, Any]:
                return aio.run(_run(redis_leases, blocks, rate, duration, concurrency, rounds,
                                    log, registries, lookup_messages=lookup_messages,
                                    tenants=tenants))

            namespace = f"kvbridge-bench-{uuid.uuid4().hex[:8]}"
            try:
                results[f"{what}_{n}"] = _run_redis(redis_leases, n, redis, namespace, shards,
                                                    measure)
            except (KvbridgeError, RuntimeError) as exc:  # report it, measure the others
                log(f"  {what} with {n} replica(s) failed: {exc}")
                results[f"{what}_{n}"] = {"error": str(exc), "replicas": n}
    finally:
        redis.stop()
    if as_json:
        click.echo(json.dumps(results, sort_keys=True))
        return
    for name, result in results.items():
        click.echo(f"\n[{name}]")
        if "error" in result:
            click.echo(f"  failed: {result['error']}")
            continue
        _report(result, TARGETS if name == "memory" else
                REDIS_CLUSTER_TARGETS if cluster else REDIS_TARGETS)
