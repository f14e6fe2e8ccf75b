"""Shared fixtures for the registry tests: a fake clock and a transport-free lease table."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from kvbridge.clock import FakeClock
from kvbridge.services.registry import HolderSpec, LeaseTable, RegistryConfig

BLOCK_SIZE = 4
FINGERPRINT = "fp-test"
HOLDER_ID = "h1"


@pytest.fixture(autouse=True)
def _no_cached_loggers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`kvbridge` commands run in-process (CliRunner) configure structlog for the whole process,
    caching each logger on first use with the runner's streams; no test may leave that behind
    for later ones (a cached logger ignores `structlog.testing.capture_logs`)."""
    configure = structlog.configure

    def uncached(**kwargs: Any) -> None:
        kwargs["cache_logger_on_first_use"] = False
        configure(**kwargs)

    monkeypatch.setattr(structlog, "configure", uncached)
    yield
    structlog.reset_defaults()


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when a test advances it."""
    return FakeClock()


@pytest.fixture
def registry_config() -> RegistryConfig:
    return RegistryConfig()


@pytest.fixture
def table(registry_config: RegistryConfig, clock: FakeClock) -> LeaseTable:
    """A lease table past its recovery grace, with holder `h1` (block size 4) registered."""
    t = LeaseTable(registry_config, clock, recovering=False)
    t.register_holder(HolderSpec(HOLDER_ID, "10.0.0.1", 5600, 1, BLOCK_SIZE, FINGERPRINT))
    return t


# ==== registry service fixtures: real gRPC servers on 127.0.0.1 port 0 ========================
# Used by test_service.py, test_bad_input.py, test_client.py and test_cli.py. Every server runs
# on a FakeClock (tests advance time, never sleep for TTLs) and is stopped at teardown.
import asyncio  # noqa: E402
import threading  # noqa: E402
from collections.abc import AsyncIterator, Awaitable, Callable  # noqa: E402
from typing import TypeVar  # noqa: E402

import grpc  # noqa: E402

from kvbridge import blockhash  # noqa: E402
from kvbridge.clients import AsyncRegistryClient, RegistryClient  # noqa: E402
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc  # noqa: E402
from kvbridge.services.registry import RegistryServer, create_server  # noqa: E402

_T = TypeVar("_T")


async def start_registry(clock: FakeClock, *, listen: str = "127.0.0.1:0",
                         skip_grace: bool = True, **overrides: Any) -> RegistryServer:
    """Create and start a registry on `listen`. With `skip_grace`, move its clock past the
    restart grace (during which nothing is reported reclaimable) so reclaim notices flow.
    No /metrics endpoint unless `metrics_listen` is given (its shutdown takes 0.5 s)."""
    overrides.setdefault("metrics_listen", "")
    server = await create_server(RegistryConfig(listen=listen, **overrides), clock=clock)
    await server.start()
    if skip_grace:
        clock.advance(server.config.effective_recovery_grace_s)
    return server


class KvKit:
    """Request builders shared by the service tests: one engine layout, readable hashes."""

    block_size = 4
    fingerprint = blockhash.engine_fingerprint({"model": "kvbridge-test", "dtype": "fp16"})

    @staticmethod
    def tokens(n: int, start: int = 0) -> list[int]:
        return list(range(start, start + n))

    def lease_hashes(self, tokens: list[int]) -> bytes:
        """One hash per block a lease covers, the trailing partial block included."""
        return blockhash.block_hashes(tokens, self.block_size, self.fingerprint,
                                      include_partial=True)

    def prompt_hashes(self, tokens: list[int]) -> bytes:
        """A reader's hashes: full blocks only."""
        return blockhash.block_hashes(tokens, self.block_size, self.fingerprint)

    def holder_args(self, holder_id: str, **overrides: Any) -> dict[str, Any]:
        args: dict[str, Any] = dict(holder_id=holder_id, nixl_host="10.0.0.7", nixl_port=5600,
                                    block_size=self.block_size,
                                    engine_fingerprint=self.fingerprint, tp_size=1)
        args.update(overrides)
        return args

    def grant_args(self, holder_id: str, tenant: str, conversation_id: str, tokens: list[int],
                   *, first_block: int = 100, **overrides: Any) -> dict[str, Any]:
        n_blocks = -(-len(tokens) // self.block_size)
        args: dict[str, Any] = dict(
            holder_id=holder_id, tenant=tenant, conversation_id=conversation_id,
            remote_request_id=f"req-{conversation_id}-{len(tokens)}",
            block_ids=list(range(first_block, first_block + n_blocks)),
            token_count=len(tokens), block_hashes=self.lease_hashes(tokens))
        args.update(overrides)
        return args


@pytest.fixture
def kv() -> KvKit:
    return KvKit()


@pytest.fixture
def registry_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def registry_factory() -> AsyncIterator[Callable[..., Awaitable[RegistryServer]]]:
    """`await registry_factory(clock=None, skip_grace=True, **config_overrides)` starts one
    more registry, stopped at teardown."""
    started: list[RegistryServer] = []

    async def make(clock: FakeClock | None = None, **overrides: Any) -> RegistryServer:
        server = await start_registry(clock or FakeClock(), **overrides)
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop(0)


@pytest.fixture
async def registry_server(registry_clock: FakeClock) -> AsyncIterator[RegistryServer]:
    server = await start_registry(registry_clock)
    yield server
    await server.stop(0)


@pytest.fixture
async def registry_client(registry_server: RegistryServer
                          ) -> AsyncIterator[AsyncRegistryClient]:
    async with AsyncRegistryClient(f"127.0.0.1:{registry_server.port}") as client:
        yield client


@pytest.fixture
async def registry_stub(registry_server: RegistryServer
                        ) -> AsyncIterator[pb_grpc.RegistryServiceStub]:
    """A raw stub, for statuses and ErrorInfo exactly as they arrive."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry_server.port}")
    yield pb_grpc.RegistryServiceStub(channel)
    await channel.close()


async def wait_for_watchers(server: RegistryServer, count: int, timeout: float = 5.0) -> None:
    """Wait until `count` WatchLeases streams are subscribed (the metrics listener excluded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while server.store.listener_count() - 1 < count:
        if loop.time() > deadline:
            raise TimeoutError(f"{count} watcher(s) did not subscribe within {timeout}s")
        await asyncio.sleep(0.005)


@pytest.fixture
def watchers() -> Callable[..., Awaitable[None]]:
    """`await watchers(server, n)`: wait until n WatchLeases streams are subscribed."""
    return wait_for_watchers


class ThreadedRegistry:
    """A registry served from its own thread and event loop, for blocking clients and the CLI.

    Everything touching the lease table (clock moves, ticks) runs on that loop via `call`."""

    def __init__(self, **overrides: Any) -> None:
        self._overrides = overrides
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-registry",
                                        daemon=True)
        self._thread.start()
        self.clock = FakeClock()
        self.server: RegistryServer | None = self.run(start_registry(self.clock, **overrides))
        self.port = self.server.port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def table(self) -> Any:
        assert self.server is not None
        return self.server.table

    def run(self, coro: Awaitable[_T], timeout: float = 10.0) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        async def on_loop() -> _T:
            return fn(*args)

        return self.run(on_loop())

    def advance(self, seconds: float) -> int:
        """Move the registry's clock and run expiry; returns the leases expired."""
        def move() -> int:
            self.clock.advance(seconds)
            return int(self.table.tick())

        return self.call(move)

    def watcher_count(self) -> int:
        assert self.server is not None
        store = self.server.store
        return self.call(lambda: store.listener_count() - 1)

    def wait_for_watchers(self, count: int = 1, timeout: float = 10.0) -> None:
        """Block until `count` WatchLeases streams are subscribed (from another thread)."""
        deadline = time.monotonic() + timeout
        while self.watcher_count() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} watcher(s) did not subscribe within {timeout}s")
            time.sleep(0.005)

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.stop(0))
            self.server = None

    def restart_fresh(self) -> None:
        """Replace the registry by a new one with empty state on the same port (a restart)."""
        self.stop()
        self.clock = FakeClock()
        self.server = self.run(start_registry(self.clock, listen=self.target, **self._overrides))

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def threaded_registry() -> Iterator[ThreadedRegistry]:
    registry = ThreadedRegistry()
    yield registry
    registry.close()


