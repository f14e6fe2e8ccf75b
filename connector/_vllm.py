"""The connector's coupling to vLLM's and NIXL's internals, in one place.

The connector subclasses vLLM's NIXL pull connector and reaches into its worker and scheduler:
it wraps two of the worker's methods, stands a proxy in for its NIXL agent, takes over its
bookkeeping of reads it posts itself, sets attributes on NIXL's connector metadata, and holds
blocks in the scheduler's block pool by hand. Every name it uses there is read or written by
one function of this module, and listed in `NAMES` with the features it serves. The rest of
the connector calls these functions and never names a vLLM or NIXL internal itself.

Each name is checked before its feature is used (`usable`): on the live object where the
connector holds one, on the installed class (from its source, see `_vllm_check`) where it does
not (the scheduler deciding on what the worker process does). A missing name turns its feature
off, with one warning, and the connector falls back to what is safe without it: no retention,
no reuse (recompute), asynchronous or whole-request reads. It never assumes a guard passed.
tests/test_vllm_names.py checks every name against the installed vLLM; `python -m
kvbridge.connector._vllm_check SRC` checks them against another release's sources.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from kvbridge.connector._version import UnsupportedVllmVersion

log = structlog.get_logger("kvbridge.connector")

# ---- features: what turns off when one of its names is missing -------------------------------

#: The connector itself: NIXL's scheduler and worker halves it extends. Missing: the engine
#: refuses to start (`require_core`).
CORE = "core"

#: Decode keeps a finished turn's blocks in the block pool under a lease. Off: nothing retained.
RETENTION = "retention"
#: Prefill asks the registry for decode's KV and reads it back. Off: every prompt recomputes.
REUSE = "reuse"
#: What a request's block hashes cover (multimodal inputs, embeddings, LoRA, cache salt).
#: Off: the request is neither retained nor read back.
INPUT_SCOPE = "input_scope"
#: The worker checks each read's pin where NIXL posts it and where it lands (`_pin_guard`).
#: Off: no reads at all (the scheduler side turns reuse off).
PIN_GUARD = "pin_guard"
#: Reads within the engine step (`_sync_reads`). Off: NIXL's own asynchronous reads.
SYNC_READS = "sync_reads"
#: Synchronous reads on a prefill with prefix caching (`_quarantine`): the blocks a read fills
#: are kept from other requests until it landed, and evicted from the prefix cache when it did
#: not. Off: with prefix caching, reads are NIXL's own (asynchronous).
SYNC_PREFIX_CACHING = "sync_prefix_caching"
#: Synchronous reads split by layer (`_layerwise`). Off: whole-request synchronous reads.
LAYERED_READS = "layered_reads"
#: Read or recompute by measured cost (`_cost`): what each engine step computes, whose time
#: the compute model learns from. Off: the fixed threshold decides.
COST = "cost"
#: Read notifications for kvbridge-retained blocks kept from NIXL's bookkeeping. Off: NIXL
#: logs them as reads of blocks it does not know.
NOTIFICATION_FILTER = "notification_filter"
#: Decode's room-making sees shared blocks: an arriving request's prompt blocks that retained
#: turns hold already (by vLLM's block hashes), and the blocks a revoked turn frees (by the
#: blocks' reference counts). Off: a request needs its whole prompt, a turn frees all its blocks.
SHARED_BLOCKS = "shared_blocks"

# ---- the classes whose names are used ---------------------------------------------------------

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
CONNECTOR = f"{_NIXL}.connector.NixlPullConnector"
SCHEDULER = f"{_NIXL}.pull_scheduler.NixlPullConnectorScheduler"
WORKER = f"{_NIXL}.pull_worker.NixlPullConnectorWorker"
METADATA = f"{_NIXL}.metadata.NixlConnectorMetadata"
REQ_META = f"{_NIXL}.metadata.ReqMeta"
REMOTE_META = f"{_NIXL}.metadata.RemoteMeta"
STATS = f"{_NIXL}.stats.NixlKVConnectorStats"
KV_CACHE_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
KV_CACHE_BLOCKS = "vllm.v1.core.kv_cache_manager.KVCacheBlocks"
BLOCK_POOL = "vllm.v1.core.block_pool.BlockPool"
KV_CACHE_BLOCK = "vllm.v1.core.kv_cache_utils.KVCacheBlock"
REQUEST = "vllm.v1.request.Request"
SCHED_OUTPUT = "vllm.v1.core.sched.output.SchedulerOutput"
NEW_REQ_DATA = "vllm.v1.core.sched.output.NewRequestData"
CACHED_REQ_DATA = "vllm.v1.core.sched.output.CachedRequestData"
CACHE_CONFIG = "vllm.config.cache.CacheConfig"
SCHEDULER_CONFIG = "vllm.config.scheduler.SchedulerConfig"
KV_CACHE_CONFIG = "vllm.v1.kv_cache_interface.KVCacheConfig"
KV_CACHE_GROUP = "vllm.v1.kv_cache_interface.KVCacheGroupSpec"
FULL_ATTENTION = "vllm.v1.kv_cache_interface.FullAttentionSpec"
VLLM_CONFIG = "vllm.config.vllm.VllmConfig"
AGENT = "nixl._api.nixl_agent"


@dataclass(frozen=True)
class Name:
    """A name of vLLM's or NIXL's the connector uses: `owner` ("package.module.Class")
    defines `attr`, and `features` need it."""

    owner: str
    attr: str
    features: tuple[str, ...]


def _names(owner: str, features: tuple[str, ...], *attrs: str) -> list[Name]:
    return [Name(owner, attr, features) for attr in attrs]


_READS = (SYNC_READS, LAYERED_READS)
NAMES: tuple[Name, ...] = (
    *_names(CONNECTOR, (CORE,), "connector_scheduler", "connector_worker", "engine_id"),
    # The connector itself (our subclass): its own state as vLLM's base class keeps it.
    *_names(CONNECTOR, (SYNC_READS, PIN_GUARD), "_connector_metadata"),
    *_names(CONNECTOR, (SYNC_READS,), "_kv_cache_config"),
    # The scheduler side of NIXL.
    *_names(SCHEDULER, (RETENTION,), "side_channel_host", "side_channel_port"),
    *_names(SCHEDULER, (RETENTION, REUSE), "is_bidirectional_kv_xfer_enabled"),
    *_names(SCHEDULER, (REUSE,), "kv_recompute_threshold"),
    *_names(SCHEDULER, (SYNC_READS,), "_reqs_need_recv", "block_size", "use_host_buffer"),
    *_names(CACHE_CONFIG, (SYNC_READS,), "enable_prefix_caching"),
    *_names(SCHEDULER_CONFIG, (SYNC_READS,), "async_scheduling"),
    # A request's blocks, in token order: where a synchronous read lands (`place_pending_recv`).
    *_names(KV_CACHE_BLOCKS, (SYNC_READS,), "get_block_ids"),
    # Prefix caching: a synchronous read's blocks, found by their hashes, evicted if it failed;
    # only where the prefix cache hashes whole blocks of one full-attention group.
    *_names(KV_CACHE_MANAGER, (SYNC_PREFIX_CACHING,), "evict_blocks"),
    *_names(REQUEST, (SYNC_PREFIX_CACHING, SHARED_BLOCKS), "block_hashes"),
    *_names(KV_CACHE_CONFIG, (SYNC_PREFIX_CACHING,), "kv_cache_groups", "hash_block_size"),
    *_names(KV_CACHE_GROUP, (SYNC_PREFIX_CACHING,), "kv_cache_spec"),
    *_names(FULL_ATTENTION, (SYNC_PREFIX_CACHING,), "block_size"),
    *_names(VLLM_CONFIG, (SYNC_PREFIX_CACHING,), "max_concurrent_batches"),
    # The block pool: retained blocks hold one reference each.
    *_names(KV_CACHE_MANAGER, (RETENTION,), "block_pool"),
    *_names(BLOCK_POOL, (RETENTION,), "blocks", "touch", "free_blocks", "num_gpu_blocks",
            "get_num_free_blocks"),
    *_names(KV_CACHE_BLOCK, (SHARED_BLOCKS,), "ref_cnt"),
    # A request's inputs beyond its token ids.
    *_names(REQUEST, (INPUT_SCOPE,), "mm_features", "prompt_embeds", "lora_request",
            "cache_salt"),
    *_names(REQUEST, (RETENTION,), "status"),
    # What a step computes: the tokens of each request and the context they attend over.
    *_names(SCHED_OUTPUT, (COST,), "num_scheduled_tokens", "scheduled_new_reqs",
            "scheduled_cached_reqs"),
    *_names(NEW_REQ_DATA, (COST,), "req_id", "num_computed_tokens"),
    *_names(CACHED_REQ_DATA, (COST,), "req_ids", "num_computed_tokens"),
    # The worker side of NIXL: what the pin guard wraps and reports through.
    *_names(WORKER, (PIN_GUARD,), "_read_blocks_for_req", "get_transfer_results",
            "_handle_failed_transfer", "_is_hma_required"),
    *_names(WORKER, (PIN_GUARD, SYNC_READS), "_recv_failures", "_recving_metadata",
            "_invalid_block_ids", "xfer_stats"),
    *_names(STATS, (PIN_GUARD,), "record_kv_expired_req"),
    # ... the bookkeeping synchronous reads take over.
    *_names(WORKER, (SYNC_READS,), "_remote_agents", "_invalid_remote_engines",
            "_failed_remote_engines", "_recving_transfers"),
    *_names(WORKER, (*_READS, NOTIFICATION_FILTER), "nixl_wrapper"),
    *_names(WORKER, _READS, "_try_release_xfer_handle", "_log_failure"),
    *_names(STATS, _READS, "record_transfer"),
    *_names(STATS, (SYNC_READS,), "record_failed_transfer"),
    *_names(METADATA, (PIN_GUARD, SYNC_READS), "reqs_to_recv"),
    *_names(REQ_META, (SYNC_READS,), "remote"),
    *_names(REQ_META, (PIN_GUARD, SYNC_READS), "local_block_ids"),
    *_names(REMOTE_META, (SYNC_READS,), "engine_id", "request_id"),
    # ... the KV layout layered reads split a READ by.
    *_names(WORKER, (LAYERED_READS,), "_uses_region_group_mapping", "_has_mamba",
            "_transfer_layer_group_ids", "_mixed_mem_types", "use_host_buffer", "dcp_size",
            "pcp_size", "vllm_config", "region_names", "num_regions", "region_num_blocks",
            "num_blocks", "device_kv_caches", "_physical_blocks_per_logical_kv_block"),
    *_names(VLLM_CONFIG, (LAYERED_READS,), "speculative_config"),
    # NIXL's agent, as the proxies that stand in for it use it.
    *_names(AGENT, (NOTIFICATION_FILTER,), "get_new_notifs"),
    *_names(AGENT, _READS, "make_prepped_xfer", "transfer", "check_xfer_state",
            "release_xfer_handle", "get_xfer_telemetry"),
)

_warned: set[str] = set()
_lock = threading.Lock()


def missing(feature: str, live: Mapping[str, Any] | None = None, *,
            owners: Iterable[str] | None = None) -> list[Name]:
    """The names `feature` needs (of the classes `owners`, or all) that are not there: looked
    up on `live[owner]` where given (an object of that class, or a stand-in for one), else on
    the installed class."""
    from kvbridge.connector._vllm_check import installed_names  # reads sources: on first use

    live = live or {}
    wanted = None if owners is None else set(owners)
    out = []
    for name in NAMES:
        if feature not in name.features or (wanted is not None and name.owner not in wanted):
            continue
        if name.owner in live:
            present = hasattr(live[name.owner], name.attr)
        else:
            found = installed_names(name.owner)
            present = found is not None and name.attr in found
        if not present:
            out.append(name)
    return out


def usable(feature: str, live: Mapping[str, Any] | None = None, *,
           owners: Iterable[str] | None = None) -> bool:
    """Whether every name `feature` needs is there (see `missing`). When one is not, the
    feature is off: said once per feature, as a warning."""
    gone = missing(feature, live, owners=owners)
    if not gone:
        return True
    with _lock:
        first = feature not in _warned
        _warned.add(feature)
    if first:
        log.warning("vllm_feature_off", feature=feature,
                    missing=[f"{n.owner.rsplit('.', 1)[-1]}.{n.attr}" for n in gone],
                    why="this vLLM lacks names the feature relies on (renamed or removed "
                        "upstream): it is turned off rather than assumed safe")
    return False


def require_core(connector: Any) -> None:
    """Refuse to run on a vLLM whose NIXL connector lacks what every feature builds on."""
    gone = missing(CORE, {CONNECTOR: connector})
    if gone:
        raise UnsupportedVllmVersion(
            "vLLM's NIXL connector lacks " + ", ".join(n.attr for n in gone)
            + ": this kvbridge release does not support this vLLM")


def reset_warnings() -> None:
    """Forget which features were reported off (tests)."""
    with _lock:
        _warned.clear()


# ---- the connector ----------------------------------------------------------------------------


def nixl_scheduler(connector: Any) -> Any:
    """Core: NIXL's scheduler half (None in a worker process)."""
    return connector.connector_scheduler


