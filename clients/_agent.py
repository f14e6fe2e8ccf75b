"""The instance agent: registers a vLLM engine with the router and heartbeats its load.

Load comes from the engine's own Prometheus endpoint (`/metrics`: running and waiting requests,
KV cache usage, and the KV cache's size from its cache configuration). An engine that does not
answer is reported with its last load until its heartbeat TTL runs out: the agent then stops
heartbeating, so the router drops it, and registers it again once it answers. When the agent
runs beside the engine process (`alive`), a slow answer from a live process (a CPU engine
busy-polling its own cores) is not taken for a dead engine: heartbeats go on with the last load
while the process runs. A refusal (the token, the engine id, the URL) is final: the agent stops
and raises it, rather than retrying what will be refused again.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import structlog

from kvbridge.clients._router import AsyncRouterClient
from kvbridge.errors import (
    InstanceNotFound,
    InvalidArgument,
    KvbridgeError,
    PermissionDenied,
    Unauthenticated,
)

# What the router answers to an instance it will never take as it is.
REFUSALS = (PermissionDenied, Unauthenticated, InvalidArgument)

log = structlog.get_logger("kvbridge.agent")

_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$", re.MULTILINE)
# vLLM's cache configuration, an info gauge per engine: its labels carry the pool's size.
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\} ", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_capacity_tokens: int = 0  # 0: not reported


def parse_vllm_metrics(text: str) -> EngineLoad:
    """Sum vLLM's request gauges over their label sets (one per engine: data parallel), average
    their KV usage (each engine's pool is the same size), and add up their KV capacities from
    each engine's cache configuration (blocks times block size; 0 if any is unreadable)."""
    values: dict[str, float] = {}
    usages: list[float] = []
    for name, value in _METRIC.findall(text):
        if value != "NaN":
            values[name] = values.get(name, 0.0) + float(value)
            if name == "vllm:kv_cache_usage_perc":
                usages.append(float(value))
    capacity = 0
    for labels in _CACHE_INFO.findall(text):
        fields = dict(_LABEL.findall(labels))
        blocks, block_size = fields.get("num_gpu_blocks", ""), fields.get("block_size", "")
        if not (blocks.isdigit() and block_size.isdigit()):
            capacity = 0
            break
        capacity += int(blocks) * int(block_size)
    return EngineLoad(int(values.get("vllm:num_requests_running", 0)),
                      int(values.get("vllm:num_requests_waiting", 0)),
                      min(max(sum(usages) / len(usages) if usages else 0.0, 0.0), 1.0),
                      capacity)


@dataclass
class InstanceAgent:
    router: AsyncRouterClient
    instance_id: str
    role: str  # "prefill" or "decode"
    http_url: str
    engine_id: str
    model: str
    nixl_host: str = ""
    nixl_port: int = 0
    ttl: float = 10.0
    alive: Callable[[], bool] | None = None  # the engine process is running
    metrics_timeout_s: float = 5.0

    async def run(self, stop: asyncio.Event, *, registered: bool = False) -> None:
        """Register (unless `registered` already) and heartbeat until `stop` is set;
        deregister on the way out. Raises a refusal (REFUSALS) at once."""
        load = EngineLoad()
        last_seen = 0.0
        loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=self.metrics_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while not stop.is_set():
                try:
                    async with http.get(f"{self.http_url}/metrics") as resp:
                        load = parse_vllm_metrics(await resp.text())
                    last_seen = loop.time()
                except (aiohttp.ClientError, TimeoutError) as err:
                    if self.alive is not None and self.alive():
                        log.debug("engine_metrics_slow", instance=self.instance_id,
                                  error=str(err) or type(err).__name__)
                    elif loop.time() - last_seen > self.ttl:
                        if registered:
                            log.warning("engine_unreachable", instance=self.instance_id,
                                        url=self.http_url, error=str(err))
                        registered = False
                        await self._sleep(stop, self.ttl / 3)
                        continue
                try:
                    if not registered:
                        await self.register()
                        registered = True
                    await self.router.heartbeat(
                        self.instance_id, load.running, load.waiting, load.kv_usage,
                        kv_capacity_tokens=load.kv_capacity_tokens)
                except InstanceNotFound:
                    registered = False
                    continue
                except REFUSALS as err:
                    log.error("router_refused_instance", instance=self.instance_id,
                              reason=err.reason, error=err.message)
                    raise
                except KvbridgeError as err:
                    log.warning("router_heartbeat_failed", instance=self.instance_id,
                                error=str(err))
                await self._sleep(stop, self.ttl / 3)
        if registered:
            try:
                await self.router.deregister_instance(self.instance_id, timeout=2.0)
            except KvbridgeError as err:
                log.warning("deregister_failed", instance=self.instance_id, error=str(err))

    async def register(self) -> None:
        await self.router.register_instance(self.instance_id, self.role, self.http_url,
                                            self.engine_id, self.model, self.nixl_host,
                                            self.nixl_port, self.ttl)
        log.info("instance_attached", instance=self.instance_id, role=self.role,
                 url=self.http_url, engine_id=self.engine_id)

    @staticmethod
    async def _sleep(stop: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)


__all__ = ["EngineLoad", "InstanceAgent", "parse_vllm_metrics"]
