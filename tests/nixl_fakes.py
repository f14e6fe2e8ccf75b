"""Stand-ins for the parts of vLLM's NIXL connector metadata and stats that the connector's
worker side touches (tests of synchronous and layered reads)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
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
    and what they log and report invalid."""

    def __init__(self) -> None:
        self.xfer_stats = Stats()
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
