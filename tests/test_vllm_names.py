"""The connector's vLLM and NIXL names (`kvbridge.connector._vllm.NAMES`): each exists on the
installed release, and a missing one turns its feature off with a warning (fail closed), on
the stand-ins of tests/nixl_fakes.py and the other connector tests' fakes.

The same check runs over another release's unpacked sources:
`python -m kvbridge.connector._vllm_check /tmp/vllm033/src` (see docs/vllm-coupling.md).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvbridge.connector import _vllm
from kvbridge.connector._vllm_check import installed_names, main, scan_class, tree_names


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    _vllm.reset_warnings()
    yield
    _vllm.reset_warnings()


def feature_off(logs: list[dict[str, Any]]) -> list[str]:
    return [e["feature"] for e in logs if e["event"] == "vllm_feature_off"]


def _installed_root() -> Path:
    vllm = pytest.importorskip("vllm", reason="the engine extra is not installed")
    return Path(vllm.__file__).parent.parent


# ---- the names exist on the installed release --------------------------------------------------


@pytest.mark.parametrize("name", _vllm.NAMES, ids=lambda n: f"{n.owner.rsplit('.', 1)[-1]}."
                         f"{n.attr}")
def test_each_name_exists_on_the_installed_release(name: _vllm.Name) -> None:
    module = "nixl" if name.owner.startswith("nixl.") else "vllm"
    pytest.importorskip(module, reason=f"{module} is not installed")
    found = installed_names(name.owner)
    assert found is not None, f"{name.owner} cannot be imported"
    assert name.attr in found, f"{name.owner} has no {name.attr} (serves {name.features})"


def test_the_source_tree_check_agrees_on_the_installed_release(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The script mode (used on releases that are not installed) finds every vLLM name in the
    installed release's own files, as the import-based check does."""
    root = _installed_root()
    for name in _vllm.NAMES:
        if name.owner.startswith("vllm."):
            found = tree_names(root, name.owner)
            assert found is not None and name.attr in found, name
    assert main([str(root)]) == 0
    assert "MISSING" not in capsys.readouterr().out


def test_every_feature_has_names_and_every_name_a_feature() -> None:
    features = {value for key, value in vars(_vllm).items()
                if key.isupper() and isinstance(value, str) and key == value.upper()}
    used = {f for name in _vllm.NAMES for f in name.features}
    assert used == features
    assert len(set(_vllm.NAMES)) == len(_vllm.NAMES)  # listed once


def test_the_docs_table_lists_every_name() -> None:
    """docs/vllm-coupling.md says what each name guards: it lists every one of them."""
    docs = (Path(__file__).parent.parent / "docs" / "vllm-coupling.md").read_text()
    rows = [line for line in docs.splitlines() if line.startswith("| `")]
    for name in _vllm.NAMES:
        owner = name.owner.rsplit(".", 1)[-1]
        assert any(f"`{owner}`" in row and f"`{name.attr}`" in row
                   and all(f in row for f in name.features) for row in rows), name


# ---- the checker itself -------------------------------------------------------------------------

_SOURCE = '''
from .base import Base as Renamed

class Worker(Renamed):
    limit: int = 3
    kind = "pull"

    def __init__(self):
        self._recving = {}
        self.a, self.b = 1, 2

    def setup(self):
        self._late: int = 0

    @property
    def size(self):
        return 1
'''


def test_the_scan_sees_methods_class_and_instance_attributes() -> None:
    scan = scan_class(ast.parse(_SOURCE), "Worker")
    assert scan is not None
    assert {"limit", "kind", "__init__", "setup", "size", "_recving", "a", "b",
            "_late"} <= scan.names
    assert "_gone" not in scan.names
    assert scan.bases == ["Renamed"]
    assert scan_class(ast.parse(_SOURCE), "Other") is None


def test_a_source_tree_is_followed_through_imported_bases(tmp_path: Path) -> None:
    package = tmp_path / "vllm" / "nixl"
    package.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "base.py").write_text("class Base:\n    def __init__(self):\n"
                                     "        self._handshakes = {}\n")
    (package / "worker.py").write_text(_SOURCE)
    found = tree_names(tmp_path, "vllm.nixl.worker.Worker")
    assert found is not None and {"_handshakes", "_recving"} <= found
    assert "_gone" not in found
    assert tree_names(tmp_path, "vllm.nixl.worker.Gone") is None
    assert tree_names(tmp_path, "vllm.gone.Worker") is None


# ---- a missing name turns its feature off, with one warning --------------------------------------


