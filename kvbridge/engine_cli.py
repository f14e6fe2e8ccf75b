"""`kvbridge engine run`: one vLLM engine with the kvbridge connector, attached to a router.

Builds vLLM's command line (the OpenAI server, the connector's kv-transfer-config for the role,
bidirectional transfer and recompute-on-failure where they belong), runs it in the foreground
with its output on ours, registers it with the router once healthy and heartbeats its load,
forwards SIGTERM/SIGINT to it, deregisters, and exits with its status. This is the command the
engine containers in docker-compose.yml run.

`kvbridge engine attach`: the instance agent alone, for an engine started by something else (a
plain `vllm serve` with the connector in its --kv-transfer-config, as the Kubernetes manifests
run it): waits for the engine's /health, registers it with the router and heartbeats its load
until SIGTERM, then deregisters. In a pod it is the sidecar beside vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import click
import structlog

from kvbridge import aio, logs
from kvbridge.auth import TOKEN_ENV
from kvbridge.clients._cli import address_callback, client_security, security_options
from kvbridge.errors import KvbridgeError

log = structlog.get_logger("kvbridge.engine")


def _setting(values: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--setting")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


@click.group("engine")
def engine_group() -> None:
    """Run vLLM engines with the kvbridge connector."""


@engine_group.command("run", context_settings={"ignore_unknown_options": True})
@click.option("--role", type=click.Choice(["prefill", "decode"]), required=True,
              help="prefill computes prompts and reads decode's KV back; decode generates the "
                   "answer and leases the KV it keeps")
@click.option("--model", required=True, help="model path or name, as vLLM takes it")
@click.option("--served-model-name", default="", help="the name clients send")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP bind address")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535),
              help="HTTP port of vLLM's OpenAI server")
@click.option("--advertise-host", default="",
              help="how the router, the gateway and other engines reach this one (HTTP and "
                   "NIXL side channel); default: --host, or this host's name for 0.0.0.0")
@click.option("--engine-id", default="", help="default: ROLE-HOSTNAME-PORT")
@click.option("--nixl-port", default=5600, show_default=True, type=click.IntRange(1, 65535),
              help="NIXL side-channel port")
@click.option("--registry", default="", callback=address_callback(optional=True),
              help="registry HOST:PORT, or replicas' comma-separated (decode engines need it)")
@click.option("--router", default="", callback=address_callback(optional=True),
              help="router HOST:PORT: register there and heartbeat load; prefill also reads "
                   "through it")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda",
              show_default=True, help="where vLLM computes: cuda (GPU) or cpu")
@click.option("--cpu", default=0, show_default=True, type=click.IntRange(min=0),
              help="--device cpu: the core (CPU number) the engine's threads are bound to")
@click.option("--block-size", default=0, type=click.IntRange(min=0),
              help="KV block size in tokens; 0 (the default): 32 on cpu, 16 on cuda")
@click.option("--max-model-len", default=4096, show_default=True, type=click.IntRange(min=1),
              help="the engine's context length in tokens (vLLM's --max-model-len)")
@click.option("--dtype", default="", help="default: float32 on cpu, auto on cuda")
@click.option("--setting", "settings", multiple=True, metavar="KEY=VALUE",
              help="a kvbridge connector setting (kv_connector_extra_config.kvbridge), e.g. "
                   "idle_ttl_s=120; repeatable")
@click.option("--instance-ttl-s", default=10.0, show_default=True,
              type=click.FloatRange(min=1),
              help="seconds the router keeps this engine without a heartbeat (sent every "
                   "third of it)")
@click.option("--work-dir", type=click.Path(path_type=Path, file_okay=False),
              default=Path(".kvbridge"), show_default=True, help="vLLM's cache folder")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def engine_run(role: str, model: str, served_model_name: str, host: str, port: int,
               advertise_host: str, engine_id: str, nixl_port: int, registry: str, router: str,
               device: str, cpu: int, block_size: int, max_model_len: int, dtype: str,
               settings: tuple[str, ...], instance_ttl_s: float, work_dir: Path,
               vllm_args: tuple[str, ...]) -> None:
    """Run one engine in the foreground. Arguments after `--` go to vLLM unchanged."""
    from kvbridge.connector._settings import ConnectorSettings
    from kvbridge.engines import EngineSpec

    logs.configure("info", "auto")
    if role == "decode" and not registry:
        raise click.UsageError("a decode engine needs --registry (it leases its KV there)")
    advertise = advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::") else host)
    extra = _setting(settings)
    if router and role == "prefill":
        extra.setdefault("router", router)
    try:
        ConnectorSettings.from_extra_config({"kvbridge": {"registry": registry, **extra}})
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--setting") from exc
    spec = EngineSpec(
        role, model, port, nixl_port, engine_id or f"{role}-{advertise}-{port}", registry,
        cpu=cpu, block_size=block_size or (32 if device == "cpu" else 16),
        max_model_len=max_model_len, dtype=dtype or ("float32" if device == "cpu" else "auto"),
        served_name=served_model_name, log_stats=True, kvbridge=extra,
        extra_args=list(vllm_args), nice=0, device=device, host=host, advertise_host=advertise)
    work_dir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(spec.command(), env=spec.environment(work_dir.resolve()))
    code = aio.run(_run(spec, process, router, instance_ttl_s, served_model_name or model))
    raise SystemExit(code)


async def _run(spec: Any, process: subprocess.Popen[bytes], router: str, ttl: float,
               model_name: str) -> int:
    from kvbridge.clients._agent import InstanceAgent
    from kvbridge.clients._router import AsyncRouterClient

    log.info("engine_started", role=spec.role, engine_id=spec.engine_id, url=spec.url,
             pid=process.pid)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    exited: asyncio.Future[Any] = loop.run_in_executor(None, process.wait)
    agent_task = None
    agent_stop = asyncio.Event()
    client = None
    try:
        while not await _healthy(spec.url):
            if exited.done() or stopping.is_set():
                break
            await asyncio.sleep(1.0)
        if spec.device == "cpu" and not exited.done():
            from kvbridge.engines import demote_busy_pollers, pin_to_core

            moved = pin_to_core(process.pid, spec.cpu)
            demoted = await loop.run_in_executor(None, demote_busy_pollers, process.pid)
            log.info("engine_pinned", cpu=spec.cpu, threads_moved=moved,
                     pollers_demoted=len(demoted))
        if router and not exited.done() and not stopping.is_set():
            client = AsyncRouterClient(router, timeout=2.0,
                                       token=os.environ.get(TOKEN_ENV) or None)
            agent = InstanceAgent(client, spec.engine_id, spec.role, spec.url, spec.engine_id,
                                  model_name, spec.advertise_host, spec.nixl_port, ttl,
                                  alive=lambda: process.poll() is None)
            agent_task = asyncio.ensure_future(agent.run(agent_stop))
        stopper: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
        await asyncio.wait({exited, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
    finally:
        agent_stop.set()
        if agent_task is not None:
            await asyncio.gather(agent_task, return_exceptions=True)
        if client is not None:
            await client.close()
        if process.poll() is None:
            process.terminate()
        code = await exited
    log.info("engine_exited", role=spec.role, engine_id=spec.engine_id, code=code)
    return int(code)


def _engine_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    parsed = urllib.parse.urlsplit(value)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if (parsed.scheme not in ("http", "https") or not parsed.hostname or port is None
            or parsed.path.strip("/") or parsed.query or parsed.fragment or parsed.username):
        raise click.BadParameter(
            f"{value!r}: expected http://HOST:PORT (how the router, the gateway and other "
            "engines reach the engine)")
    return value.rstrip("/")


@engine_group.command("attach")
@click.option("--role", type=click.Choice(["prefill", "decode"]), required=True,
              help="the engine's role, as its kv-transfer-config says (kv_producer: prefill, "
                   "kv_consumer: decode)")
@click.option("--url", "url", required=True, callback=_engine_url,
              help="the engine's HTTP URL, http://HOST:PORT, as the router, the gateway and "
                   "other engines reach it (in a pod: the pod's IP); its /health and /metrics "
                   "are read there too")
@click.option("--engine-id", required=True,
              help="the engine_id of the engine's kv-transfer-config (decode: its holder id "
                   "at the registry)")
@click.option("--model", required=True, help="the model name clients send (vLLM's "
                                             "--served-model-name, else its model)")
@click.option("--router", required=True, callback=address_callback(),
              help="router HOST:PORT to register with")
@click.option("--instance-id", default="", help="the router's name for it; default: "
                                                 "--engine-id")
@click.option("--nixl-host", default="",
              help="host of the engine's NIXL side channel; default: --url's host")
@click.option("--nixl-port", default=5600, show_default=True, type=click.IntRange(1, 65535),
              help="port of the engine's NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT)")
@click.option("--instance-ttl-s", default=10.0, show_default=True,
              type=click.FloatRange(min=1),
              help="seconds the router keeps the engine without a heartbeat (sent every "
                   "third of it)")
@security_options
def engine_attach(role: str, url: str, engine_id: str, model: str, router: str,
                  instance_id: str, nixl_host: str, nixl_port: int,
                  instance_ttl_s: float) -> None:
    """Register a running engine with the router and heartbeat its load until SIGTERM.

    For an engine started by something else (a plain `vllm serve` with the kvbridge connector
    in its --kv-transfer-config): waits until the engine's /health answers, registers it, reads
    its load from its /metrics every third of --instance-ttl-s, and deregisters on
    SIGTERM/SIGINT (exit status 0). An engine that stops answering is dropped by the router
    and registered again when it answers. A router that refuses the registration (token,
    engine id or URL not allowed) ends it with exit status 1 and the router's reason. The
    token is the engine's own (decode: holder, prefill: reader), in KVBRIDGE_TOKEN.
    """
    logs.configure("info", "auto")
    host = urllib.parse.urlsplit(url).hostname or ""
    code = aio.run(_attach(role, url, engine_id, model, router, instance_id or engine_id,
                           nixl_host or host, nixl_port, instance_ttl_s, client_security()))
    raise SystemExit(code)


async def _attach(role: str, url: str, engine_id: str, model: str, router: str,
                  instance_id: str, nixl_host: str, nixl_port: int, ttl: float,
                  security: dict[str, Any]) -> int:
    from kvbridge.clients._agent import REFUSALS, InstanceAgent
    from kvbridge.clients._router import AsyncRouterClient

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("engine_attach_waiting", role=role, engine_id=engine_id, url=url, router=router)
    while not await _healthy(url):
        if stop.is_set():
            return 0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    client = AsyncRouterClient(router, timeout=2.0, **security)
    try:
        agent = InstanceAgent(client, instance_id, role, url, engine_id, model, nixl_host,
                              nixl_port, ttl)
        try:
            # A refusal is final (the token, the engine id or the URL), now or later: say so
            # and stop, rather than retry it for ever. Anything else the agent retries.
            registered = False
            try:
                await agent.register()
                registered = True
            except REFUSALS:
                raise
            except KvbridgeError as err:
                log.warning("router_register_failed", instance=instance_id, error=str(err))
            await agent.run(stop, registered=registered)
        except REFUSALS as err:
            log.error("engine_attach_refused", instance=instance_id, reason=err.reason,
                      error=err.message)
            click.echo(f"error: {err.reason}: the router at {router} refused {instance_id}: "
                       f"{err.message}", err=True)
            return 1
    finally:
        await client.close()
    log.info("engine_detached", instance=instance_id, engine_id=engine_id)
    return 0


async def _healthy(url: str) -> bool:
    def probe() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    return await asyncio.get_running_loop().run_in_executor(None, probe)
