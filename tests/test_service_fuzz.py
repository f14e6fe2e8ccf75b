"""Random RPC sequences against a real registry server over gRPC (hypothesis, stateful): valid
calls mixed with malformed, oversized and out-of-order ones (garbage bytes, a message over the
size limit, heartbeats before registering, reads of unknown conversations, releases of unknown
pins, revokes by the wrong holder, grants whose blocks and hashes disagree).

After every step: the server still answers; every error is a canonical gRPC code, and every
error the registry itself raises carries an ErrorInfo reason; a conversation's reads hit only
its newest lease; a pinned lease is never reported reclaimable; the active leases the server
lists are exactly those the model expects.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from conftest import ThreadedRegistry
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvbridge import blockhash
from kvbridge._grpc_status import error_info
from kvbridge.clients import duration
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.registry.v1 import registry_pb2_grpc as pb_grpc

BS = 4
FP = "fp-fuzz"
MAX_MESSAGE = 64 * 1024
SERVICE = "/kvbridge.registry.v1.RegistryService/"
# What the registry raises itself, each with an ErrorInfo; gRPC adds RESOURCE_EXHAUSTED for a
# message over the limit and INTERNAL for bytes that are not the request message at all.
DOMAIN_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.UNAUTHENTICATED}
TRANSPORT_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL}
# The registry runs with authentication: the model's own calls are an admin's; intruders hold
# no token, an unknown one, another holder's or another tenant's.
ADMIN = "fuzz-admin-token-0123456789"
INTRUDERS = {
    "none": None,
    "unknown": "fuzz-unknown-token-0123456789",
    "other holder": "fuzz-holder-token-0123456789",
    "other tenant": "fuzz-tenant-token-0123456789",
}
TOKENS = (f"{ADMIN} admin; {INTRUDERS['other holder']} holder holder=intruder; "
          f"{INTRUDERS['other tenant']} tenant tenants=intruder")
METHODS = ("RegisterHolder", "HeartbeatHolder", "GrantLease", "RenewLeases", "RevokeLease",
           "GetLease", "ListLeases", "AcquireRead", "PinLease", "ReleaseRead",
           "DeregisterHolder", "ListHolders")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ThreadedRegistry, grpc.Channel]]:
    # No listing rate: on this registry's fake clock its buckets never refill, so the limit
    # would depend on how many listings earlier examples made (it has tests of its own).
    registry = ThreadedRegistry(max_message_bytes=MAX_MESSAGE, auth_tokens=TOKENS,
                                list_rate_per_principal=0.0)
    channel = grpc.insecure_channel(registry.target, options=[
        ("grpc.max_send_message_length", 4 * MAX_MESSAGE)])
    yield registry, channel
    channel.close()
    registry.close()


@dataclass
class Lease:
    lease_id: str
    holder: str
    conversation: str
    tokens: list[int]
    pins: set[str] = field(default_factory=set)


class RegistryOverGrpc(RuleBasedStateMachine):
    served: tuple[ThreadedRegistry, grpc.Channel]

    def __init__(self) -> None:
        super().__init__()
        _, channel = self.served
        self.channel = channel
        self.stub = _WithToken(pb_grpc.RegistryServiceStub(channel), ADMIN)
        run = uuid.uuid4().hex[:8]  # one tenant and holder ids per example: no shared state
        self.tenant = f"t-{run}"
        self.holders = [f"h{i}-{run}" for i in range(2)]
        self.registered: set[str] = set()
        self.active: dict[str, Lease] = {}  # conversation -> its newest live lease
        self.dead: dict[str, Lease] = {}  # lease id -> superseded or revoked
        self.pins: dict[str, Lease] = {}  # live pin id -> lease

    # ---- helpers ---------------------------------------------------------------------------

    def call(self, method: str, request: Any) -> Any:
        """Call and check the error, if any; returns the response or the error's code."""
        try:
            return getattr(self.stub, method)(request, timeout=10)
        except grpc.RpcError as err:
            return self.check_error(err, registry_raised=True)

    def check_error(self, err: grpc.RpcError, *, registry_raised: bool) -> grpc.StatusCode:
        code = err.code()
        info = error_info(err)
        if info is not None:
            assert code in DOMAIN_CODES, (code, err.details())
            assert info.domain == "kvbridge.dev" and info.reason, info
        else:
            assert code in TRANSPORT_CODES, (code, err.details())
            assert not registry_raised or code is grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"{code}: {err.details()} carries no ErrorInfo")
        return code

    @staticmethod
    def hashes(tokens: list[int], partial: bool = True) -> bytes:
        return blockhash.block_hashes(tokens, BS, FP, include_partial=partial)

    # ---- rules: valid traffic --------------------------------------------------------------

    @initialize()
    def register_first(self) -> None:
        self.register(self.holders[0])

    @rule(h=st.integers(0, 1))
    def register_holder(self, h: int) -> None:
        self.register(self.holders[h])

    def register(self, holder: str) -> None:
        resp = self.call("RegisterHolder", pb.RegisterHolderRequest(
            holder_id=holder, nixl_host="127.0.0.1", nixl_port=5600, block_size=BS,
            engine_fingerprint=FP, tp_size=1, ttl=duration(300)))
        assert isinstance(resp, pb.RegisterHolderResponse), resp
        if holder in self.registered:  # a re-registration sends nothing held: leases go
            for conv, lease in list(self.active.items()):
                if lease.holder == holder:
                    self.dead[lease.lease_id] = self.active.pop(conv)
        self.registered.add(holder)

    @rule(h=st.integers(0, 1), conv=st.sampled_from(["a", "b", "c"]),
          more=st.integers(1, 9))
    def grant(self, h: int, conv: str, more: int) -> None:
        holder = self.holders[h]
        previous = self.active.get(conv)
        start = 100 * (ord(conv[0]) - 96)
        tokens = (previous.tokens if previous else []) + list(range(start, start + more))
        n = -(-len(tokens) // BS)
        resp = self.call("GrantLease", pb.GrantLeaseRequest(
            holder_id=holder, tenant=self.tenant, conversation_id=conv,
            remote_request_id=f"r-{uuid.uuid4().hex[:6]}", block_ids=list(range(1, n + 1)),
            token_count=len(tokens), block_hashes=self.hashes(tokens),
            idle_ttl=duration(600), max_lifetime=duration(3600)))
        if holder not in self.registered:
            assert resp == grpc.StatusCode.NOT_FOUND
            return
        assert isinstance(resp, pb.GrantLeaseResponse), resp
        if previous is not None:
            assert resp.superseded_lease_id == previous.lease_id
            self.dead[previous.lease_id] = previous
        self.active[conv] = Lease(resp.lease.lease_id, holder, conv, tokens)

    @rule(conv=st.sampled_from(["a", "b", "c", "never"]), edit=st.booleans(),
          whole=st.booleans())
    def read(self, conv: str, edit: bool, whole: bool) -> None:
        lease = self.active.get(conv)
        if whole:
            resp = self.call("PinLease", pb.PinLeaseRequest(
                tenant=self.tenant, conversation_id=conv, pin_ttl=duration(60)))
            read = resp.read
        else:
            tokens = list(lease.tokens) if lease else [1, 2, 3, 4, 5]
            if edit:
                tokens[0] += 1000
            resp = self.call("AcquireRead", pb.AcquireReadRequest(
                tenant=self.tenant, conversation_id=conv, min_tokens=1,
                block_hashes=self.hashes(tokens, partial=False), pin_ttl=duration(60)))
            read = resp
        if lease is None:  # never granted, or its last lease is revoked
            assert read.miss_reason in (pb.MISS_REASON_NO_LEASE, pb.MISS_REASON_REVOKED), read
            assert not read.pin.pin_id
            return
        # An edited first block misses, unless the lease has no full block to compare (its
        # partial block is offered for the reader to check). A whole-lease pin always hits.
        if not whole and edit and len(lease.tokens) >= BS:
            assert read.miss_reason == pb.MISS_REASON_HASH_MISMATCH and not read.pin.pin_id
            return
        assert read.pin.pin_id, read
        assert read.lease.lease_id == lease.lease_id  # only the newest lease is read
        lease.pins.add(read.pin.pin_id)
        self.pins[read.pin.pin_id] = lease

    @rule(data=st.data())
    def release(self, data: Any) -> None:
        if not self.pins:
            return
        pin = data.draw(st.sampled_from(sorted(self.pins)))
        resp = self.call("ReleaseRead", pb.ReleaseReadRequest(pin_id=pin))
        assert resp.released
        self.pins.pop(pin).pins.discard(pin)

    @rule(conv=st.sampled_from(["a", "b", "c"]), own=st.booleans())
    def revoke(self, conv: str, own: bool) -> None:
        lease = self.active.get(conv)
        if lease is None:
            return
        other = next(h for h in self.holders if h != lease.holder)
        resp = self.call("RevokeLease", pb.RevokeLeaseRequest(
            lease_id=lease.lease_id, holder_id=lease.holder if own else other))
        if not own:
            assert resp == grpc.StatusCode.PERMISSION_DENIED
            return
        assert resp.reclaimable == (not lease.pins)
        self.dead[lease.lease_id] = self.active.pop(conv)

    @rule(h=st.integers(0, 1))
    def heartbeat(self, h: int) -> None:
        holder = self.holders[h]
        resp = self.call("HeartbeatHolder", pb.HeartbeatHolderRequest(holder_id=holder))
        if holder not in self.registered:
            assert resp == grpc.StatusCode.NOT_FOUND  # out of order: before registering
            return
        for lease_id in resp.reclaimable_lease_ids:
            lease = self.dead.get(lease_id)
            assert lease is not None, f"live lease {lease_id} reported reclaimable"
            assert not lease.pins, f"pinned lease {lease_id} reported reclaimable"

    # ---- rules: bad input ------------------------------------------------------------------

    @rule(method=st.sampled_from(METHODS), junk=st.binary(min_size=1, max_size=64))
    def garbage(self, method: str, junk: bytes) -> None:
        raw = self.channel.unary_unary(SERVICE + method, request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
        try:
            raw(junk, timeout=10, metadata=_md(ADMIN))
        except grpc.RpcError as err:
            self.check_error(err, registry_raised=False)

    @rule(method=st.sampled_from(METHODS))
    def oversized(self, method: str) -> None:
        raw = self.channel.unary_unary(SERVICE + method, request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
        big = pb.ListLeasesRequest(tenant="x" * (MAX_MESSAGE + 1)).SerializeToString()
        with pytest.raises(grpc.RpcError) as raised:
            raw(big, timeout=10, metadata=_md(ADMIN))
        assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

    @rule(h=st.integers(0, 1), extra=st.integers(-1, 1), bad_hash=st.booleans())
    def grant_that_disagrees(self, h: int, extra: int, bad_hash: bool) -> None:
        tokens = list(range(10))
        hashes = self.hashes(tokens)
        resp = self.call("GrantLease", pb.GrantLeaseRequest(
            holder_id=self.holders[h], tenant=self.tenant, conversation_id="bad",
            remote_request_id="r-bad", block_ids=list(range(1, 4 + extra)),
            token_count=len(tokens), block_hashes=hashes[:-3] if bad_hash else hashes,
            idle_ttl=duration(600)))
        if extra == 0 and not bad_hash:
            if self.holders[h] in self.registered:  # that one was valid after all
                assert isinstance(resp, pb.GrantLeaseResponse)
                previous = self.active.get("bad")
                if previous is not None:
                    self.dead[previous.lease_id] = previous
                self.active["bad"] = Lease(resp.lease.lease_id, self.holders[h], "bad", tokens)
            return
        assert resp in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), resp

    @rule(which=st.sampled_from(["release", "revoke", "get", "renew"]))
    def unknown_ids(self, which: str) -> None:
        ghost = "l-" + os.urandom(8).hex()
        if which == "release":
            assert not self.call("ReleaseRead",
                                 pb.ReleaseReadRequest(pin_id="p-" + ghost[2:])).released
        elif which == "revoke":
            assert self.call("RevokeLease", pb.RevokeLeaseRequest(lease_id=ghost)) == (
                grpc.StatusCode.NOT_FOUND)
        elif which == "get":
            assert self.call("GetLease", pb.GetLeaseRequest(lease_id=ghost)) == (
                grpc.StatusCode.NOT_FOUND)
        else:
            resp = self.call("RenewLeases", pb.RenewLeasesRequest(lease_ids=[ghost]))
            assert resp.renewed_count == 0

    @rule(who=st.sampled_from(sorted(INTRUDERS)), method=st.sampled_from(METHODS),
          conv=st.sampled_from(["a", "b", "c"]))
    def intruder(self, who: str, method: str, conv: str) -> None:
        """A caller without the right credentials reaches for this tenant's conversations and
        holders: refused (UNAUTHENTICATED / PERMISSION_DENIED), or, for a listing, shown
        nothing; the invariant below then checks that nothing changed."""
        lease = self.active.get(conv)
        lease_id = lease.lease_id if lease is not None else "l-" + os.urandom(8).hex()
        holder = lease.holder if lease is not None else self.holders[0]
        tokens = lease.tokens if lease is not None else list(range(8))
        request = {
            "RegisterHolder": pb.RegisterHolderRequest(
                holder_id=holder, nixl_host="127.0.0.1", nixl_port=5600, block_size=BS,
                engine_fingerprint=FP, tp_size=1, ttl=duration(300)),
            "HeartbeatHolder": pb.HeartbeatHolderRequest(holder_id=holder),
            "GrantLease": pb.GrantLeaseRequest(
                holder_id=holder, tenant=self.tenant, conversation_id=conv,
                remote_request_id="r-intruder", block_ids=[1, 2], token_count=8,
                block_hashes=self.hashes(list(range(8)))),
            "RenewLeases": pb.RenewLeasesRequest(lease_ids=[lease_id]),
            "RevokeLease": pb.RevokeLeaseRequest(lease_id=lease_id),
            "GetLease": pb.GetLeaseRequest(lease_id=lease_id),
            "ListLeases": pb.ListLeasesRequest(tenant=self.tenant),
            "AcquireRead": pb.AcquireReadRequest(
                tenant=self.tenant, conversation_id=conv,
                block_hashes=self.hashes(tokens, partial=False)),
            "PinLease": pb.PinLeaseRequest(tenant=self.tenant, conversation_id=conv),
            "ReleaseRead": pb.ReleaseReadRequest(pin_id=next(iter(self.pins), "p-none")),
            "DeregisterHolder": pb.DeregisterHolderRequest(holder_id=holder),
            "ListHolders": pb.ListHoldersRequest(),
        }[method]
        token = INTRUDERS[who]
        try:
            reply = getattr(self.stub.raw, method)(request, timeout=10, metadata=_md(token))
        except grpc.RpcError as err:
            code = self.check_error(err, registry_raised=True)
            expected = {grpc.StatusCode.UNAUTHENTICATED} if who in ("none", "unknown") else {
                grpc.StatusCode.PERMISSION_DENIED}
            if lease is None and method in ("RevokeLease", "GetLease"):
                expected.add(grpc.StatusCode.NOT_FOUND)  # no such lease: nothing to protect
            assert code in expected, (who, method, code, err.details())
            return
        # Let in: a holder's listing, scoped to its own holder, which holds nothing here; a
        # renewal of a lease id that does not exist, which renews nothing.
        if method == "RenewLeases":
            assert lease is None and reply.renewed_count == 0, (who, reply)
            return
        assert (who, method) == ("other holder", "ListLeases"), (who, method, reply)
        assert not reply.leases

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def server_answers_and_lists_what_the_model_expects(self) -> None:
        assert self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).version
        listed = self.stub.ListLeases(pb.ListLeasesRequest(tenant=self.tenant), timeout=10)
        assert {x.lease_id for x in listed.leases} == {
            lease.lease_id for lease in self.active.values()}


def _md(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


class _WithToken:
    """A stub whose calls carry a token (`raw` is the stub itself, for other credentials)."""

    def __init__(self, stub: Any, token: str) -> None:
        self.raw, self._md = stub, _md(token)

    def __getattr__(self, method: str) -> Any:
        call = getattr(self.raw, method)
        return lambda request, **kw: call(request, metadata=self._md, **kw)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_random_rpc_sequences(served: tuple[ThreadedRegistry, grpc.Channel]) -> None:
    RegistryOverGrpc.served = served
    machine = RegistryOverGrpc.TestCase
    machine.settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                                suppress_health_check=list(HealthCheck))
    machine().runTest()


@pytest.mark.parametrize("method", ["AcquireRead", "GrantLease", "WatchLeases"])
def test_unparseable_request_is_invalid_argument(
        served: tuple[ThreadedRegistry, grpc.Channel], method: str) -> None:
    _, channel = served
    if method == "WatchLeases":
        call: Any = channel.unary_stream(SERVICE + method, request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)
    else:
        call = channel.unary_unary(SERVICE + method, request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as raised:
        reply = call(b"\xff\xff\xff", timeout=10, metadata=_md(ADMIN))
        if method == "WatchLeases":
            next(iter(reply))
    err = raised.value
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    info = error_info(err)
    assert info is not None and info.reason == "INVALID_ARGUMENT"
    assert info.metadata["field"] == "request"
    assert f"not a valid kvbridge.registry.v1.{method}Request" in err.details()


def test_unauthenticated_garbage_is_refused_before_it_is_parsed(
        served: tuple[ThreadedRegistry, grpc.Channel]) -> None:
    _, channel = served
    call = channel.unary_unary(SERVICE + "GrantLease", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as raised:
        call(b"\xff\xff\xff", timeout=10)
    assert raised.value.code() is grpc.StatusCode.UNAUTHENTICATED