def test_layered_reads_are_off_when_the_worker_lacks_a_layout_name() -> None:
    from nixl_fakes import WorkerBase

    from kvbridge.connector._layerwise import Layout

    class Worker(WorkerBase):
        nixl_wrapper: Any = None

        def _try_release_xfer_handle(self, req_id: str, handle: Any) -> bool:
            return True

    worker = Worker()
    worker.region_names = ["layer.0", "layer.1"]
    worker.num_regions = 2
    worker.num_blocks = 4
    assert Layout.of(worker) is not None  # every name there: the layout is read
    del worker._has_mamba  # renamed upstream: "no Mamba" can no longer be known
    with capture_logs() as logs:
        assert Layout.of(worker) is None
        assert Layout.of(worker) is None
    assert feature_off(logs) == [_vllm.LAYERED_READS]  # said once
    off = next(e for e in logs if e["event"] == "vllm_feature_off")
    assert off["missing"] == ["NixlPullConnectorWorker._has_mamba"]


def test_the_pin_guard_is_not_installed_when_the_worker_lacks_a_name() -> None:
    from nixl_fakes import WorkerBase

    from kvbridge.connector._pin_guard import PinGuard, guard_worker

    class Worker(WorkerBase):
        def _read_blocks_for_req(self, req_id: str, meta: Any) -> None: ...

        def get_transfer_results(self) -> Any: ...

        def _handle_failed_transfer(self, *args: Any, **kwargs: Any) -> bool:
            return True

    worker = Worker()
    worker.xfer_stats.record_kv_expired_req = lambda: None  # type: ignore[attr-defined]
    del worker._is_hma_required
    read_blocks = worker._read_blocks_for_req
    with capture_logs() as logs:
        assert guard_worker(worker, PinGuard(2.0, boot="b"), lambda *_: None) is False
    assert worker._read_blocks_for_req == read_blocks  # left as NIXL's
    assert feature_off(logs) == [_vllm.PIN_GUARD]

    whole = Worker()
    whole.xfer_stats.record_kv_expired_req = lambda: None  # type: ignore[attr-defined]
    assert guard_worker(whole, PinGuard(2.0, boot="b"), lambda *_: None) is True
    assert whole._read_blocks_for_req != whole.__class__._read_blocks_for_req


def test_requests_without_an_input_field_are_neither_read_nor_retained() -> None:
    from kvbridge.connector._settings import kv_scope

    request = SimpleNamespace(mm_features=[], prompt_embeds=None, lora_request=None,
                              cache_salt="s")
    assert kv_scope(request, "fp") == ("fp", "s")
    del request.mm_features  # renamed upstream: an image would pass for plain tokens
    with capture_logs() as logs:
        assert kv_scope(request, "fp") is None
        assert kv_scope(request, "fp") is None
    assert feature_off(logs) == [_vllm.INPUT_SCOPE]


def test_nothing_is_retained_when_the_block_pool_lacks_a_name() -> None:
    from test_connector_logic import FakeBlockPool, FakeRequest

    from kvbridge.clients import RegistryClient
    from kvbridge.connector._decode import DecodeRetention
    from kvbridge.connector._metrics import ConnectorMetrics
    from kvbridge.connector._settings import ConnectorSettings

    class OldPool(FakeBlockPool):
        touch = property()  # type: ignore[assignment]  # gone: reading it fails

    client = RegistryClient("127.0.0.1:1", timeout=0.1, retries=1)
    retention = DecodeRetention(ConnectorSettings(registry="127.0.0.1:1"), client,
                                holder_id="d", nixl_host="h", nixl_port=1, block_size=4,
                                fingerprint="fp", tp_size=1, metrics=ConnectorMetrics())
    try:
        pool = OldPool(16)
        with capture_logs() as logs:
            retention.bind(pool)
        assert feature_off(logs) == [_vllm.RETENTION]
        finished = FakeRequest("r", list(range(10)), [1, 2],
                               params={"kvbridge": {"tenant": "t", "conversation_id": "c"}},
                               status="FINISHED_STOPPED")
        assert retention.on_finished(finished, ([1, 2, 3],)) is None
        assert pool.refs([1, 2, 3]) == [0, 0, 0]
    finally:
        retention.close()


