"""The compiled AcquireRead hit path (`_fastread.FastReader`) against the Python path it
speeds up (`LeaseTable.acquire_read` + `RegistryServicer._read_response`).

Two tables go through the same random operations on one fake clock: every read is answered
on table A by the compiled path first (the Python path only where it returns None) and on
table B by the Python path alone. The replies must be the same bytes, errors the same error,
and the two tables the same state after every step. Then the wiring: a real server uses the
path per `compiled_reads`, and counts its hits.

The compiled module is built by the dev install (`pip install -e .[dev]`, a C compiler is
needed); without it these tests fail on the import, on purpose: CI must test what it ships.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import ExitStack
from typing import Any
from unittest import mock

import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbridge import _grpc_handlers, blockhash
from kvbridge.auth import Authenticator, TokenTable
from kvbridge.clients import AsyncRegistryClient
from kvbridge.clock import FakeClock, SystemClock, monotonic
from kvbridge.errors import KvbridgeError
from kvbridge.registry.v1 import registry_pb2 as pb
from kvbridge.services.registry import (
    GrantSpec,
    HolderSpec,
    LeaseTable,
    MemoryStore,
    RegistryConfig,
    _access,
    _core,
    _fastread,
    _server,
)
from kvbridge.services.registry._expiry import ExpiryWheel
from kvbridge.services.registry._metrics import LoopHistogram, RegistryMetrics
from kvbridge.services.registry._servicer import RegistryServicer

FP = "fp-fast"
HOLDERS = {"h4": 4, "h16": 16}  # holder id -> block size
CONVS = (("t0", "c0"), ("t0", "c1"), ("t1", "c0"))
CONFIG = RegistryConfig(
    default_idle_ttl_s=6.0, min_idle_ttl_s=1.0, max_idle_ttl_s=20.0,
    default_max_lifetime_s=10.0, max_lifetime_cap_s=1000.0,
    default_pin_ttl_s=2.0, max_pin_ttl_s=4.0,
    default_holder_ttl_s=5.0, min_holder_ttl_s=1.0, max_holder_ttl_s=30.0,
    max_blocks_per_lease=8, max_id_length=12,
)
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=36)
IDS = st.sampled_from(["", "", "", "r1", "r2", "r3"])
# At most one thing wrong with a read, mostly nothing: each refused by the checks.
BAD = st.sampled_from([None] * 18 + ["reader", "request", "tenant", "ttl", "odd", "many"])


def hashes(tokens: list[int], block_size: int, partial: bool = False) -> bytes:
    return blockhash.block_hashes(tokens, block_size, FP, include_partial=partial)


class Pair:
    """Table A (compiled path first) and table B (Python path), in step."""

    def __init__(self, clock: FakeClock, config: RegistryConfig = CONFIG,
                 clock_b: FakeClock | None = None) -> None:
        self.clock = clock
        self.a = LeaseTable(config, clock, recovering=False)
        self.b = LeaseTable(config, clock_b or clock, recovering=False)
        self.b._pin_id = self.a._pin_id  # the same keyed pin ids (a secret per table)
        fast = self.a.fast_reader()
        assert fast is not None
        self.fast = fast
        self.servicers = [RegistryServicer(MemoryStore(t), RegistryMetrics(MemoryStore(t)))
                          for t in (self.a, self.b)]
        self.fast_hits = 0
        # Random ids (leases without a request id, pins without one) count up instead, one
        # count per table, so that the two tables make the same ids.
        self.side = 0
        self._counts = [itertools.count(), itertools.count()]

    def token_hex(self, n: int) -> str:
        return f"{next(self._counts[self.side]):0{2 * n}x}"

    def deterministic_ids(self) -> ExitStack:
        stack = ExitStack()
        stack.enter_context(mock.patch.object(_core.secrets, "token_hex", self.token_hex))
        stack.enter_context(mock.patch.object(_fastread, "token_hex", self.token_hex))
        return stack

    def both(self, op: str, *args: Any) -> Any:
        """Run one table operation on both; the same result or the same error."""
        out = []
        for side, table in enumerate((self.a, self.b)):
            self.side = side
            try:
                out.append(("ok", getattr(table, op)(*args)))
            except KvbridgeError as err:
                out.append(("error", (type(err), err.reason, err.message)))
        if out[0][0] == "error" or out[1][0] == "error":
            assert out[0] == out[1], op
        return out[1][1]

    def read(self, *args: Any) -> Any:
        """The same read on both; B's reply (bytes) or error."""
        return self._read(lambda: self.fast.hit(*args), args)

    def read_raw(self, raw: bytes) -> Any:
        """A serialized request: A's compiled path reads it (`hit_raw`), else the Python path
        takes what protobuf parses (bytes it cannot parse must not be answered here)."""
        try:
            request = pb.AcquireReadRequest.FromString(raw)
        except DecodeError:
            before = state(self.a)
            assert self.fast.hit_raw(raw) is None, raw
            assert state(self.a) == before
            return None
        ttl = request.pin_ttl
        # As the servicer reads it: a negative part is refused (the table refuses < 0 alike).
        pin_ttl = -1.0 if ttl.seconds < 0 or ttl.nanos < 0 else ttl.seconds + ttl.nanos * 1e-9
        args = (request.tenant, request.conversation_id, request.block_hashes,
                request.min_tokens, pin_ttl, request.reader_id, request.request_id)
        return self._read(lambda: self.fast.hit_raw(raw), args)

    def _read(self, fast: Any, args: tuple[Any, ...]) -> Any:
        replies = []
        self.side = 0
        clock_before = self.clock._now  # a miss read the clock: A's Python path reads it anew
        reply = fast()
        if reply is not None:
            self.fast_hits += 1
            replies.append(("ok", reply))
        else:
            self.clock._now = clock_before
            replies.append(self._python_read(0, args))
        replies.append(self._python_read(1, args))
        assert replies[0] == replies[1], (args, [
            pb.AcquireReadResponse.FromString(r) if kind == "ok" else r for kind, r in replies])
        return replies[1][1]

    def _python_read(self, side: int, args: tuple[Any, ...]) -> tuple[str, Any]:
        table = (self.a, self.b)[side]
        self.side = side
        try:
            read = table.acquire_read(*args)
        except KvbridgeError as err:
            return "error", (type(err), err.reason, err.message)
        out = self.servicers[side]._read_response(read, pb.AcquireReadResponse())
        return "ok", out.SerializeToString()

    def check_same_state(self) -> None:
        assert state(self.a) == state(self.b)


