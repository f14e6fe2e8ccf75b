"""`kvbridge up`: the embedded stack. Registry, router and gateway in this process; with
`--cpu-engines`, also prefill and decode vLLM engines on the CPU with the connector (one of
each unless `--prefills`/`--decodes`), each registered with the router by an instance
agent. Ctrl-C (or SIGTERM) stops everything it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import structlog

from kvbridge import aio, logs
from kvbridge.clients._cli import address_callback

log = structlog.get_logger("kvbridge.up")

TINY_MODEL_NAME = "kvbridge-tiny"


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (what binding port 0 draws from)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port() -> int:
    """A free TCP port on 127.0.0.1 for a process that binds it later (an engine, a minute or
    two from now). Taken from below the kernel's ephemeral range, so that nothing binding
    port 0 meanwhile (vLLM picks its internal ZMQ and NIXL ports that way) can take it first;
    never the same port twice in this process."""
    low = _ephemeral_low()
    if low > 11000:
        for _ in range(500):
            port = random.randrange(10000, low)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class UpOptions:
    registry_listen: str = "127.0.0.1:50051"
    router_listen: str = "127.0.0.1:50061"
    gateway_listen: str = "127.0.0.1:8080"
    cpu_engines: bool = False
    model: Path | None = None
    work_dir: Path = field(default_factory=lambda: Path(".kvbridge"))
    idle_ttl_s: float = 120.0
    holder_ttl_s: float = 10.0
    read_deadline_s: float = 5.0  # CPU engines busy-poll the cores the control plane shares
    api_keys_file: str = ""
    engine_timeout_s: float = 600.0
    max_model_len: int = 2048
    ready_json: Path | None = None  # where to write the URLs (JSON) once everything is up
    prefills: int = 1
    decodes: int = 1
    kv_cache_mb: int = 0  # each engine's; 0: vLLM's (VLLM_CPU_KVCACHE_SPACE)
    prefill_prefix_caching: bool = True  # vLLM's default
    decision: str = "cost"  # prefill's read-or-recompute rule (connector setting `decision`)


@dataclass
class Urls:
    gateway: str
    registry: str
    router: str
    engines: dict[str, str] = field(default_factory=dict)
    connector_metrics: dict[str, str] = field(default_factory=dict)
    # The registry's and the router's Prometheus metrics (on this machine only, a port each).
    registry_metrics: str = ""
    router_metrics: str = ""
    model: str = ""
    api_keys: bool = False  # the gateway takes only the keys of --api-keys-file


async def run_stack(opts: UpOptions, stop: asyncio.Event,
                    on_ready: Callable[[Urls], Awaitable[None]] | None = None) -> None:
    """Start everything, call `on_ready` (or wait for `stop`), then stop everything."""
    from kvbridge.services.gateway import GatewayConfig, start_gateway
    from kvbridge.services.registry import RegistryConfig
    from kvbridge.services.registry import create_server as create_registry
    from kvbridge.services.router import RouterConfig
    from kvbridge.services.router import create_server as create_router

    cleanups: list[Callable[[], Awaitable[None]]] = []
    try:
        # The embedded stack is a local, single-machine stack: insecure local mode, said so
        # in its start line and its ready banner.
        log.warning("insecure_local_mode", auth="off", tls="off",
                    note="every gRPC caller is an admin; for a trusted local machine only")
        # Metrics on loopback ports of their own: a local Prometheus (or a test) can scrape
        # the whole stack, whatever address the services listen on.
        registry = await create_registry(RegistryConfig(listen=opts.registry_listen,
                                                        metrics_listen="127.0.0.1:0",
                                                        insecure=True))
        await registry.start()
        cleanups.append(lambda: registry.stop(1.0))
        router = await create_router(RouterConfig(listen=opts.router_listen,
                                                  registry=registry.address,
                                                  metrics_listen="127.0.0.1:0", insecure=True))
        await router.start()
        cleanups.append(lambda: router.stop(1.0))
        # CPU engines share this machine's cores with everything here: generous deadlines.
        gateway = await start_gateway(GatewayConfig(
            listen=opts.gateway_listen, router=router.address, registry=registry.address,
            api_keys_file=opts.api_keys_file, route_timeout_s=5.0, insecure=True))
        cleanups.append(gateway.stop)
        urls = Urls(gateway.url, registry.address, router.address,
                    registry_metrics=f"http://127.0.0.1:{registry.metrics_port}/metrics",
                    router_metrics=f"http://127.0.0.1:{router.metrics_port}/metrics",
                    api_keys=bool(opts.api_keys_file))
        if opts.cpu_engines:
            await _start_cpu_engines(opts, registry.address, router.address, urls, cleanups,
                                     stop)
        if stop.is_set():
            return
        if opts.ready_json is not None:
            _write_ready_json(opts.ready_json, urls)
        if on_ready is not None:
            await on_ready(urls)
        else:
            _print_ready(urls)
            await stop.wait()
    finally:
        for cleanup in reversed(cleanups):
            try:
                await cleanup()
            except Exception:  # keep stopping the rest
                log.exception("stop_failed")
        log.info("stack_stopped")


async def _start_cpu_engines(opts: UpOptions, registry: str, router: str, urls: Urls,
                             cleanups: list[Callable[[], Awaitable[None]]], stop: asyncio.Event
                             ) -> None:
    from kvbridge.clients._agent import InstanceAgent
    from kvbridge.clients._router import AsyncRouterClient
    from kvbridge.engines import (
        EngineSpec,
        control_plane_cpus,
        pin_own_threads,
        start_engine,
        wait_ready,
    )
    from kvbridge.tiny_model import TinyModelSpec, make_tiny

    loop = asyncio.get_running_loop()
    work = opts.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = opts.model or work / "tiny-model"
    if not (model / "config.json").exists():
        if opts.model is not None:
            raise click.ClickException(f"no model at {model} (config.json missing)")
        log.info("making_tiny_model", path=str(model))
        await loop.run_in_executor(None, make_tiny, model, TinyModelSpec())
    name = TINY_MODEL_NAME if opts.model is None else model.name
    urls.model = name
    engines: list[tuple[str, Any]] = []

    async def stop_engines() -> None:
        # All at once: an engine may take its whole stop timeout to exit, and one after the
        # other they outlasted what a caller waits for `kvbridge up` to stop before killing
        # it, which left the rest running with no one to stop them.
        stopped = await asyncio.gather(
            *(loop.run_in_executor(None, e.stop) for _, e in engines), return_exceptions=True)
        for (instance, _), result in zip(engines, stopped, strict=True):
            if isinstance(result, BaseException):
                log.error("engine_stop_failed", instance=instance, error=repr(result))

    cleanups.append(stop_engines)
    for role, index, cpu in engine_cores(opts.prefills, opts.decodes, os.cpu_count() or 1):
        instance = f"{role}-{index}"
        metrics_port = _free_port()
        settings: dict[str, Any] = {"read_deadline_s": opts.read_deadline_s, "router": router,
                                    "metrics_port": metrics_port, "rpc_timeout_s": 5.0,
                                    "decision": opts.decision}
        if role == "decode":
            settings = {"idle_ttl_s": opts.idle_ttl_s, "metrics_port": metrics_port,
                        "rpc_timeout_s": 5.0, "holder_ttl_s": opts.holder_ttl_s}
        urls.connector_metrics[instance] = f"http://127.0.0.1:{metrics_port}/metrics"
        spec = EngineSpec(role, str(model), _free_port(), _free_port(), f"kvbridge-{instance}",
                          registry, cpu=cpu, kvbridge=settings, served_name=name,
                          log_stats=True, max_model_len=opts.max_model_len,
                          kv_cache_bytes=opts.kv_cache_mb << 20 or None,
                          prefix_caching=None if role == "decode"
                          else opts.prefill_prefix_caching)
        engine = start_engine(spec, work)
        engines.append((instance, engine))
        log.info("engine_starting", instance=instance, url=spec.url, log=str(engine.log_path),
                 cpu=cpu)
    for instance, engine in engines:
        waiter: asyncio.Future[Any] = loop.run_in_executor(None, wait_ready, engine,
                                                           opts.engine_timeout_s)
        stopper: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if waiter not in done:
            return  # stopping while engines start: cleanups stop them
        waiter.result()
        urls.engines[instance] = engine.spec.url
        log.info("engine_ready", instance=instance, url=engine.spec.url)
    # This process (registry, router, gateway, agents) runs at a higher priority than the
    # engines (they run niced): on the cores no engine computes on, or with none left on any,
    # where the kernel wakes it on an idle one (see `control_plane_cpus`).
    cores = control_plane_cpus({e.spec.cpu for _, e in engines})
    pin_own_threads(cores)
    log.info("control_plane_pinned", cpus=sorted(cores))
    client = AsyncRouterClient(router, timeout=2.0)
    agents_stop = asyncio.Event()
    # CPU engines busy-poll their cores and can answer /metrics late; the agents know their
    # processes, so only a process that exits drops an engine from the router.
    tasks = [asyncio.ensure_future(InstanceAgent(
        client, instance, e.spec.role, e.spec.url, e.spec.engine_id, name,
        "127.0.0.1", e.spec.nixl_port, ttl=30.0,
        alive=_running(e.process)).run(agents_stop)) for instance, e in engines]

    async def stop_agents() -> None:
        agents_stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()

    cleanups.append(stop_agents)
    # The gateway routes only to registered instances: wait until all are.
    for _ in range(100):
        listed = await client.list_instances()
        if len(listed) >= len(engines):
            return
        await asyncio.sleep(0.1)
    raise click.ClickException("the engines did not register with the router")


def engine_cores(prefills: int, decodes: int, cpus: int) -> list[tuple[str, int, int]]:
    """(role, index, core) of each CPU engine. Prefills take cores of their own first: their
    compute is every turn's time to first token. Decodes share the remaining cores (all of
    them when prefills took every core), round robin."""
    prefill_cores = [i % cpus for i in range(prefills)]
    rest = [c for c in range(cpus) if c not in prefill_cores] or list(range(cpus))
    return ([("prefill", i, prefill_cores[i]) for i in range(prefills)]
            + [("decode", j, rest[j % len(rest)]) for j in range(decodes)])


def _write_ready_json(path: Path, urls: Urls) -> None:
    """For scripts: the URLs, written whole (rename) so that a reader never sees half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(urls), indent=2) + "\n")
    tmp.replace(path)


