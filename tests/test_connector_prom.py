"""kvbridge's connector figures on vLLM's own /metrics (`kvbridge.connector._prom`): what the
engine-core process sends, how it merges with NIXL's statistics, and what the API server
serves (the path through running engines: tests/e2e/test_connector_e2e.py)."""

from __future__ import annotations

import pickle

from prometheus_client import REGISTRY, generate_latest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

from kvbridge.clock import FakeClock
from kvbridge.connector import KVBridgeConnector
from kvbridge.connector._metrics import ConnectorMetrics
from kvbridge.connector._prom import KVBRIDGE, NIXL, BridgeProm, BridgeStats, Snapshots


def test_snapshots_are_sent_when_figures_moved_and_now_and_then():
    clock = FakeClock()
    metrics = ConnectorMetrics()
    metrics.decisions.labels("hit").inc(3)
    snaps = Snapshots(metrics, clock.monotonic)
    first = snaps.due()
    assert first is not None
    assert ("kvbridge_connector_decisions_total", {"decision": "hit"}, 3.0) in first
    assert snaps.due() is None  # nothing moved, too soon
    snaps.moved()
    assert snaps.due() is None  # moved, but within the minimum interval
    clock.advance(0.1)
    metrics.decisions.labels("hit").inc()
    second = snaps.due()
    assert second is not None
    assert ("kvbridge_connector_decisions_total", {"decision": "hit"}, 4.0) in second
    clock.advance(0.5)
    assert snaps.due() is None  # not moved: waits for the maximum interval
    clock.advance(0.5)
    assert snaps.due() is not None


def _nixl_stats(failed: int) -> dict:
    stats = NixlPullConnector.build_kv_connector_stats()
    for _ in range(failed):
        stats.record_failed_transfer()
    return stats.data


def test_stats_merge_nixls_part_and_keep_the_latest_snapshot():
    worker = BridgeStats(data={NIXL: _nixl_stats(1)})
    early = BridgeStats(data={KVBRIDGE: [("kvbridge_connector_reused_tokens_total", {}, 1.0)]})
    late = BridgeStats(data={KVBRIDGE: [("kvbridge_connector_reused_tokens_total", {}, 9.0)]})
    merged = worker.aggregate(early).aggregate(BridgeStats(data={NIXL: _nixl_stats(2)}))
    merged = merged.aggregate(late)
    assert len(merged.data[NIXL]["num_failed_transfers"]) == 3
    assert merged.data[KVBRIDGE] == late.data[KVBRIDGE]
    assert merged.reduce()  # NIXL's summary, for vLLM's periodic log line
    assert not merged.is_empty()
    # The class vLLM's API server builds from the payload (the connector's classmethod).
    rebuilt = KVBridgeConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(
        merged.to_dict())))
    assert isinstance(rebuilt, BridgeStats) and rebuilt.data == merged.data
    assert BridgeStats(data={}).is_empty()
    assert BridgeStats(data={NIXL: _nixl_stats(0)}).is_empty()
    assert not BridgeStats(data={KVBRIDGE: []}).is_empty()


class _FakeNixlProm:
    def __init__(self) -> None:
        self.seen: list[tuple[dict, int]] = []

    def observe(self, data: dict, engine_idx: int = 0) -> None:
        self.seen.append((data, engine_idx))


def test_api_server_serves_each_engines_snapshot_under_vllms_labels():
    nixl = _FakeNixlProm()
    prom = BridgeProm(nixl, ["model_name", "engine"], {0: ["m-test", "0"], 1: ["m-test", "1"]})
    metrics = ConnectorMetrics()
    metrics.decisions.labels("recompute_cheaper").inc(2)
    metrics.transfer_seconds.observe(0.02)
    snaps = Snapshots(metrics, FakeClock().monotonic)
    prom.observe({KVBRIDGE: snaps.due(), NIXL: _nixl_stats(1)}, engine_idx=1)
    text = generate_latest(REGISTRY).decode()
    assert ('kvbridge_connector_decisions_total{decision="recompute_cheaper",engine="1",'
            'model_name="m-test"} 2.0') in text
    assert ('kvbridge_connector_transfer_seconds_bucket{engine="1",le="0.025",'
            'model_name="m-test"} 1.0') in text
    assert "# TYPE kvbridge_connector_transfer_seconds histogram" in text
    assert nixl.seen and nixl.seen[0][1] == 1  # NIXL's part goes to NIXL's own metrics
    assert 'engine="0"' not in text.split("kvbridge_connector_decisions_total", 1)[1].split(
        "\n# ", 1)[0]  # engine 0 sent nothing yet


def test_several_api_server_processes_are_warned_about(monkeypatch, capsys):
    """vLLM with several API server processes serves a multiprocess registry that this
    collector does not reach: said at start, with the way out (metrics_port)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/kvbridge-test-multiproc")
    BridgeProm(None, ["model_name", "engine"], {0: ["m", "0"]})
    assert "connector_metrics_not_on_vllm_metrics" in capsys.readouterr().out
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    BridgeProm(None, ["model_name", "engine"], {0: ["m", "0"]})
    assert "connector_metrics_not_on_vllm_metrics" not in capsys.readouterr().out
