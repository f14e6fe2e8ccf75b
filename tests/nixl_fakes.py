"""Stand-ins for the parts of vLLM's NIXL connector metadata and stats that the connector's
worker side touches (tests of synchronous and layered reads)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


@dataclass
class Remote:
    engine_id: str
    request_id: str = ""


@dataclass
class Meta:
    local_block_ids: list[list[int]]
    remote: Remote


@dataclass
class Metadata:
    reqs_to_recv: dict[str, Meta]


@dataclass
class Stats:
    transfers: list[str] = field(default_factory=list)
    failed: int = 0

    def record_transfer(self, telemetry: str) -> None:
        self.transfers.append(telemetry)

    def record_failed_transfer(self) -> None:
        self.failed += 1


class WorkerBase:
    """The bookkeeping of NixlPullConnectorWorker that synchronous and layered reads touch,
    and what they log and report invalid; its KV layout as an engine without Mamba, context
    parallelism, speculative decoding or a host buffer has it (layered reads apply once the
    regions are set). Every attribute of the worker named in `kvbridge.connector._vllm.NAMES`
    is here or in a subclass: a test deletes one to see its feature turn off."""

    def __init__(self) -> None:
        self.xfer_stats = Stats()
        self._is_hma_required = False
        self._uses_region_group_mapping = False
        self._has_mamba = False
        self._transfer_layer_group_ids: tuple[int, ...] = ()
        self._mixed_mem_types = False
        self.use_host_buffer = False
        self.dcp_size = 1
        self.pcp_size = 1
        self.vllm_config: Any = SimpleNamespace(speculative_config=None)
        self.region_names: list[str] = []
        self.num_regions = 0
        self.region_num_blocks: list[int] = []
        self.num_blocks = 0
        self.device_kv_caches: dict[str, Any] = {}
        self._physical_blocks_per_logical_kv_block = 1
        self._remote_agents: dict[str, dict[Any, str]] = {"decode-1": {(0, 0): "agent"}}
        self._invalid_remote_engines: set[str] = set()
        self._failed_remote_engines: set[str] = set()
        self._recving_metadata: dict[str, Meta] = {}
        self._recving_transfers: dict[str, list[Any]] = {}
        self._recv_failures: set[str] = set()
        self._invalid_block_ids: queue.Queue[set[int]] = queue.Queue()
        self.failures: list[dict[str, Any]] = []

    def _log_failure(self, failure_type: str, req_id: str | None, **context: Any) -> None:
        self.failures.append({"failure_type": failure_type, "request_id": req_id, **context})

    def invalid_blocks(self) -> set[int]:
        out: set[int] = set()
        while not self._invalid_block_ids.empty():
            out |= self._invalid_block_ids.get_nowait()
        return out