def _running(process: Any) -> Callable[[], bool]:
    return lambda: process.poll() is None


def _print_ready(urls: Urls) -> None:
    lines = ["kvbridge is up (insecure local mode: no tokens, no TLS, "
             f"{'open API keys' if not urls.api_keys else 'API keys from a file'})",
             f"  gateway   {urls.gateway}/v1   (OpenAI-compatible)",
             f"  registry  {urls.registry}   (metrics {urls.registry_metrics})",
             f"  router    {urls.router}   (metrics {urls.router_metrics})"]
    for role, url in urls.engines.items():
        lines.append(f"  {role:<9} {url}   (connector metrics {urls.connector_metrics[role]})")
    if urls.model:
        lines.append(f"  model     {urls.model}")
        lines.append(f"try: kvbridge demo --gateway {urls.gateway}")
    lines.append("Ctrl-C stops everything.")
    click.echo("\n".join(lines), err=False)
    sys.stdout.flush()


@click.command("up")
@click.option("--cpu-engines", is_flag=True,
              help="also start prefill and decode vLLM engines on the CPU (makes the tiny "
                   "test model first if --model is not given)")
@click.option("--prefills", default=1, show_default=True, type=click.IntRange(1, 8),
              help="with --cpu-engines: how many prefill engines (each on a core of its own "
                   "while cores last)")