def test_decode_sees_no_shared_blocks_without_hashes_or_reference_counts() -> None:
    """Requests without vLLM's block hashes: each needs its whole prompt, though a retained
    turn holds its prefix. Blocks without reference counts: a victim counts all its blocks."""
    from conftest import ThreadedRegistry
    from test_connector_logic import BS, FakeRequest, conv_key, decode_kit

    registry = ThreadedRegistry()
    try:
        with decode_kit(registry) as kit:
            finished = FakeRequest("req-1", list(range(38)), [1, 2],
                                   params={"kvbridge": conv_key("ca")},
                                   status="FINISHED_STOPPED")
            later = FakeRequest("req-2", list(range(60)), params={"kvbridge": conv_key("ca")})
            del finished.block_hashes, later.block_hashes  # renamed upstream
            with capture_logs() as logs:
                assert kit.retention.on_finished(finished, (list(range(1, 11)),)) is not None
                kit.retention.on_new_request(later)
            assert feature_off(logs) == [_vllm.SHARED_BLOCKS]
            assert kit.pool.refs(range(1, 11)) == [1] * 10  # retained all the same
            assert kit.retention._demand["req-2"][0] == -(-60 // BS) + 1

        @dataclasses.dataclass
        class OldBlock:  # no reference count (renamed upstream)
            block_id: int

        _vllm.reset_warnings()
        with decode_kit(registry) as kit:
            kit.pool.blocks = [OldBlock(i) for i in range(len(kit.pool.blocks))]
            with capture_logs() as logs:
                kit.retention.bind(kit.pool)
            assert _vllm.SHARED_BLOCKS in feature_off(logs)
            assert kit.retention._freed_with(collections.Counter([1]), [1, 2, 2]) == 2
    finally:
        registry.close()


def _connector(scheduler: Any, prefix_caching: bool = False) -> Any:
    pytest.importorskip("vllm", reason="the engine extra is not installed")
    from kvbridge.connector._connector import KVBridgeConnector
    from kvbridge.connector._settings import ConnectorSettings

    connector = KVBridgeConnector.__new__(KVBridgeConnector)
    connector.settings = ConnectorSettings(registry="127.0.0.1:1")
    connector._prefix_caching = prefix_caching
    connector.__dict__["connector_scheduler"] = scheduler
    connector.__dict__["_kv_cache_config"] = SimpleNamespace(kv_cache_groups=[object()])
    connector._read_from = {"decode-0"}
    return connector


def test_no_synchronous_reads_when_the_scheduler_lacks_a_name() -> None:
    request = SimpleNamespace(kv_transfer_params={"remote_engine_id": "decode-0"})
    whole = SimpleNamespace(use_host_buffer=False, block_size=16, _reqs_need_recv={})
    assert _connector(whole)._may_read_sync(request) is True
    renamed = SimpleNamespace(use_host_buffer=False, block_size=16)  # no _reqs_need_recv
    with capture_logs() as logs:
        assert _connector(renamed)._may_read_sync(request) is False
    assert feature_off(logs) == [_vllm.SYNC_READS]


def test_unknown_prefix_caching_counts_as_on() -> None:
    with capture_logs() as logs:
        assert _vllm.prefix_caching(SimpleNamespace()) is True
    assert feature_off(logs) == [_vllm.SYNC_READS]
    assert _vllm.prefix_caching(SimpleNamespace(enable_prefix_caching=False)) is False


def test_no_reuse_when_the_installed_worker_lacks_a_pin_guard_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler decides for worker processes it cannot see: from the installed class."""
    pytest.importorskip("vllm", reason="the engine extra is not installed")
    from kvbridge.connector._connector import KVBridgeConnector

    scheduler = SimpleNamespace(is_bidirectional_kv_xfer_enabled=True, kv_recompute_threshold=64)
    assert KVBridgeConnector._reads_guarded(scheduler) is True
    gone = _vllm.Name(_vllm.WORKER, "_kvbridge_renamed_upstream", (_vllm.PIN_GUARD,))
    monkeypatch.setattr(_vllm, "NAMES", (*_vllm.NAMES, gone))
    with capture_logs() as logs:
        assert KVBridgeConnector._reads_guarded(scheduler) is False
    assert feature_off(logs) == [_vllm.PIN_GUARD]
    del scheduler.kv_recompute_threshold
    monkeypatch.setattr(_vllm, "NAMES", tuple(n for n in _vllm.NAMES if n != gone))
    with capture_logs() as logs:
        assert KVBridgeConnector._reads_guarded(scheduler) is False
    assert feature_off(logs) == [_vllm.REUSE]


def test_a_connector_without_nixls_halves_refuses_to_start() -> None:
    from kvbridge.connector._version import UnsupportedVllmVersion

    _vllm.require_core(SimpleNamespace(connector_scheduler=None, connector_worker=None,
                                       engine_id="e"))
    with pytest.raises(UnsupportedVllmVersion, match="engine_id"):
        _vllm.require_core(SimpleNamespace(connector_scheduler=None, connector_worker=None))


def test_names_are_frozen_records() -> None:
    name = _vllm.NAMES[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        name.attr = "other"  # type: ignore[misc]


# ---- the releases the connector loads on ---------------------------------------------------------


@pytest.mark.parametrize(("version", "ok"), [("0.32.0", True), ("0.32.5+cpu", True),
                                              ("0.33.0", True), ("0.31.2", False),
                                              ("0.34.0", False), ("dev", False)])
def test_the_connector_loads_on_the_checked_minors_only(monkeypatch: pytest.MonkeyPatch,
                                                        version: str, ok: bool) -> None:
    vllm = pytest.importorskip("vllm", reason="the engine extra is not installed")
    from kvbridge.connector._version import UnsupportedVllmVersion, check_vllm_version

    monkeypatch.setattr(vllm, "__version__", version)
    if ok:
        assert check_vllm_version() == version
    else:
        with pytest.raises(UnsupportedVllmVersion, match=r"0\.32\.x, 0\.33\.x"):
            check_vllm_version()


def test_sleep_mode_is_refused() -> None:
    """vLLM 0.33 asks before it lets an engine sleep; kvbridge's leases would not survive it."""
    pytest.importorskip("vllm", reason="the engine extra is not installed")
    from kvbridge.connector._connector import KVBridgeConnector

    assert KVBridgeConnector.supports_sleep_mode(SimpleNamespace()) is False


def test_a_worker_that_cannot_take_the_pin_guard_its_class_allows_refuses_to_start() -> None:
    """The scheduler plans reads from the installed worker class; a live worker lacking a
    name that class has would post those reads unchecked: the worker refuses to start. Where
    the class itself lacks the name, the worker runs without the guard (no reads planned)."""
    pytest.importorskip("vllm", reason="the engine extra is not installed")
    from nixl_fakes import WorkerBase

    from kvbridge.connector._connector import KVBridgeConnector
    from kvbridge.connector._pin_guard import PinGuard

    class Worker(WorkerBase):
        def _read_blocks_for_req(self, req_id: str, meta: Any) -> None: ...

        def get_transfer_results(self) -> Any: ...

        def _handle_failed_transfer(self, *args: Any, **kwargs: Any) -> bool:
            return True

    whole = Worker()
    whole.xfer_stats.record_kv_expired_req = lambda: None  # type: ignore[attr-defined]
    guard = PinGuard(2.0, boot="b")
    assert KVBridgeConnector._guard_reads(whole, guard, lambda *_: None) is guard
    lacking = Worker()
    lacking.xfer_stats.record_kv_expired_req = lambda: None  # type: ignore[attr-defined]
    del lacking._is_hma_required
    with pytest.raises(RuntimeError, match="unchecked"):
        KVBridgeConnector._guard_reads(lacking, PinGuard(2.0, boot="b"), lambda *_: None)


def test_kvbridge_takes_nixls_recompute_threshold_over() -> None:
    """One rule decides read or recompute: kvbridge's (the threshold until the costs are
    measured). NIXL's own check, left on, refused reads the measured costs chose: below its
    threshold, the installed NIXL scheduler brings nothing; with the check taken over, it
    brings what kvbridge's decision named."""
    pytest.importorskip("vllm", reason="the engine extra is not installed")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )

    scheduler = SimpleNamespace(kv_recompute_threshold=64)
    request = SimpleNamespace(request_id="r-1", num_prompt_tokens=300,
                              prompt_token_ids=list(range(300)), kv_transfer_params={
                                  "do_remote_decode": True, "remote_block_ids": [[7, 8]],
                                  "remote_engine_id": "decode-0", "remote_request_id": "x",
                                  "remote_host": "127.0.0.1", "remote_port": 5600,
                                  "remote_num_tokens": 240})
    matched = NixlPullConnectorScheduler.get_num_new_matched_tokens
    assert matched(scheduler, request, 200) == (0, False)  # 40 tokens: below 64
    assert _vllm.take_recompute_threshold(scheduler) == 64
    assert scheduler.kv_recompute_threshold == 0
    assert matched(scheduler, request, 200) == (40, True)
    assert matched(scheduler, request, 240) == (0, False)  # nothing left past the local hit
