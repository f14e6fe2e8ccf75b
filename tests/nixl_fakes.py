"""Stand-ins for the parts of vLLM's NIXL connector metadata and stats that the connector's
worker side touches (tests of synchronous and layered reads)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