@pytest.fixture
def sync_client(threaded_registry: ThreadedRegistry) -> Iterator[RegistryClient]:
    with RegistryClient(threaded_registry.target) as client:
        yield client


# ==== a real redis-server on a free 127.0.0.1 port ============================================
import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402


class RedisProcess:
    """A `redis-server` this test session started (no persistence), stopped by its PID."""

    def __init__(self, *extra: str, port: int = 0) -> None:
        """Start one on `port` (0: a free one). `extra` redis-server arguments replace the
        defaults `--save '' --appendonly no` (no persistence)."""
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server; "
                        ".ci/run installs it)")
        for _attempt in range(5):  # the free port may be taken between probe and bind
            self.port = port
            if not port:
                probe = socket.socket()
                probe.bind(("127.0.0.1", 0))
                self.port = probe.getsockname()[1]
                probe.close()
            persistence = () if extra else ("--save", "", "--appendonly", "no")
            self.proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", *persistence,
                 "--loglevel", "warning", *extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(5.0):
                return
            self.stop()
        raise RuntimeError("could not start redis-server")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process this test session started (by its PID): SIGTERM, then SIGKILL after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """One redis-server for the session; tests keep apart by namespace (`redis_namespace`)."""
    server = RedisProcess()
    yield server
    server.stop()