@click.option("--decodes", default=1, show_default=True, type=click.IntRange(1, 8),
              help="with --cpu-engines: how many decode engines (they share the cores the "
                   "prefills left; the router places new conversations by free KV and load)")
@click.option("--kv-cache-mb", default=0, show_default=True, type=click.IntRange(min=0),
              help="with --cpu-engines: each engine's KV cache in MiB (0: vLLM's default, "
                   "VLLM_CPU_KVCACHE_SPACE); small pools show retention under memory pressure")
@click.option("--prefill-prefix-caching/--no-prefill-prefix-caching", default=True,
              show_default=True,
              help="with --cpu-engines: prefill's own prefix cache (vLLM's default). Off, "
                   "every turn's history is read back from decode, as on a busy fleet whose "
                   "prefills' caches no longer hold the conversation")
@click.option("--decision", type=click.Choice(["cost", "threshold"]), default="cost",
              show_default=True,
              help="with --cpu-engines: how prefill chooses between reading decode's KV and "
                   "recomputing it: by its measured cost (read only when faster), or whenever "
                   "at least 64 tokens are reusable (the connector's `decision` setting)")
@click.option("--model", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="model folder for --cpu-engines (default: WORK_DIR/tiny-model, made if "
                   "missing)")
@click.option("--work-dir", type=click.Path(path_type=Path, file_okay=False),
              default=Path(".kvbridge"), show_default=True,
              help="engine logs, caches and the tiny model")