def nixl_worker(connector: Any) -> Any:
    """Core: NIXL's worker half (None in the scheduler process)."""
    return connector.connector_worker


def engine_id(connector: Any) -> str:
    """Core: this engine's NIXL id (the holder id decode registers, the reader id of
    prefill's pins)."""
    return str(connector.engine_id)


def connector_metadata(connector: Any) -> Any:
    """Pin guard, synchronous reads: the step's metadata bound to the worker-side connector."""
    return connector._connector_metadata


def kv_cache_groups(connector: Any) -> list[Any]:
    """Synchronous reads: the engine's KV cache groups (one group of equal blocks only)."""
    return list(connector._kv_cache_config.kv_cache_groups)


def attach(metadata: Any, attr: str, value: Any) -> None:
    """Pin guard, synchronous reads: kvbridge's own fields ride on NIXL's connector metadata
    (an attribute of ours; pickled with it on its way to the worker processes)."""
    setattr(metadata, attr, value)


def attached(metadata: Any, attr: str) -> Any:
    """What `attach` put on a step's metadata; None when nothing."""
    return getattr(metadata, attr, None)


def reads_to_recv(metadata: Any) -> dict[str, Any]:
    """Pin guard, synchronous reads: the step's reads (request id -> NIXL's ReqMeta); the
    dict itself, which `_sync_reads` takes reads out of."""
    reads: dict[str, Any] = metadata.reqs_to_recv
    return reads


