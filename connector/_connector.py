"""`KVBridgeConnector`: vLLM's NIXL connector (pull mode) with kvbridge's control plane.

Scheduler side (engine-core process):
- decode requests (kv_transfer_params without `do_remote_decode`) that carry a conversation key
  and finish normally keep their blocks under a registry lease (`DecodeRetention`);
- prefill requests (`do_remote_decode`) that carry a conversation key and no remote blocks ask
  the registry for verified, pinned KV on a decode engine as soon as they arrive
  (`PrefillReuse`); NIXL's own read-back path then reads exactly those blocks.
Worker side: unchanged NIXL, except that read notifications naming kvbridge-retained blocks are
not NIXL's to track (they would be logged as reads of expired blocks).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

from kvbridge import blockhash
from kvbridge.clients import RegistryClient
from kvbridge.clients._router import RouterClient
from kvbridge.clock import boot_id, monotonic
from kvbridge.connector import _prom, _vllm
from kvbridge.connector._decode import DecodeRetention
from kvbridge.connector._layerwise import capturing
from kvbridge.connector._metrics import ConnectorMetrics
from kvbridge.connector._pin_guard import PIN_ENDS_ATTR, PinEnds, PinGuard, guard_worker
from kvbridge.connector._prefill import PrefillReuse, ReadClient
from kvbridge.connector._prom import BridgeProm, BridgeStats, Snapshots
from kvbridge.connector._quarantine import Quarantine
from kvbridge.connector._settings import REMOTE_ID_PREFIX, ConnectorSettings, parse_cpus
from kvbridge.connector._sync_reads import SYNC_READS_ATTR, SyncReadResults, SyncReads
from kvbridge.connector._version import check_vllm_version, software_version

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = structlog.get_logger("kvbridge.connector")


def engine_fingerprint(vllm_config: VllmConfig) -> str:
    """What must be equal for two engines' KV blocks to be interchangeable."""
    model = vllm_config.model_config
    hf = model.hf_text_config
    return blockhash.engine_fingerprint({
        "model": model.model,
        "revision": model.revision,
        "dtype": str(model.dtype),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "layers": getattr(hf, "num_hidden_layers", None),
        "kv_heads": model.get_total_num_kv_heads(),
        "head_size": model.get_head_size(),
        "tp": vllm_config.parallel_config.tensor_parallel_size,
    })