@click.option("--registry-listen", default="127.0.0.1:50051", show_default=True,
              callback=address_callback(listen=True),
              help="HOST:PORT the registry's gRPC API listens on (port 0: any free port)")
@click.option("--router-listen", default="127.0.0.1:50061", show_default=True,
              callback=address_callback(listen=True),
              help="HOST:PORT the router's gRPC API listens on (port 0: any free port)")
@click.option("--gateway-listen", default="127.0.0.1:8080", show_default=True,
              callback=address_callback(listen=True),
              help="HOST:PORT the gateway's OpenAI-compatible HTTP API listens on (port 0: any "
                   "free port)")
@click.option("--idle-ttl-s", default=120.0, show_default=True, type=click.FloatRange(min=1),
              help="decode: how long a conversation's KV is kept between turns")
@click.option("--holder-ttl-s", default=10.0, show_default=True,
              type=click.FloatRange(min=1, max=300),
              help="decode: how long the registry waits for the engine's heartbeat (sent every "
                   "third of it) before its leases are lost")
@click.option("--api-keys-file", default="", help="'API_KEY TENANT' lines (default: open)")
@click.option("--demo", "demo_turns", type=click.IntRange(min=0), default=0,
              help="run a conversation of this many turns through the gateway, print it, and "
                   "stop (needs --cpu-engines)")
@click.option("--json", "as_json", is_flag=True, help="with --demo: one JSON record per turn")
@click.option("--max-model-len", default=2048, show_default=True, type=click.IntRange(min=64),
              help="context length of the CPU engines")
@click.option("--ready-json", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="once everything is up, write the URLs (gateway, registry, router, engines, "
                   "connector metrics, model) to this file as JSON, for scripts")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True,
              help="least severe log line printed (on stderr) by the registry, router, gateway "
                   "and the stack itself; engines log to files under --work-dir")
def up_command(cpu_engines: bool, prefills: int, decodes: int, kv_cache_mb: int,
               prefill_prefix_caching: bool, decision: str, model: Path | None,
               work_dir: Path, registry_listen: str, router_listen: str, gateway_listen: str,
               idle_ttl_s: float, holder_ttl_s: float,
               api_keys_file: str, demo_turns: int, as_json: bool, max_model_len: int,
               ready_json: Path | None, log_level: str) -> None:
    """Start registry, router and gateway in one process (and, with --cpu-engines, prefill
    and decode vLLM engines on this CPU: one of each unless --prefills/--decodes), wait until
    all are healthy, print the URLs, and run until Ctrl-C.

    A local stack: it runs in insecure local mode (no tokens or TLS on the gRPC services, every
    caller an admin; any API key accepted unless --api-keys-file) and says so when it starts.
    For a secured deployment run the services on their own (`kvbridge auth --help`)."""
    if (prefills != 1 or decodes != 1 or kv_cache_mb or not prefill_prefix_caching
            or decision != "cost") and not cpu_engines:
        raise click.UsageError("--prefills, --decodes, --kv-cache-mb, --decision and "
                               "--no-prefill-prefix-caching need --cpu-engines")
    if demo_turns and not cpu_engines:
        raise click.UsageError("--demo needs --cpu-engines (or run `kvbridge demo` against "
                               "a stack with engines)")
    # Logs go to stderr so that --demo --json output stays parseable.
    logs.configure(log_level if not as_json else "warning", "auto")
    opts = UpOptions(registry_listen, router_listen, gateway_listen, cpu_engines, model,
                     work_dir, idle_ttl_s, holder_ttl_s=holder_ttl_s,
                     api_keys_file=api_keys_file,
                     max_model_len=max_model_len, ready_json=ready_json,
                     prefills=prefills, decodes=decodes,
                     kv_cache_mb=kv_cache_mb, prefill_prefix_caching=prefill_prefix_caching,
                     decision=decision)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        on_ready = None
        if demo_turns:
            from kvbridge.demo import run_demo

            async def on_ready(urls: Urls) -> None:
                if not as_json:
                    _print_ready(urls)
                await run_demo(urls.gateway, turns=demo_turns, model=urls.model,
                               as_json=as_json)

        await run_stack(opts, stop, on_ready)

    try:
        aio.run(main())
    except OSError as exc:
        raise click.ClickException(f"cannot start the stack: {exc}") from exc