def read_remote(read: Any) -> tuple[str, str] | None:
    """Pin guard, synchronous reads: (decode engine id, its request id) a read of the step
    (NIXL's ReqMeta) is from; None for one with no remote side."""
    if read is None or read.remote is None:
        return None
    return str(read.remote.engine_id), str(read.remote.request_id)


def read_local_blocks(read: Any) -> list[list[int]]:
    """Pin guard, synchronous reads: the local block ids a read lands in, per KV cache group."""
    blocks: list[list[int]] = read.local_block_ids
    return blocks


# ---- the scheduler ---------------------------------------------------------------------------


def pending_recv_blocks(scheduler: Any, request_id: str) -> Any:
    """Synchronous reads: the local block ids NIXL's scheduler will read into for a request
    (one list per KV cache group), or None if it has no read queued for it."""
    pending = scheduler._reqs_need_recv.get(request_id)
    return None if pending is None else pending[1]


def place_pending_recv(scheduler: Any, request_id: str, block_ids: list[list[int]],
                       computed_blocks: int) -> None:
    """Synchronous reads: read into exactly `block_ids` (per group: the blocks after the
    request's `computed_blocks` blocks from the local prefix cache that the external tokens
    fill), and mark the read as not awaiting KV. NIXL's worker aligns the remote block list
    on the end of these, so the remote blocks read are those after the local hit."""
    request, _blocks, _cached, _awaiting = scheduler._reqs_need_recv[request_id]
    scheduler._reqs_need_recv[request_id] = (
        request, tuple(list(group) for group in block_ids),
        tuple(computed_blocks for _ in block_ids), False)