class RedisCluster:
    """A Redis Cluster of `primaries` redis-servers, each with `replicas` replicas (no
    persistence), this test session started and joined with `redis-cli --cluster create`:
    equal slot ranges, the first `primaries` nodes the primaries. `extra`: more redis-server
    arguments for every node."""

    def __init__(self, primaries: int = 3, replicas: int = 0, *extra: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvbridge-cluster-")
        self.nodes: list[RedisProcess] = []
        try:
            for k in range(primaries * (1 + replicas)):
                # (a replica's full sync writes an RDB file even without --save: in the
                # cluster's own folder, not the tests' working directory)
                self.nodes.append(RedisProcess(
                    "--save", "", "--appendonly", "no", "--cluster-enabled", "yes",
                    "--cluster-config-file", os.path.join(self.dir, f"nodes-{k}.conf"),
                    "--dir", self.dir, "--dbfilename", f"dump-{k}.rdb",
                    "--cluster-node-timeout", "2000", *extra))
            subprocess.run(
                ["redis-cli", "--cluster", "create",
                 *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-replicas",
                 str(replicas), "--cluster-yes"], check=True, capture_output=True, timeout=30)
            deadline = time.monotonic() + 20
            while not all(self._ok(n) for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _ok(node: RedisProcess) -> bool:
        out = subprocess.run(["redis-cli", "-p", str(node.port), "cluster", "info"],
                             capture_output=True, text=True, timeout=5).stdout
        return "cluster_state:ok" in out

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def primary_of(self, slot: int) -> RedisProcess:
        """The node serving `slot` now, as the live nodes say."""
        import redis

        for node in self.nodes:
            if node.proc.poll() is not None:
                continue
            with redis.Redis(port=node.port, socket_timeout=5) as client:
                for first, last, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if int(first) <= slot <= int(last):
                        return next(n for n in self.nodes if n.port == int(primary[1]))
        raise RuntimeError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """One 3-primary Redis Cluster for the session; tests keep apart by namespace."""
    cluster = RedisCluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_namespace() -> str:
    return "t-" + uuid.uuid4().hex[:12]


async def serve_http(app: Any) -> tuple[Any, int]:
    """Serve an aiohttp `app` on a free 127.0.0.1 port: (its runner, to clean up; the port)."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