def state(table: LeaseTable) -> dict[str, Any]:
    return {
        "leases": {i: (x.state, x.expire_at, x.pin_count, x.epoch, x.payload)
                   for i, x in table._leases.items()},
        "pins": {i: (p.lease.lease_id, p.expire_at) for i, p in table._pins.items()},
        "pin_expiry": (len(table._pin_expiry), sorted(table._pin_expiry._order),
                       {k: [p.pin_id for p in b] for k, b in table._pin_expiry._buckets.items()}),
        "holders": {i: (h.state, h.expire_at) for i, h in table._holders.items()},
        "counts": table.counts(),
    }


GRANT = st.tuples(st.just("grant"), st.sampled_from(sorted(HOLDERS)), st.sampled_from(CONVS),
                  TOKENS, st.sampled_from([0.0, 1.0, 3.0]), st.sampled_from([0.0, 8.0, 30.0]))
READ = st.tuples(st.just("read"), st.sampled_from(CONVS), TOKENS, st.booleans(),
                 st.sampled_from([0, 0, 1, 5, 12, 48]), st.sampled_from([0.0, 0.0, 0.5, 3.0, 9.0]),
                 IDS, IDS, st.sampled_from(["none", "none", "none", "cut", "flip"]), BAD,
                 st.booleans())
OPS = st.one_of(
    READ,
    st.tuples(st.just("advance"), st.sampled_from([0.25, 1.0, 2.5, 6.0])),
    st.tuples(st.just("register"), st.sampled_from(sorted(HOLDERS))),
    st.tuples(st.just("release"), st.integers(0, 1000)),
    st.tuples(st.just("heartbeat"), st.sampled_from(sorted(HOLDERS))),
    st.tuples(st.just("revoke"), st.sampled_from(CONVS)),
    st.tuples(st.just("deregister"), st.sampled_from(sorted(HOLDERS))),
    st.tuples(st.just("tick")),
)


def request_bytes(tenant: str, conversation_id: str, hashes: bytes, min_tokens: int,
                  pin_ttl: float, reader_id: str, request_id: str) -> bytes:
    whole = int(pin_ttl)
    return pb.AcquireReadRequest(
        tenant=tenant, conversation_id=conversation_id, block_hashes=hashes,
        min_tokens=min_tokens, pin_ttl=Duration(seconds=whole,
                                                nanos=round((pin_ttl - whole) * 1e9)),
        reader_id=reader_id, request_id=request_id).SerializeToString()


def holder_spec(holder_id: str) -> HolderSpec:
    return HolderSpec(holder_id, "10.0.0.9", 5600, 2, HOLDERS[holder_id], FP, 0.0, "v1")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(GRANT | st.just(("skip",)), OPS, READ), min_size=2, max_size=30))