def drop_pending_recv(scheduler: Any, request_id: str) -> None:
    """Synchronous reads: NIXL's scheduler forgets a read it queued (nothing to read)."""
    scheduler._reqs_need_recv.pop(request_id, None)


def scheduler_block_size(scheduler: Any) -> int:
    """Synchronous reads: NIXL's scheduler's block size (tokens per block)."""
    return int(scheduler.block_size)


def uses_host_buffer(scheduler_or_worker: Any) -> bool:
    """Synchronous and layered reads: whether NIXL stages KV through a host buffer."""
    return bool(scheduler_or_worker.use_host_buffer)


def bidirectional(scheduler: Any) -> bool:
    """Retention, reuse: whether NIXL reads decode's KV back (the D->P direction)."""
    return bool(scheduler.is_bidirectional_kv_xfer_enabled)


def reads_back_itself(scheduler: Any) -> bool:
    """Whether NIXL's own D->P read-back (upstream's fixed-TTL retention) is on, checked on
    any vLLM that has the flag, whatever other names it lacks: kvbridge refuses to run beside
    it on a decode engine."""
    return bool(getattr(scheduler, "is_bidirectional_kv_xfer_enabled", False))


def take_recompute_threshold(scheduler: Any) -> int:
    """Reuse: NIXL's `kv_recompute_threshold` (fewer reusable tokens: recompute), taken over
    by kvbridge's decision (`_cost`: the threshold until the costs are measured, then the
    costs). NIXL's own check is turned off, so that one rule decides: left on, it would refuse
    reads the measured costs chose, such as the few blocks of a turn's answer past what
    prefill's own cache holds."""
    threshold = int(scheduler.kv_recompute_threshold)
    scheduler.kv_recompute_threshold = 0
    return threshold