class _NotificationFilter:
    """Wraps the worker's NIXL agent: read notifications for kvbridge-retained blocks are
    dropped before NIXL's bookkeeping sees them (those blocks are not NIXL's)."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out = {}
        for peer, notifs in self._agent.get_new_notifs().items():
            kept = [n for n in notifs if not n.startswith(REMOTE_ID_PREFIX.encode())]
            if kept:
                out[peer] = kept
        return out


def _unreported(req_id: str, why: str) -> None:
    """Where no synchronous reads run, a read the pin guard fails needs no reason recorded
    (NIXL reports it failed, and the request recomputes)."""


BridgeStats.make_nixl = NixlPullConnector.build_kv_connector_stats


class KVBridgeConnector(NixlPullConnector):  # type: ignore[misc]
    # Whether this vLLM has the names synchronous reads use (the scheduler side asks once).
    _sync_names: bool | None = None
    # Prefill: steps are measured for the cost model (`_vllm.COST` usable); and the snapshots
    # of kvbridge's metrics for vLLM's /metrics (None: no control plane). Set in __init__.
    _step_shapes: bool = False
    _snapshots: Snapshots | None = None
    # Prefill with prefix caching: the blocks of synchronous reads in flight (set once the
    # scheduler binds its KV cache manager), and whether the cache hashes whole blocks.
    _quarantine: Quarantine | None = None
    _whole_block_hashes: bool | None = None
    _overlapped_steps: bool = False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any) -> None:
        check_vllm_version()
        super().__init__(vllm_config, role, kv_cache_config)
        _vllm.require_core(self)
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        self.prefill: PrefillReuse | None = None
        self.decode: DecodeRetention | None = None
        self.sync_reads: SyncReads | None = None
        # Scheduler side: requests to read synchronously once scheduled, and the decode engines
        # this engine has read from (NIXL handshake done: their reads may be synchronous).
        self._sync_planned: set[str] = set()
        self._read_from: set[str] = set()
        # Per request planned for a synchronous read: the tokens of its prompt this engine's
        # own prefix cache holds (block-aligned), after which the read lands.
        self._local_tokens: dict[str, int] = {}
        # The same, per request reading asynchronously (for its reported figures only).
        self._async_local: dict[str, int] = {}
        # With prefix caching, a request not loading asynchronously has its blocks hashed (so
        # findable by other requests) as they are allocated, before the read fills them: a
        # synchronous read's blocks are then held from other requests until it landed, and
        # evicted if it did not (`_quarantine`). Under async scheduling or pipeline
        # parallelism the next step is scheduled before a step's outcome is in: reads stay
        # asynchronous there (vLLM caches an asynchronously loaded request's blocks once they
        # landed).
        self._prefix_caching = _vllm.prefix_caching(vllm_config.cache_config)
        self._async_scheduling = _vllm.async_scheduling(vllm_config.scheduler_config)
        self._overlapped_steps = (self._prefix_caching
                                  and _vllm.concurrent_batches(vllm_config) > 1)
        self.pin_guard: PinGuard | None = None
        self._snapshots = None
        self._step_shapes = False
        self._boot_id = boot_id()
        if role == KVConnectorRole.WORKER:
            worker = _vllm.nixl_worker(self)
            if _vllm.usable(_vllm.NOTIFICATION_FILTER, {_vllm.WORKER: worker},
                            owners=[_vllm.WORKER]):
                agent = _vllm.nixl_agent(worker)
                if _vllm.usable(_vllm.NOTIFICATION_FILTER, {_vllm.AGENT: agent},
                                owners=[_vllm.AGENT]):
                    _vllm.set_nixl_agent(worker, _NotificationFilter(agent))
            self.pin_guard = PinGuard(self.settings.pin_margin_s, boot=self._boot_id)
            # Without the names synchronous reads need, every read stays NIXL's own
            # (asynchronous): the worker step then only passes the pins on to the guard.
            if _vllm.usable(_vllm.SYNC_READS, _vllm.worker_objects(worker)):
                self.sync_reads = SyncReads(worker, self.settings.sync_read_timeout_s,
                                            layerwise=self.settings.layerwise_reads,
                                            read_cpus=parse_cpus(self.settings.read_cpus),
                                            pins=self.pin_guard)
            report = self.sync_reads.pin_failure if self.sync_reads is not None else None
            self.pin_guard = self._guard_reads(worker, self.pin_guard, report or _unreported)
            return
        if not self.settings.registry and not self.settings.router:
            log.warning("kvbridge_disabled", why="neither kvbridge.registry nor kvbridge.router "
                        "is set")
            return
        scheduler = _vllm.nixl_scheduler(self)
        block_size = vllm_config.cache_config.block_size
        fingerprint = engine_fingerprint(vllm_config)
        self.metrics = ConnectorMetrics()
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_host, self.settings.metrics_port)
        self._snapshots = Snapshots(self.metrics, monotonic)
        security: dict[str, Any] = {"token": self.settings.token(), "tls": self.settings.tls()}
        client = (RegistryClient(self.settings.registry, timeout=self.settings.rpc_timeout_s,
                                 retries=1, **security) if self.settings.registry else None)
        if transfer.kv_role in ("kv_consumer", "kv_both") and not self.settings.registry:
            raise ValueError("kvbridge on a decode engine (kv_consumer) needs kvbridge.registry: "
                             "it registers as a holder and grants leases there")
        live = {_vllm.SCHEDULER: scheduler}
        # Checked whatever else this vLLM lacks: upstream's own fixed-TTL read-back must not run
        # beside (or instead of) kvbridge's leases on a decode engine.
        if transfer.kv_role == "kv_consumer" and _vllm.reads_back_itself(scheduler):
            raise ValueError(
                "kvbridge retains decode KV under leases itself: set "
                "bidirectional_kv_xfer to false on decode engines (kv_consumer)")
        if getattr(vllm_config.model_config, "enable_sleep_mode", False):
            # A sleeping engine drops its KV and a woken one registers it anew, which leases
            # (decode) and reads (prefill) would not notice: vLLM 0.33 asks
            # `supports_sleep_mode`, 0.32 does not.
            raise ValueError("kvbridge does not support vLLM's sleep mode (--enable-sleep-mode)")
        if transfer.kv_role in ("kv_consumer", "kv_both") and _vllm.usable(_vllm.RETENTION,
                                                                             live):
            assert client is not None
            nixl_host, nixl_port = _vllm.side_channel(scheduler)
            self.decode = DecodeRetention(
                self.settings, client, holder_id=_vllm.engine_id(self),
                nixl_host=nixl_host, nixl_port=nixl_port,
                block_size=block_size, fingerprint=fingerprint,
                tp_size=vllm_config.parallel_config.tensor_parallel_size, metrics=self.metrics,
                software_version=software_version())
            self.decode.start()
        if transfer.kv_role in ("kv_producer", "kv_both") and self._reads_guarded(scheduler):
            if not _vllm.bidirectional(scheduler):
                raise ValueError("kvbridge reads decode KV back: set bidirectional_kv_xfer to "
                                 "true on prefill engines (kv_producer)")
            if transfer.kv_load_failure_policy != "recompute":
                raise ValueError("kvbridge needs kv_load_failure_policy 'recompute' on prefill "
                                 "engines, so that a failed read recomputes")
            if self.settings.sync_reads and self._sync_off_by_caching():
                log.info("kvbridge_sync_reads_off", why="prefix caching with async scheduling "
                         "or pipeline parallelism, "
                         "or a KV layout whose prefix cache is not one hash per block: reads "
                         "are asynchronous, so that a failed read's blocks are never found by "
                         "another request (run prefill with --no-enable-prefix-caching for "
                         "reads within the step)")
            reads: ReadClient | None = (
                RouterClient(self.settings.router, timeout=self.settings.rpc_timeout_s,
                             retries=1, **security) if self.settings.router else client)
            assert reads is not None
            self._step_shapes = _vllm.usable(_vllm.COST)
            # kvbridge's decision alone says read or recompute, NIXL's threshold included.
            threshold = _vllm.take_recompute_threshold(scheduler)
            self.prefill = PrefillReuse(
                self.settings, reads, reader_id=_vllm.engine_id(self), block_size=block_size,
                fingerprint=fingerprint, threshold=threshold, metrics=self.metrics)
            self.prefill.warm()
        log.info("kvbridge_connector_started", role=transfer.kv_role,
                 engine_id=_vllm.engine_id(self),
                 token=security["token"] is not None, tls=security["tls"] is not None,
                 registry=self.settings.registry or None,
                 router=self.settings.router or None, block_size=block_size,
                 fingerprint=fingerprint[:12], metrics_port=self.metrics.port,
                 retention=self.decode is not None, reuse=self.prefill is not None,
                 nixl="{}:{}".format(*_vllm.side_channel(scheduler)),
                 pid=os.getpid())

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (asked by vLLM 0.33+ when sleep mode is on): a sleeping decode engine drops
        the blocks its leases name, and a woken one registers its KV cache anew, which
        kvbridge's reads (they carry no registration generation) would not notice."""
        return False

    @staticmethod
    def _guard_reads(worker: Any, guard: PinGuard,
                     report: Callable[[str, str], None]) -> PinGuard | None:
        """The worker's pin guard, installed; None where this vLLM's worker class lacks a name
        it needs (the scheduler side, deciding from the same class, then plans no reads:
        `_reads_guarded`). A live worker that lacks a name its class has would post reads
        that nothing checks while the scheduler plans them: fail closed, refuse to start."""
        if guard_worker(worker, guard, report):
            return guard
        if _vllm.usable(_vllm.PIN_GUARD):
            raise RuntimeError(
                "kvbridge: the read pin guard cannot be installed on this vLLM worker (a "
                "name its class defines is missing on the instance), and reads would go "
                "unchecked; run without kvbridge's connector on this vLLM")
        return None

    # ---- scheduler side ---------------------------------------------------------------------

    @staticmethod
    def _reads_guarded(scheduler: Any) -> bool:
        """Prefill reads only where its worker processes can check every read's pin
        (`_pin_guard`): decided here from the installed worker's names, since the workers
        are other processes."""
        return (_vllm.usable(_vllm.REUSE, {_vllm.SCHEDULER: scheduler})
                and _vllm.usable(_vllm.PIN_GUARD))

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.decode is not None:
            self.decode.bind(_vllm.block_pool(kv_cache_manager))
        if self.prefill is not None and self._prefix_caching:
            def evict(blocks: set[int]) -> None:
                _vllm.evict_cached(kv_cache_manager, blocks)
                self.metrics.read_blocks_evicted.inc(len(blocks))

            self._quarantine = Quarantine(evict)

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        if self.decode is not None:
            self.decode.on_new_request(request)
        if self.prefill is not None:
            self.prefill.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.prefill is not None:
            if self._quarantine and self._quarantine.reaches(
                    _vllm.block_hashes(request), num_computed_tokens // self._block_size()):
                # Its local hit reaches into blocks a read of this step fills: it waits until
                # the read is known to have landed (or its blocks are evicted).
                self.metrics.held_for_reads.inc()
                return None, False
            decided = self.prefill.resolve(request, num_computed_tokens)
            if decided is None:
                return None, False
            count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
            req_id = request.request_id
            if decided and not count:
                # NIXL's threshold is kvbridge's (`take_recompute_threshold`): it reads nothing
                # only when its local hit, grown since the decision (the request waited for
                # blocks), holds everything the read would have brought.
                remote = int(request.kv_transfer_params.get("remote_num_tokens") or 0)
                self.prefill.decline(request, "local_cache" if num_computed_tokens >= remote
                                     else "declined_by_engine")
            elif count and load_async and (
                    req_id in self._sync_planned  # asked again: no blocks then
                    or (decided and self._may_read_sync(request))):
                # vLLM lays a request's blocks out as [local hit | external | new]: the read
                # lands after the local hit, which must then end on a block boundary (vLLM
                # offers connectors only block-aligned hits; anything else reads async).
                if num_computed_tokens % self._block_size() == 0:
                    self._sync_planned.add(req_id)
                    self._local_tokens[req_id] = num_computed_tokens
                    self.prefill.reading_sync(req_id)
                    return count, False
                self._sync_planned.discard(req_id)
                self._local_tokens.pop(req_id, None)
                self.prefill.reading_sync(req_id, False)
            if count and load_async and self.prefill.reading(req_id):
                # Asked again later, the scheduler may settle on another local hit than at the
                # decision: the allocation's figures stand (`placed`).
                self._async_local[req_id] = num_computed_tokens
            return count, load_async
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return count, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if self.decode is not None:
            self.decode.allocated(request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        req_id = request.request_id
        async_local = self._async_local.pop(req_id, None)
        if req_id in self._sync_planned:
            self._place_sync_read(request, blocks, num_external_tokens)
        elif async_local is not None and num_external_tokens and self.prefill is not None:
            self.prefill.placed(req_id, local=async_local, reused=num_external_tokens)
        elif (num_external_tokens == 0 and self.prefill is not None
              and self.prefill.reading(req_id) and self._sync_usable()):
            # The scheduler kept a local hit that ends inside a block and reaches as far as
            # the read would: nothing to read (NIXL queued a notification only).
            _vllm.drop_pending_recv(_vllm.nixl_scheduler(self), req_id)
            self.prefill.decline(request, "local_cache")

    def _place_sync_read(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Read a synchronously read request's external tokens into exactly their blocks.
        NIXL's scheduler queued the request's unhashed blocks, right only when nothing is
        hashed at allocation: with prefix caching, all of a synchronously loading request's
        full blocks are (local hit, external and new tokens alike), and a local hit comes
        first. vLLM's layout is [local hit | external | new]: the read goes into blocks
        first..first+count-1 (first: the local hit's blocks, count: the external tokens'),
        from the remote blocks at the same places."""
        req_id = request.request_id
        local = self._local_tokens.pop(req_id, None)
        scheduler = _vllm.nixl_scheduler(self)
        if _vllm.pending_recv_blocks(scheduler, req_id) is None:
            self._sync_planned.discard(req_id)
            return
        if local is None:
            # Where the local hit ends is not known (planned, then placed twice?): a read placed
            # at a guess could land over the hit's blocks. Not read: the pin guard fails it and
            # the scheduler recomputes.
            log.error("sync_read_local_hit_unknown", request_id=req_id)
            if self.prefill is not None:
                self.prefill.spoil(req_id)
            self._hold(request, _vllm.request_block_ids(blocks), 0)
            return
        if num_external_tokens == 0:
            # The scheduler kept a local hit ending inside a block (as far as the read would
            # reach): nothing to read. NIXL's queued read goes first: its metadata is built
            # from the remote fields that declining removes.
            _vllm.drop_pending_recv(scheduler, req_id)
            self._sync_planned.discard(req_id)
            if self.prefill is not None:
                self.prefill.decline(request, "local_cache")
            return
        block_size = self._block_size()
        first = local // block_size
        count = -(-num_external_tokens // block_size)
        groups = _vllm.request_block_ids(blocks)
        if any(len(group) < first + count for group in groups):
            # vLLM allocates blocks for the local hit, the external and the new tokens.
            raise RuntimeError(f"kvbridge: request {req_id} has fewer blocks than its local "
                               f"hit ({first}) and read ({count}) need")
        params = request.kv_transfer_params
        remote = params.get("remote_block_ids")
        if (not isinstance(remote, list) or len(remote) != len(groups)
                or any(len(r) < first + count for r in remote)):
            # The lease's blocks do not reach past the local hit as the read would: do not
            # read; the pin guard fails the read and the scheduler recomputes its blocks.
            log.error("sync_read_misplaced", request_id=req_id, local_blocks=first,
                      read_blocks=count, remote_blocks=[len(r) for r in remote or []])
            if self.prefill is not None:
                self.prefill.spoil(req_id)
        else:
            # NIXL's worker aligns the remote list on the end of the local one: hand it
            # exactly the remote blocks at the read's places.
            params["remote_block_ids"] = [list(r[first:first + count]) for r in remote]
        _vllm.place_pending_recv(scheduler, req_id,
                                 [group[first:first + count] for group in groups], first)
        self._hold(request, groups, first)
        if self.prefill is not None:
            self.prefill.placed(req_id, local=local, reused=num_external_tokens)

    def _hold(self, request: Any, groups: list[list[int]], first: int) -> None:
        """With prefix caching: hold the blocks from the read's first to the request's last
        (the read's, and the new tokens' computed over them) until the step reports."""
        if self._quarantine is not None:
            self._quarantine.hold(request.request_id, groups[0][first:],
                                  _vllm.block_hashes(request)[first:])

    def _block_size(self) -> int:
        return _vllm.scheduler_block_size(_vllm.nixl_scheduler(self))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self.decode is not None:
            self.decode.drain()
            self.decode.check_watermark()
        meta = super().build_connector_meta(scheduler_output)
        if self.prefill is not None and self._step_shapes:
            self.prefill.step_scheduled(*_vllm.step_shape(scheduler_output),
                                        overlapped=self._async_scheduling)
        if self.prefill is not None:
            ends: dict[str, float] = {}
            for req_id in _vllm.reads_to_recv(meta):  # the worker posts these reads now
                end = self.prefill.read_sent(req_id)
                if end is not None:
                    ends[req_id] = end
            if ends:  # the worker checks them where it posts and where the reads land
                _vllm.attach(meta, PIN_ENDS_ATTR, PinEnds(self._boot_id, monotonic(), ends))
        if self._quarantine is not None:
            self._quarantine.scheduled()
        if self._sync_planned:
            sync = self._sync_planned & set(_vllm.reads_to_recv(meta))
            self._sync_planned -= sync
            _vllm.attach(meta, SYNC_READS_ATTR, sync)
            if self.prefill is not None:
                for req_id in sync:  # posted in this step: never to be read again
                    self.prefill.read_posted(req_id)
        return meta

    def _sync_usable(self) -> bool:
        """Whether this vLLM has every name synchronous reads use (here and in the worker
        processes); asked once (the scheduler is this connector's for good)."""
        if self._sync_names is None:
            scheduler = _vllm.nixl_scheduler(self)
            self._sync_names = _vllm.usable(_vllm.SYNC_READS, {_vllm.SCHEDULER: scheduler})
        return self._sync_names

    def _sync_off_by_caching(self) -> bool:
        """With prefix caching, reads within the step need the quarantine (`_quarantine`): a
        step's outcome in before the next is scheduled, and a prefix cache of one hash per
        block."""
        if not self._prefix_caching:
            return False
        if self._whole_block_hashes is None:
            self._whole_block_hashes = _vllm.whole_block_hashes(self)
        return (self._async_scheduling or self._overlapped_steps
                or not self._whole_block_hashes)

    def _may_read_sync(self, request: Any) -> bool:
        """Read within the step (see `_sync_reads`) when this engine already has a NIXL
        handshake with the holder and the layout is one KV cache group of equal blocks, and
        this vLLM has every name synchronous reads use (here and in the worker processes)."""
        if not self.settings.sync_reads or self._sync_off_by_caching():
            return False
        if self._prefix_caching and self._quarantine is None:
            return False  # no KV cache manager bound: nothing could evict a failed read's blocks
        if not self._sync_usable():
            return False
        scheduler = _vllm.nixl_scheduler(self)
        if _vllm.uses_host_buffer(scheduler) or len(_vllm.kv_cache_groups(self)) != 1:
            return False
        return request.kv_transfer_params.get("remote_engine_id") in self._read_from

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self.prefill is not None:
            failed = connector_output.failed_recving or set()
            results = connector_output.kv_connector_worker_meta
            pin_why = results.async_why if isinstance(results, SyncReadResults) else {}
            # The step's reads share one wait (each reports the step's figure): its longest.
            waited_ms = (max(results.ms.values(), default=0.0)
                         if isinstance(results, SyncReadResults) else 0.0)
            self.prefill.step_done(waited_ms / 1000)
            for req_id in connector_output.finished_recving or ():
                engine = self.prefill.read_done(req_id, req_id not in failed,
                                                why=pin_why.get(req_id))
                if engine and req_id not in failed:
                    self._read_from.add(engine)
            if isinstance(results, SyncReadResults):
                if self._quarantine is not None:
                    self._quarantine.reported(results.ok.items())
                for req_id, ok in results.ok.items():
                    if ok:  # counted when the request finishes
                        read_ms = results.ms.get(req_id)
                        if read_ms is not None:
                            self.prefill.read_measured(req_id, read_ms / 1000)
                        self.metrics.transfer_seconds.observe((read_ms or 0.0) / 1000)
                        copy_ms = results.layered.get(req_id)
                        self.metrics.sync_reads.labels(
                            "whole" if copy_ms is None else "layered").inc()
                        if copy_ms is not None:
                            self.metrics.layered_copy_seconds.observe(copy_ms / 1000)
                        continue
                    engine = self.prefill.read_done(req_id, False, why=results.why.get(req_id))
                    if engine:
                        self._read_from.discard(engine)  # handshake again, asynchronously

    # ---- worker side ------------------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.sync_reads is None:
            if self.pin_guard is not None:  # installed: it has the names it reads here
                self.pin_guard.update(_vllm.connector_metadata(self))
            super().start_load_kv(forward_context, **kwargs)
            return
        self.sync_reads.finish()  # a step that ended without wait_for_save (cannot happen)
        metadata = _vllm.connector_metadata(self)
        if self.pin_guard is not None:
            self.pin_guard.update(metadata)
        sync = self.sync_reads.before(metadata)
        with capturing(_vllm.nixl_worker(self), self.sync_reads.owners(metadata, sync)):
            super().start_load_kv(forward_context, **kwargs)
        self.sync_reads.after(sync)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.sync_reads is not None:
            self.sync_reads.wait_for_layer(layer_name)

    def wait_for_save(self) -> None:
        # Layered reads end before NIXL's worker is used again (one thread at a time).
        if self.sync_reads is not None:
            self.sync_reads.finish()
        super().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.sync_reads is not None:
            self.sync_reads.finish()
        return super().get_finished(finished_req_ids)  # type: ignore[no-any-return]

    def get_transfer_results(self, *args: Any, **kwargs: Any) -> Any:
        if self.sync_reads is not None:
            self.sync_reads.finish()
        return super().get_transfer_results(*args, **kwargs)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.sync_reads is not None:
            self.sync_reads.finish()
        return set(super().get_block_ids_with_load_errors())

    def build_connector_worker_meta(self) -> Any:
        if self.sync_reads is None:
            return None
        self.sync_reads.finish()
        return self.sync_reads.results()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        if self._snapshots is not None:
            self._snapshots.moved()
        self._sync_planned.discard(request.request_id)
        self._local_tokens.pop(request.request_id, None)
        self._async_local.pop(request.request_id, None)
        if self.prefill is not None:
            outcome = self.prefill.finished(request.request_id)
            if outcome and params is not None:
                params = {**params, **outcome}
        if self.decode is not None and delay:
            self.decode.request_done(request.request_id)
        if self.decode is not None and not delay:
            extra = self.decode.on_finished(request, block_ids)
            if extra:
                params = {**(params or {}), **extra}
        return delay, params

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # ---- statistics: kvbridge's figures on vLLM's /metrics (`_prom`) ---------------------

    def get_kv_connector_stats(self) -> Any:
        """Worker: NIXL's transfer statistics, wrapped; scheduler: a snapshot of kvbridge's
        metrics when one is due (vLLM merges the two and sends them to the API server)."""
        nixl = super().get_kv_connector_stats()
        if nixl is not None:
            return BridgeStats(data={_prom.NIXL: nixl.data})
        samples = self._snapshots.due() if self._snapshots is not None else None
        return None if samples is None else BridgeStats(data={_prom.KVBRIDGE: samples})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return BridgeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        nixl = super().build_prom_metrics(vllm_config, metric_types, labelnames,
                                          per_engine_labelvalues)
        return BridgeProm(nixl, labelnames, per_engine_labelvalues)

    def has_pending_block_frees(self) -> bool:
        if self.decode is not None and self.decode.make_room():
            return True
        return bool(super().has_pending_block_frees())

    def shutdown(self) -> None:
        if self.sync_reads is not None:
            self.sync_reads.close()
        if self.decode is not None:
            self.decode.close()
        if self.prefill is not None:
            self.prefill.close()
        super().shutdown()