def test_compiled_and_python_reads_give_the_same_replies_and_state(
        steps: list[tuple[tuple, ...]]) -> None:
    """Each step: a grant (or not), an operation (a read, time passing, a holder's heartbeat,
    drain or return, a release, a revoke, an expiry tick), then a read."""
    clock = FakeClock()
    pair = Pair(clock)
    with pair.deterministic_ids():
        for holder_id in HOLDERS:
            pair.both("register_holder", holder_spec(holder_id))
        prompts: dict[tuple[str, str], tuple[list[int], int]] = {}
        for op in itertools.chain.from_iterable(steps):
            kind = op[0]
            if kind == "grant":
                _, holder_id, conv, tokens, idle, lifetime = op
                bs = HOLDERS[holder_id]
                n = -(-len(tokens) // bs)
                spec = GrantSpec(holder_id, conv[0], conv[1], f"req-{len(tokens)}",
                                 [7 + 300 * i for i in range(n)], len(tokens),
                                 hashes(tokens, bs, partial=True), idle, lifetime)
                if pair.both("grant", spec) is not None:
                    prompts[conv] = (tokens, bs)
            elif kind == "read":
                (_, conv, tokens, extend, min_tokens, pin_ttl, reader, request, damage, bad,
                 raw) = op
                if conv in prompts and extend:  # the next turn: the lease's prompt and more
                    tokens = prompts[conv][0] + tokens
                bs = prompts[conv][1] if conv in prompts else 4
                h = hashes(tokens, bs)
                if damage == "cut":  # a shorter prompt
                    h = h[: len(h) // 32 * 16]
                elif damage == "flip" and h:  # its last block differs
                    h = h[:-1] + bytes([h[-1] ^ 1])
                tenant = conv[0]
                if bad == "reader":
                    reader = "bad id"
                elif bad == "request":
                    request = "x" * 13  # longer than max_id_length
                elif bad == "tenant":
                    tenant = "é"
                elif bad == "ttl":
                    pin_ttl = -1.0
                elif bad == "odd":
                    h += b"\x00"
                elif bad == "many":
                    h = bytes(16 * (CONFIG.max_blocks_per_lease * 4 + 1))
                if raw:  # as the server gets it: the compiled path reads the bytes
                    pair.read_raw(request_bytes(tenant, conv[1], h, min_tokens, pin_ttl,
                                                reader, request))
                else:
                    pair.read(tenant, conv[1], h, min_tokens, pin_ttl, reader, request)
            elif kind == "advance":
                clock.advance(op[1])
            elif kind == "release":
                pins = sorted(pair.b._pins)
                pin_id = pins[op[1] % len(pins)] if pins else "p-none"
                pair.both("release_read", pin_id)
            elif kind == "register":  # back after a loss or a drain, or again
                pair.both("register_holder", holder_spec(op[1]))
            elif kind == "heartbeat":
                pair.both("heartbeat", op[1], ())
            elif kind == "revoke":
                lease = pair.b._conversations.get(op[1][0], {}).get(op[1][1])
                pair.both("revoke", lease.lease_id if lease else "l-none", "", "test")
            elif kind == "deregister":
                pair.both("deregister_holder", op[1])
            elif kind == "tick":
                assert pair.a.tick() == pair.b.tick()
            pair.check_same_state()
        event(f"compiled hits: {min(pair.fast_hits, 3)}+")


def test_a_plain_hit_takes_the_compiled_path() -> None:
    """The equivalence above means nothing if the compiled path never answers: a hit of
    every shape (whole blocks, a partial block, a request id) comes back as bytes."""
    clock = FakeClock()
    pair = Pair(clock)
    pair.both("register_holder", HolderSpec("h4", "10.0.0.9", 5600, 2, 4, FP))
    tokens = list(range(10))  # 2 full blocks and a partial one of 2 tokens
    pair.both("grant", GrantSpec("h4", "t0", "c0", "req", [5, 0, 70000], 10,
                                 hashes(tokens, 4, partial=True)))
    cases = [(hashes(tokens, 4), "", ""),            # every full block: the partial is listed
             (hashes(tokens[:4], 4), "prefill-0", ""),  # a prefix: no partial
             (hashes(tokens + [1, 2], 4), "", "req-1")]  # more than the lease holds
    for h, reader, request in cases:
        reply = pair.fast.hit("t0", "c0", h, 0, 0.0, reader, request)
        assert reply is not None
        out = pb.AcquireReadResponse.FromString(reply)
        assert out.miss_reason == pb.MISS_REASON_UNSPECIFIED and out.pin.pin_id
        assert out.holder.block_size == 4 and out.lease.state == pb.LEASE_STATE_ACTIVE
        pair.b.acquire_read("t0", "c0", h, 0, 0.0, reader, request)  # keep B in step
    full = pb.AcquireReadResponse.FromString(pair.fast.hit("t0", "c0", hashes(tokens, 4), 0,
                                                           0.0, "", ""))
    assert (list(full.remote_block_ids), full.partial_block_id, full.partial_block_tokens) \
        == ([5, 0], 70000, 2)
    assert full.partial_block_hash == hashes(tokens, 4, partial=True)[32:]
    # A retry of a request id, a miss and bad input are left to the Python path, untouched.
    before = state(pair.a)
    assert pair.fast.hit("t0", "c0", hashes(tokens + [1, 2], 4), 0, 0.0, "", "req-1") is None
    assert pair.fast.hit("t0", "c0", b"\x01" * 16, 0, 0.0, "", "") is None
    assert pair.fast.hit("t0", "nope", hashes(tokens, 4), 0, 0.0, "", "") is None
    assert pair.fast.hit("t0", "c0", hashes(tokens, 4), 11, 0.0, "", "") is None
    assert pair.fast.hit("t 0", "c0", hashes(tokens, 4), 0, 0.0, "", "") is None
    assert state(pair.a) == before


class SteppingClock(FakeClock):
    """A clock that moves `step` seconds at every reading: time passes within a call."""

    def __init__(self, step: float) -> None:
        super().__init__()
        self.step = step

    def monotonic(self) -> float:
        now = self._now
        self._now += self.step
        return now


WIDE = dataclasses.replace(CONFIG, max_id_length=200, max_blocks_per_lease=64)


@pytest.mark.parametrize("step", [0.0, 0.001, 0.75])
def test_edge_shapes_give_the_same_replies(step: float) -> None:
    """The encoder's edges, each checked against the Python path: block ids of 1-5 varint bytes
    (up to 2**32-1), ids long enough for 2-byte length prefixes, clock readings that move within
    a call (a pin's time left is then below zero when the reply is made, and shown as 0), and
    reads the checks refuse (control characters, DEL, non-ASCII of every width, over-long ids,
    min_tokens past its bounds), which must come back None, changing nothing."""
    pair = Pair(SteppingClock(step), WIDE, SteppingClock(step))  # one clock per table
    long_holder = "h" * 150
    with pair.deterministic_ids():
        pair.both("register_holder", HolderSpec(long_holder, "n" * 120, 65535, 8, 4,
                                                "f" * 180, 30.0, "v1"))
        ids = [0, 127, 128, 16383, 16384, 2**21, 2**28 - 1, 2**28, 2**31, 2**32 - 2,
               2**32 - 1, 5]
        tokens = list(range(4 * len(ids) - 1))  # the last block holds 3 tokens
        tenant, conv = "T" * 199, "c" * 200
        pair.both("grant", GrantSpec(long_holder, tenant, conv, "r" * 200, ids, len(tokens),
                                     hashes(tokens, 4, partial=True), 20.0, 900.0))
        replies = []
        for prompt, min_tokens, ttl, reader, request in [
                (tokens, 0, 0.0, "", ""),
                (tokens, 2**31, 0.0, "", ""),  # the bound itself: a below-minimum miss
                (tokens + [9] * 40, len(tokens), 3.5, "p" * 200, ""),
                (tokens[:20], 20, 1e-9, "", "q" * 200),  # time left < 0 once the clock moves
                (tokens[:20], 21, 0.0, "x", "y"),  # below the minimum
                (tokens[:8] + [1] * 12, 0, 4.0, "", "")]:  # a mismatch at block 2
            replies.append(pb.AcquireReadResponse.FromString(
                pair.read(tenant, conv, hashes(prompt, 4), min_tokens, ttl, reader, request)))
            pair.check_same_state()
        assert pair.fast_hits == 4
        whole, _, _, short, _, _ = replies
        assert list(whole.remote_block_ids) == ids[:-1] and whole.partial_block_id == 5
        assert whole.lease.holder_id == long_holder
        assert whole.holder.engine_fingerprint == "f" * 180 and whole.holder.nixl_port == 65535
        if step:  # 1 ns of pin left at the first reading, less than none at the next
            assert (short.pin.expires_in.seconds, short.pin.expires_in.nanos) == (0, 0)
            assert short.pin.expire_time.ToNanoseconds() > 0
        good = hashes(tokens, 4)
        for bad in [("t\x00", conv, 0, ""), ("t\x1f", conv, 0, ""), ("t\x7f", conv, 0, ""),
                    ("t é", conv, 0, ""), ("té", conv, 0, ""), ("t\u20ac", conv, 0, ""),
                    ("t\U0001f600", conv, 0, ""), ("T" * 201, conv, 0, ""),
                    (tenant, conv + "c", 0, ""), (tenant, "", 0, ""),
                    (tenant, conv, -1, ""), (tenant, conv, 2**31 + 1, ""),
                    (tenant, conv, 0, "r\u20ac"), (tenant, conv, 0, "r" * 201)]:
            before = state(pair.a)
            assert pair.fast.hit(bad[0], bad[1], good, bad[2], 0.0, bad[3], "") is None, bad
            assert state(pair.a) == before
            pair.read(bad[0], bad[1], good, bad[2], 0.0, bad[3], "")  # Python answers, alike
        with pytest.raises(OverflowError):  # past int64: the proto field cannot hold it
            pair.fast.hit(tenant, conv, good, 2**63, 0.0, "", "")


def varint(v: int, extra: int = 0) -> bytes:
    """`v` as a varint (a negative one as protobuf writes int64s: 10 bytes), `extra` bytes
    longer than it needs (a form protobuf reads alike)."""
    v &= (1 << 64) - 1
    out = bytearray()
    while v >= 0x80 or extra:
        if v < 0x80:
            extra -= 1
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def field(number: int, wire: int, value: bytes | int, extra: int = 0) -> bytes:
    if wire == 0:
        assert isinstance(value, int)
        return varint(number << 3) + varint(value, extra)
    assert isinstance(value, bytes)
    return varint(number << 3 | 2) + varint(len(value), extra) + value


# Ways to write (or damage) a request, each applied to a read that is a hit when written plainly.
MUTATION = st.one_of(
    st.tuples(st.just("drop"), st.integers(0, 6)),
    st.tuples(st.just("again"), st.integers(0, 6), st.booleans()),  # same or other value
    st.tuples(st.just("unknown"), st.sampled_from([8, 9, 15, 16, 2047, 2048, 536870911]),
              st.sampled_from([0, 1, 2, 5])),
    st.tuples(st.just("wire"), st.integers(0, 6)),  # a field with another wire type
    st.tuples(st.just("overlong"), st.integers(0, 6), st.integers(1, 5)),
    st.tuples(st.just("cut"), st.integers(1, 8)),
    st.tuples(st.just("ttl"), st.sampled_from(
        ["empty", "negative_s", "negative_ns", "big_ns", "twice", "unknown", "huge_s",
         "only_ns", "overlong"])),
    st.tuples(st.just("min_tokens"), st.sampled_from(
        [2**31, 2**31 + 1, 2**32 - 1, 2**32, 2**35, -1])),
    st.tuples(st.just("text"), st.sampled_from(
        [b"t\xc3\xa9", b"t\xff", b"", b"t\x00", b"t" * 13, b"\xed\xa0\x80"])),
)


def encode(parts: list[tuple[int, int, Any, int]]) -> bytes:
    return b"".join(field(n, w, v, x) for n, w, v, x in parts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(order=st.permutations(range(7)), mutations=st.lists(MUTATION, max_size=3),
       min_tokens=st.sampled_from([0, 1, 12]), ttl=st.sampled_from([0.0, 0.5, 3.0]))
def test_requests_read_from_bytes_are_read_as_protobuf_reads_them(
        order: list[int], mutations: list[tuple[Any, ...]], min_tokens: int,
        ttl: float) -> None:
    """`hit_raw` reads the request's bytes itself. Written any way protobuf accepts (fields in
    any order, repeated, unknown, with longer varints, ...) or damaged, it must answer exactly
    as the Python path answers what protobuf parses, or leave it to that path; bytes protobuf
    refuses must never be answered. Plain requests, fields in any order, must be answered."""
    clock = FakeClock()
    pair = Pair(clock)
    tokens = list(range(14))
    with pair.deterministic_ids():
        pair.both("register_holder", holder_spec("h4"))
        pair.both("grant", GrantSpec("h4", "t0", "c0", "req", [3, 200, 70000, 9], len(tokens),
                                     hashes(tokens, 4, partial=True)))
        whole = int(ttl)
        duration = field(1, 0, whole) + field(2, 0, int((ttl - whole) * 1e9))
        plain = [(1, 2, b"t0", 0), (2, 2, b"c0", 0), (3, 2, hashes(tokens, 4), 0),
                 (4, 0, min_tokens, 0), (5, 2, duration, 0), (6, 2, b"prefill-0", 0),
                 (7, 2, b"req-1", 0)]
        parts = [p for p in (plain[i] for i in order) if p[2] not in (0, b"")]
        before = pair.fast_hits
        pair.read_raw(encode(parts))
        assert pair.fast_hits == before + 1  # a plain hit, in any field order
        for i, m in enumerate(mutations):
            parts = [p for p in (plain[i] for i in order) if p[2] not in (0, b"")]
            parts = [(7, 2, f"req-m{i}".encode(), 0) if n == 7 else (n, w, v, x)
                     for n, w, v, x in parts]
            raw = mutate(parts, m)
            pair.read_raw(raw)
            pair.check_same_state()


def mutate(parts: list[tuple[int, int, Any, int]], m: tuple[Any, ...]) -> bytes:
    kind = m[0]
    if kind == "drop":
        del parts[m[1] % len(parts)]
    elif kind == "again":
        n, w, v, x = parts[m[1] % len(parts)]
        other = (v + 1 if w == 0 else v + b"x") if m[2] else v
        parts.append((n, w, other, x))
    elif kind == "unknown":
        body: Any = 7 if m[2] == 0 else b"junk"
        if m[2] in (1, 5):  # fixed64, fixed32
            return encode(parts) + varint(m[1] << 3 | m[2]) + bytes(8 if m[2] == 1 else 4)
        return encode(parts) + field(m[1], m[2], body)
    elif kind == "wire":
        n, w, v, x = parts[m[1] % len(parts)]
        parts[m[1] % len(parts)] = (n, 2, b"\x01", x) if w == 0 else (n, 0, len(v), x)
    elif kind == "overlong":
        n, w, v, _ = parts[m[1] % len(parts)]
        parts[m[1] % len(parts)] = (n, w, v, m[2])
    elif kind == "cut":
        return encode(parts)[:-m[1]]
    elif kind == "ttl":
        ttl = {"empty": b"", "negative_s": field(1, 0, -1), "negative_ns": field(2, 0, -5),
               "big_ns": field(2, 0, 1_500_000_000), "twice": field(1, 0, 1) + field(1, 0, 2),
               "unknown": field(1, 0, 1) + field(3, 0, 1), "huge_s": field(1, 0, 2**62),
               "only_ns": field(2, 0, 250_000_000),
               "overlong": field(1, 0, 2, 3)}[m[1]]
        parts = [(n, w, v, x) for n, w, v, x in parts if n != 5] + [(5, 2, ttl, 0)]
    elif kind == "min_tokens":
        parts = [(n, w, v, x) for n, w, v, x in parts if n != 4] + [(4, 0, m[1], 0)]
    elif kind == "text":
        parts = [(n, w, m[1] if n == 1 else v, x) for n, w, v, x in parts]
    return encode(parts)


# ---- the server's wiring --------------------------------------------------------------------


ADMIN_TOKEN, READER_TOKEN = "admin-token-0123456789", "reader-token-0123456789"
TOKENS = f"{ADMIN_TOKEN} admin\n{READER_TOKEN} reader tenants=t1 name=prefill"


@pytest.mark.parametrize(("mode", "secured"), [("auto", False), ("off", False),
                                               ("auto", True)])
async def test_server_answers_hits_by_its_compiled_reads_setting(registry_factory, kv,
                                                                 mode: str,
                                                                 secured: bool) -> None:
    """The compiled path answers hits (reading the request's bytes), off the store answers;
    secured, a reader limited to one tenant is refused another tenant's conversation even
    where it has a lease the compiled path could read."""
    clock = FakeClock()
    server = await registry_factory(clock, compiled_reads=mode,
                                    **({"auth_tokens": TOKENS} if secured else {}))
    assert server.servicer.compiled_reads is (mode == "auto")
    target = f"127.0.0.1:{server.port}"
    async with AsyncRegistryClient(target, token=ADMIN_TOKEN if secured else None) as admin:
        await admin.register_holder(**kv.holder_args("h1"))
        tokens = list(range(kv.block_size * 2 + 1))
        await admin.grant_lease(**kv.grant_args("h1", "t1", "c1", tokens))
        await admin.grant_lease(**kv.grant_args("h1", "t2", "c1", tokens))
    async with AsyncRegistryClient(target, token=READER_TOKEN if secured else None) as client:
        calls = mock.Mock(wraps=server.store.acquire_read)
        with mock.patch.object(server.store, "acquire_read", calls):
            hit = await client.acquire_read(tenant="t1", conversation_id="c1",
                                            block_hashes=kv.prompt_hashes(tokens),
                                            pin_ttl=3.0, reader_id="p0")
            miss = await client.acquire_read(tenant="t1", conversation_id="c2",
                                             block_hashes=kv.prompt_hashes(tokens))
            if secured:  # a tenant this reader may not read (a hit else): refused, no pin
                with pytest.raises(KvbridgeError, match="may not touch tenant 't2'"):
                    await client.acquire_read(tenant="t2", conversation_id="c1",
                                              block_hashes=kv.prompt_hashes(tokens))
        # The compiled path answered the hit without the store; the miss went to the store.
        assert calls.call_count == (1 if mode == "auto" else 2)
    assert hit.miss_reason == pb.MISS_REASON_UNSPECIFIED and hit.matched_blocks == 2
    assert hit.pin.expires_in.seconds == 3 and hit.partial_block_tokens == 1
    assert miss.miss_reason == pb.MISS_REASON_NO_LEASE
    assert server.table.counts()["pins"] == 1
    assert server.metrics.reads.counts == {**server.metrics.reads.counts, "hit": 1, "no_lease": 1}
    # Both reads timed as AcquireRead's (the hit by the compiled path, in its own clock).
    timed = server.servicer._durations["AcquireRead"]
    assert sum(timed.counts) == 2 and 0 < timed.sum < 5.0  # the refused one is not served
    paths = server.servicer.fast_paths()  # as the handlers were given them
    assert ("AcquireRead" in paths) is (mode == "auto")


def test_system_clock_is_read_in_c_as_python_reads_it() -> None:
    """On the process's own clock the compiled path reads it in C (the clock deadlines use,
    `kvbridge.clock.monotonic`, and the wall clock): the pin's deadline and the reply's times
    agree with what Python reads around the call."""
    table = LeaseTable(CONFIG, SystemClock(), recovering=False)
    table.register_holder(HolderSpec("h4", "10.0.0.9", 5600, 2, 4, FP, 30.0))
    tokens = list(range(8))
    table.grant(GrantSpec("h4", "t0", "c0", "req", [1, 2], 8, hashes(tokens, 4), 10.0, 20.0))
    fast = table.fast_reader()
    assert fast is not None
    mono0, wall0 = monotonic(), time.time()
    reply = fast.hit_raw(request_bytes("t0", "c0", hashes(tokens, 4), 0, 3.0, "", "r1"))
    mono1, wall1 = monotonic(), time.time()
    assert reply is not None
    out = pb.AcquireReadResponse.FromString(reply)
    (pin,) = table._pins.values()
    assert mono0 + 3.0 <= pin.expire_at <= mono1 + 3.0
    assert 2.99 < out.pin.expires_in.ToTimedelta().total_seconds() <= 3.0
    assert wall0 + 2.99 < out.pin.expire_time.ToNanoseconds() / 1e9 < wall1 + 3.01
    lease = table._conversations["t0"]["c0"]
    assert mono0 + 10.0 <= lease.expire_at <= mono1 + 10.0  # the read kept the lease


def test_clock_deadlines_use_when_it_is_time_monotonic() -> None:
    """Where the kernel has no boot-time clock, deadlines run on `time.monotonic()`: the
    compiled path then reads that clock."""
    with mock.patch("kvbridge.clock.monotonic", time.monotonic):
        table = LeaseTable(CONFIG, SystemClock(), recovering=False)
        table.register_holder(HolderSpec("h4", "10.0.0.9", 5600, 2, 4, FP, 30.0))
        tokens = list(range(8))
        table.grant(GrantSpec("h4", "t0", "c0", "req", [1, 2], 8, hashes(tokens, 4)))
        fast = table.fast_reader()
        assert fast is not None
        before = time.monotonic()
        assert fast.hit("t0", "c0", hashes(tokens, 4), 0, 2.0, "", "") is not None
        after = time.monotonic()
    (pin,) = table._pins.values()
    assert before + 2.0 <= pin.expire_at <= after + 2.0


class ListedWheel(ExpiryWheel[Any]):
    """An expiry wheel of another type: the compiled path calls its `add`."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[Any] = []

    def add(self, item: Any, deadline: float) -> None:
        self.added.append(item)
        super().add(item, deadline)


def test_other_pin_id_makers_and_wheels_are_called() -> None:
    """A table whose pin ids or pin expiry are not kvbridge's own types (a test's, a future
    one's): the compiled path calls them, and answers as the Python path does."""
    pair = Pair(FakeClock())
    made = pair.a._pin_id

    def pin_id(tenant: str, reader_id: str, request_id: str) -> str:
        return made(tenant, reader_id, request_id)

    pair.a._pin_id = pair.b._pin_id = pin_id
    pair.a._pin_expiry = ListedWheel()
    pair.b._pin_expiry = ExpiryWheel()
    pair.fast = pair.a.fast_reader()  # type: ignore[assignment]
    tokens = list(range(8))
    with pair.deterministic_ids():
        pair.both("register_holder", holder_spec("h4"))
        pair.both("grant", GrantSpec("h4", "t0", "c0", "req", [1, 2], 8, hashes(tokens, 4)))
        pair.read("t0", "c0", hashes(tokens, 4), 0, 0.0, "p", "q")
        pair.read("t0", "c0", hashes(tokens, 4), 0, 0.0, "p", "q2")
    assert pair.fast_hits == 2 and len(pair.a._pin_expiry.added) == 2
    assert set(pair.a._pins) == {made("t0", "p", "q"), made("t0", "p", "q2")}
    pair.check_same_state()


def test_hits_are_counted_and_timed_once_through_either_entry() -> None:
    """With metrics attached, each hit the compiled path answers (bytes or parsed) is counted
    once and timed into the bucket whose bound is the first at or above it; what it leaves to
    the Python path is not counted here."""
    pair = Pair(FakeClock())
    tokens = list(range(8))
    pair.both("register_holder", holder_spec("h4"))
    pair.both("grant", GrantSpec("h4", "t0", "c0", "req", [1, 2], 8, hashes(tokens, 4)))
    counts = {"hit": 0, "no_lease": 0}
    series = LoopHistogram("x", "x", "method", [1e-9, 60.0]).labels("AcquireRead")
    pair.fast.attach_metrics(counts, "hit", series)
    h = hashes(tokens, 4)
    assert pair.fast.hit("t0", "c0", h, 0, 0.0, "", "") is not None
    assert pair.fast.hit_raw(request_bytes("t0", "c0", h, 0, 0.0, "", "")) is not None
    assert pair.fast.hit_raw(request_bytes("t0", "c1", h, 0, 0.0, "", "")) is None  # a miss
    assert pair.fast.hit("t0", "c0", b"\x00" * 16, 0, 0.0, "", "") is None  # a mismatch
    assert counts == {"hit": 2, "no_lease": 0}
    # Each took more than a nanosecond and less than a minute: the middle bucket.
    assert series.counts == [0, 2, 0] and 0 < series.sum < 1.0
    with pytest.raises(ValueError, match="no count named"):
        pair.fast.attach_metrics(counts, "hits", series)


async def test_handlers_try_the_raw_fast_path_and_leave_what_it_declines_to_the_servicer(
        ) -> None:
    """With a raw fast path the handler offers it the bytes; what it declines is parsed and
    served by the servicer (the parsed fast path would only repeat the same reading). Without
    one, the parsed fast path is tried."""
    seen: list[str] = []

    def parsed(request: Any) -> bytes | None:
        seen.append(f"parsed {request.tenant}")
        return b"P" if request.tenant == "p" else None

    def raw(data: bytes, gate: Any) -> bytes | None:
        assert gate is None  # no caller to check
        seen.append("raw")
        return b"R" if b"raw" in data else None

    async def servicer(request: Any, context: Any) -> Any:
        seen.append(f"servicer {request.tenant}")
        return pb.AcquireReadResponse(mismatch_block=7)

    def request(tenant: str) -> bytes:
        return pb.AcquireReadRequest(tenant=tenant).SerializeToString()

    both = _grpc_handlers._unary(servicer, pb.AcquireReadRequest,
                                 _grpc_handlers.FastPath(parsed, raw))
    assert await both(request("raw"), None) == b"R"
    assert (await both(request("p"), None)).mismatch_block == 7
    assert seen == ["raw", "raw", "servicer p"]
    seen.clear()
    parsed_only = _grpc_handlers._unary(servicer, pb.AcquireReadRequest,
                                        _grpc_handlers.FastPath(parsed))
    assert await parsed_only(request("p"), None) == b"P"
    assert (await parsed_only(request("x"), None)).mismatch_block == 7
    assert seen == ["parsed p", "parsed x", "servicer x"]


class FakeContext:
    def __init__(self, token: str) -> None:
        self.token = token

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort_with_status(self, status: Any) -> None:
        raise PermissionError(status.details)


async def test_secured_handlers_offer_the_bytes_only_with_the_callers_tenant_gate() -> None:
    """On a server that authenticates calls, the raw fast path gets the caller's tenant gate
    (it must not answer for a tenant the gate refuses); a caller whose rule needs more than
    the tenant (here: a role that may not read) never reaches it, and is refused."""
    seen: list[Any] = []
    table = TokenTable.load("", "tok-admin-0123456789 admin\n"
                                "tok-t1-0123456789abcd reader tenants=t1 name=p\n"
                                "tok-holder-0123456789 holder holder=h1 name=d")
    assert table is not None
    rule = _access.RULES["AcquireRead"]
    guard = _grpc_handlers._Guard(Authenticator(table), rule, "AcquireRead")

    def raw(data: bytes, gate: Any) -> bytes | None:
        request = pb.AcquireReadRequest.FromString(data)
        seen.append(("raw", gate(request.tenant)))
        return b"R" if gate(request.tenant) else None

    def parsed(request: Any) -> bytes | None:
        seen.append(("parsed", request.tenant))
        return b"P"

    async def servicer(request: Any, context: Any) -> Any:
        raise AssertionError("not reached")

    handle = _grpc_handlers._guarded_unary(servicer, pb.AcquireReadRequest, guard,
                                           _grpc_handlers.FastPath(parsed, raw))
    t1, t2 = (pb.AcquireReadRequest(tenant=t).SerializeToString() for t in ("t1", "t2"))
    assert await handle(t1, FakeContext("tok-t1-0123456789abcd")) == b"R"
    with pytest.raises(PermissionError, match="may not touch tenant 't2'"):
        await handle(t2, FakeContext("tok-t1-0123456789abcd"))
    assert await handle(t2, FakeContext("tok-admin-0123456789")) == b"R"
    with pytest.raises(PermissionError, match="role holder may not call AcquireRead"):
        await handle(t1, FakeContext("tok-holder-0123456789"))
    assert seen == [("raw", True), ("raw", False), ("raw", True)]


async def test_compiled_reads_on_refuses_to_start_without_the_module(registry_factory) -> None:
    with mock.patch.object(_core, "FastReader", None), \
            mock.patch.object(_server, "FAST_READER_MISSING", "not built (test)"), \
            pytest.raises(ValueError, match=r"compiled_reads on, but .* not built"):
        await registry_factory(FakeClock(), compiled_reads="on")


def test_compiled_reads_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="compiled_reads must be auto, on or off"):
        RegistryConfig(compiled_reads="yes")
    with pytest.raises(ValueError, match="memory backend only"):
        RegistryConfig(compiled_reads="on", backend="redis", redis_url="redis://127.0.0.1:1")