def side_channel(scheduler: Any) -> tuple[str, int]:
    """Retention: where this engine's NIXL handshake listens (what readers are told)."""
    return str(scheduler.side_channel_host), int(scheduler.side_channel_port)


def prefix_caching(cache_config: Any) -> bool:
    """Synchronous reads: whether prefix caching is on. Unknown counts as on."""
    if not usable(SYNC_READS, {CACHE_CONFIG: cache_config}, owners=[CACHE_CONFIG]):
        return True
    return bool(cache_config.enable_prefix_caching)


def async_scheduling(scheduler_config: Any) -> bool:
    """Synchronous reads: whether the engine schedules a step before the previous step's
    output is in (vLLM's async scheduling). Unknown counts as on."""
    if not usable(SYNC_READS, {SCHEDULER_CONFIG: scheduler_config},
                  owners=[SCHEDULER_CONFIG]):
        return True
    return bool(scheduler_config.async_scheduling)


def request_block_ids(blocks: Any) -> list[list[int]]:
    """Synchronous reads: a request's block ids per KV cache group, in token order (the
    local prefix hit first, then the external tokens', then the new tokens'), from the
    `KVCacheBlocks` the scheduler hands `update_state_after_alloc`."""
    return [list(group) for group in blocks.get_block_ids()]


def whole_block_hashes(connector: Any) -> bool:
    """Synchronous reads with prefix caching: whether the engine's prefix cache finds whole
    blocks only, one hash per block (one group of full attention, hashed per block), so that a
    local hit of n blocks is exactly the first n of a request's block hashes. Unknown: no."""
    if not usable(SYNC_PREFIX_CACHING):
        return False
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec
    except ImportError:
        return False
    config = connector._kv_cache_config
    groups = list(config.kv_cache_groups)
    if len(groups) != 1:
        return False
    spec = groups[0].kv_cache_spec
    # A subclass may cache differently (sliding window, chunked local attention): exact type.
    return (type(spec) is FullAttentionSpec and config.hash_block_size is not None
            and int(config.hash_block_size) == int(spec.block_size))


def concurrent_batches(vllm_config: Any) -> int:
    """Synchronous reads with prefix caching: how many steps the engine keeps in flight (more
    than one with async scheduling or pipeline parallelism: a step is scheduled before the
    previous one reports). Unknown: 2."""
    if not usable(SYNC_PREFIX_CACHING, {VLLM_CONFIG: vllm_config}, owners=[VLLM_CONFIG]):
        return 2
    return int(vllm_config.max_concurrent_batches)


def block_hashes(request: Any) -> Sequence[Any]:
    """Synchronous reads with prefix caching, shared blocks: the hashes of a request's full
    blocks, in token order (each chained on the ones before it, so equal hashes mean equal
    prefixes); vLLM's own list, not a copy (read on the scheduler's path)."""
    hashes: Sequence[Any] = request.block_hashes
    return hashes


def evict_cached(kv_cache_manager: Any, block_ids: set[int]) -> None:
    """Synchronous reads with prefix caching: take blocks out of the prefix cache (no request
    finds them again; those that hold them keep them)."""
    kv_cache_manager.evict_blocks(block_ids)


# ---- the block pool --------------------------------------------------------------------------


def block_pool(kv_cache_manager: Any) -> Any:
    """Retention: the scheduler's block pool."""
    return kv_cache_manager.block_pool


def hold_blocks(pool: Any, block_ids: list[int]) -> None:
    """Retention: one more reference to each block, so that the request's own free leaves
    them allocated (and in the prefix cache)."""
    pool.touch([pool.blocks[b] for b in block_ids])


def release_blocks(pool: Any, block_ids: Iterable[int]) -> None:
    """Retention: drop `hold_blocks`' references, in the order given (the pool's free queue
    evicts first what is freed first)."""
    pool.free_blocks(pool.blocks[b] for b in block_ids)


def block_refs(pool: Any, block_id: int) -> int:
    """Shared blocks: how many holders (requests, retained turns) a block has."""
    return int(pool.blocks[block_id].ref_cnt)


def null_block(pool: Any) -> Any:
    """Shared blocks: a block of the pool, to check the names of (block 0, vLLM's null block)."""
    return pool.blocks[0]


def pool_blocks(pool: Any) -> int:
    """Retention: usable blocks in the pool (block 0 is vLLM's null block)."""
    return int(pool.num_gpu_blocks) - 1


def free_block_counter(pool: Any) -> Callable[[], int]:
    """Retention: the pool's count of free blocks (cached ones included), as a callable."""
    counter: Callable[[], int] = pool.get_num_free_blocks
    return counter


# ---- requests --------------------------------------------------------------------------------


def step_shape(scheduler_output: Any) -> tuple[int, int]:
    """Cost: the tokens a step computes, and their sum over its requests of tokens times the
    context each attends over (its computed tokens plus the step's)."""
    scheduled = scheduler_output.num_scheduled_tokens
    computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    tokens = area = 0
    for req_id, n in scheduled.items():
        tokens += n
        area += n * (computed.get(req_id, 0) + n)
    return tokens, area


def finished_normally(request: Any) -> bool:
    """Retention: the request stopped or reached its length (not aborted, not failed)."""
    return str(request.status.name) in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def input_scope(request: Any) -> tuple[bool, Any, str] | None:
    """Input scope: (whether the request has inputs its token ids do not name: multimodal
    features or prompt embeddings; its LoRA request or None; its cache salt). None when this
    vLLM's requests lack one of these fields: the request then counts as not coverable."""
    if not usable(INPUT_SCOPE, {REQUEST: request}):
        return None
    opaque = bool(request.mm_features) or request.prompt_embeds is not None
    return opaque, request.lora_request, str(request.cache_salt or "")


# ---- the worker ------------------------------------------------------------------------------


def nixl_agent(worker: Any) -> Any:
    """Notification filter, synchronous and layered reads: the worker's NIXL agent."""
    return worker.nixl_wrapper


def set_nixl_agent(worker: Any, agent: Any) -> None:
    """Notification filter, layered reads: stand a proxy in for the worker's NIXL agent."""
    worker.nixl_wrapper = agent


def read_blocks_for_req(worker: Any) -> Callable[[str, Any], None]:
    """Pin guard: NIXL's pull worker's method that posts a request's READ."""
    method: Callable[[str, Any], None] = worker._read_blocks_for_req
    return method


def set_read_blocks_for_req(worker: Any, method: Callable[[str, Any], None]) -> None:
    """Pin guard: wrap where every READ is posted (at once, or once a handshake is done)."""
    worker._read_blocks_for_req = method


def transfer_results(worker: Any) -> Callable[[], Any]:
    """Pin guard: the worker's report of finished (and failed) reads."""
    method: Callable[[], Any] = worker.get_transfer_results
    return method


def set_transfer_results(worker: Any, method: Callable[[], Any]) -> None:
    """Pin guard: wrap where finished reads are reported."""
    worker.get_transfer_results = method


def fail_read(worker: Any, request_id: str) -> None:
    """Pin guard: fail a read that was not posted, as NIXL fails one of blocks about to
    expire: reported done and failed (its blocks invalid), not counted as a transfer failure."""
    worker._handle_failed_transfer(request_id, None, worker._recv_failures,
                                   record_failed_transfer=False)


def hma_required(worker: Any) -> bool:
    """Pin guard: whether the engine has several KV cache groups (NIXL reports no invalid
    blocks of a failed read then, and neither does the guard)."""
    return bool(worker._is_hma_required)


def recving_metadata(worker: Any) -> dict[str, Any]:
    """Pin guard, synchronous reads: NIXL's ReqMeta of each read it tracks."""
    metas: dict[str, Any] = worker._recving_metadata
    return metas


def recving_transfers(worker: Any) -> dict[str, list[Any]]:
    """Synchronous reads: NIXL's transfer handles of each read it tracks."""
    transfers: dict[str, list[Any]] = worker._recving_transfers
    return transfers


def recv_failures(worker: Any) -> set[str]:
    """Synchronous reads: reads NIXL failed before posting (reported at its next results)."""
    failures: set[str] = worker._recv_failures
    return failures


def report_invalid_blocks(worker: Any, block_ids: set[int]) -> None:
    """Pin guard, synchronous reads: blocks that did not load (the scheduler recomputes)."""
    worker._invalid_block_ids.put(block_ids)


def handshake_done(worker: Any, engine_id: str) -> bool:
    """Synchronous reads: whether the worker has a usable NIXL handshake with an engine."""
    return (engine_id not in worker._invalid_remote_engines
            and engine_id in worker._remote_agents)


def remote_engine_failed(worker: Any, engine_id: str) -> None:
    """Synchronous reads: a read from this engine failed; NIXL handshakes with it again."""
    worker._failed_remote_engines.add(engine_id)


def try_release_xfer(worker: Any, request_id: str, handle: Any) -> bool:
    """Synchronous and layered reads: release a transfer handle (cancels it if in flight);
    False while the backend still holds it."""
    return bool(worker._try_release_xfer_handle(request_id, handle))


def log_failure(worker: Any, **context: Any) -> None:
    """Synchronous and layered reads: log a failed transfer in NIXL's own terms."""
    worker._log_failure(**context)


def worker_objects(worker: Any) -> dict[str, Any]:
    """The worker and its transfer counters, as `usable` checks them live."""
    return {WORKER: worker, STATS: getattr(worker, "xfer_stats", None)}


def xfer_stats(worker: Any) -> Any:
    """Pin guard, synchronous and layered reads: NIXL's transfer counters
    (record_transfer, record_failed_transfer, record_kv_expired_req)."""
    return worker.xfer_stats


@dataclass(frozen=True)
class WorkerLayout:
    """Layered reads: what NIXL's worker knows of its KV layout (see `_layerwise.Layout`)."""

    several_groups: bool
    mamba: bool
    layer_name_routing: bool
    mixed_mem_types: bool
    host_buffer: bool
    context_parallel: bool
    speculative: bool
    region_names: list[str]
    num_regions: int
    region_num_blocks: list[int]
    num_blocks: int
    cache_names: set[str]
    per_block: int


def worker_layout(worker: Any) -> WorkerLayout | None:
    """Layered reads: the worker's KV layout; None when this vLLM lacks a name it is read
    from (then layered reads are off)."""
    if not usable(LAYERED_READS, {WORKER: worker,
                                  VLLM_CONFIG: getattr(worker, "vllm_config", None)},
                  owners=[WORKER, VLLM_CONFIG]):
        return None
    return WorkerLayout(
        several_groups=bool(worker._uses_region_group_mapping),
        mamba=bool(worker._has_mamba),
        layer_name_routing=bool(worker._transfer_layer_group_ids),
        mixed_mem_types=bool(worker._mixed_mem_types),
        host_buffer=bool(worker.use_host_buffer),
        context_parallel=worker.dcp_size > 1 or worker.pcp_size > 1,
        speculative=bool(worker.vllm_config.speculative_config),
        region_names=list(worker.region_names or []),
        num_regions=int(worker.num_regions or 0),
        region_num_blocks=list(worker.region_num_blocks or []),
        num_blocks=int(worker.num_blocks),
        cache_names=set(worker.device_kv_caches or {}),
        per_block=int(worker._physical_blocks_per_logical_kv_block or 1),
    )
