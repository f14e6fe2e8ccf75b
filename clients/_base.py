"""What the gRPC clients share: channel options, and the call with a deadline and retries.

A call's `timeout` is its whole budget: retries (on UNAVAILABLE, idempotent calls only, with
jittered backoff) happen inside it, and a status that comes back is raised as the domain error
it carries (`kvbridge.errors`), so callers never handle grpc.RpcError.

A client may name several addresses of replicas that serve the same state (`"a:50051,b:50051"`
or a list): calls go to one of them, and when it answers UNAVAILABLE or runs out of time the
client moves to the next, retrying an idempotent call there at once (within the same budget).

A raised error has `maybe_applied`: True when some attempt of the call may have taken effect (it
reached a server and was not refused with a reason: it ran out of time, lost its connection,
or the server failed); a caller for whom a lost write matters (a holder's grant) must treat
True as "perhaps done".
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import grpc

from kvbridge._grpc_status import from_rpc_error, stream_is_live
from kvbridge.auth import TlsFiles, call_metadata
from kvbridge.clock import monotonic
from kvbridge.errors import DeadlineExceeded, KvbridgeError, Unavailable

DEFAULT_TIMEOUT = 2.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # retries are ours, bounded by the call's deadline
    # Reconnect soon after an outage (gRPC's default backoff grows to two minutes).
    # (min_reconnect_backoff_ms is left alone: it is also the connection attempt's timeout.)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # While a call is open, ping every 30 s and drop the connection when a ping goes 10 s
    # unanswered: a watch stream whose replica vanished without a word (a host crash, a
    # partition) ends and moves on, instead of waiting for events forever. Servers allow it
    # (`kvbridge._grpc_handlers.SERVER_KEEPALIVE_OPTIONS`).
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),  # what this gRPC waits for the ack (60 s by default)
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),  # an idle stream sends no data: ping anyway
]


FAILOVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def backoff(attempt: int) -> float:
    return float(min(0.05 * 2**attempt, 0.5) * (0.5 + random.random() / 2))


def parse_hostport(value: str, *, listen: bool = False) -> tuple[str, int]:
    """`"HOST:PORT"` -> `(host, port)`; IPv6 hosts in brackets (`"[::1]:50051"`).

    ValueError("expected HOST:PORT ...") for anything else, and for a port outside 1..65535.
    With `listen` (an address to bind) the host may be empty (all interfaces) and port 0
    (any free port) is allowed.
    """
    host, sep, port = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    well_formed = (sep and port.isascii() and port.isdigit() and (host or listen)
                   # an unbracketed IPv6 address leaves the port ambiguous
                   and (bracketed or ":" not in host)
                   and not any(c.isspace() or c in ",/[]" for c in host))
    if not well_formed:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    lowest = 0 if listen else 1
    if len(port) > 5 or not lowest <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port from {lowest} to 65535, "
                         f"got {value!r}")
    return host, int(port)


def check_target(target: str) -> None:
    """One client address: `HOST:PORT`, or one of gRPC's name-resolver forms that name a
    single server or a name to resolve, `dns:///HOST:PORT` (`dns://RESOLVER/HOST:PORT`) and
    `unix:PATH` (`unix:///ABSOLUTE/PATH`). ValueError("expected HOST:PORT ...") otherwise."""
    if target.startswith("dns:"):
        rest = target[len("dns:"):]
        if rest.startswith("//"):
            _authority, slash, rest = rest[2:].partition("/")
            if not slash:
                raise ValueError(f"expected HOST:PORT or dns:///HOST:PORT, got {target!r}")
        try:
            parse_hostport(rest)
        except ValueError:
            raise ValueError(f"expected HOST:PORT or dns:///HOST:PORT, got {target!r}") from None
        return
    if target.startswith("unix:"):
        path = target[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path or path == "/" or any(c.isspace() for c in path):
            raise ValueError(f"expected HOST:PORT or unix:PATH, got {target!r}")
        return
    parse_hostport(target)


def parse_targets(value: str) -> list[str]:
    """Client addresses `"HOST:PORT"` or replicas' `"HOST:PORT,HOST:PORT"`, each checked with
    `check_target` (which also takes `dns:///HOST:PORT` and `unix:PATH`); ValueError
    "expected HOST:PORT ..." for a malformed one."""
    targets = [t.strip() for t in value.split(",")]
    if not any(targets):
        raise ValueError(f"expected HOST:PORT (replicas: HOST:PORT,HOST:PORT), got {value!r}")
    for target in targets:
        if target:
            check_target(target)
    return [t for t in targets if t]


def _never_sent(err: grpc.RpcError) -> bool:
    """The call failed before any byte of it reached a server: no connection could be made."""
    return (err.code() == grpc.StatusCode.UNAVAILABLE
            and "failed to connect" in (err.details() or "").lower())


def _may_have_applied(err: grpc.RpcError, error: KvbridgeError) -> bool:
    """Whether the failed attempt may have taken effect on the server: it reached one and did
    not come back as a refusal the server explained (out of time, connection lost, the server
    failed or its storage did: all unknown)."""
    if _never_sent(err):
        return False
    return isinstance(error, (Unavailable, DeadlineExceeded)) or type(error) is KvbridgeError


def _failed_call(error: KvbridgeError, maybe_applied: bool) -> KvbridgeError:
    error.maybe_applied = maybe_applied  # type: ignore[attr-defined]
    return error


def split_targets(target: str | Sequence[str]) -> list[str]:
    """`"a:1,b:2"` or `["a:1", "b:2"]` -> `["a:1", "b:2"]` (at least one)."""
    items = target.split(",") if isinstance(target, str) else list(target)
    targets = [t.strip() for t in items if t.strip()]
    if not targets:
        raise ValueError(f"no address in {target!r}")
    return targets


class _Replicas:
    """The addresses a client may use, and the one it uses now."""

    targets: list[str]
    _stubs: list[Any]
    _active: int
    closed: bool = False  # `close` was called
    metadata: tuple[tuple[str, str], ...] | None  # the bearer token, sent with every call

    def _security(self, token: str | None, tls: TlsFiles | None) -> Any:
        """Set `metadata` from `token`; the channel credentials when `tls` asks for TLS."""
        self.metadata = call_metadata(token) or None
        if tls is not None and tls.enabled:
            return tls.channel_credentials()
        return None

    @property
    def _stub(self) -> Any:
        return self._stubs[self._active]

    def report_failure(self, code: grpc.StatusCode) -> None:
        """A raw call through the active stub failed with `code`: on UNAVAILABLE or a
        deadline, the next call goes to the next replica (callers of `stub` use this)."""
        self._failed(self._active, code)

    def _failed(self, index: int, code: grpc.StatusCode) -> bool:
        """Move off replica `index` after `code`; True when another replica is there to try."""
        if code not in FAILOVER or len(self._stubs) == 1:
            return False
        if self._active == index:  # another thread or task may have moved on already
            self._active = (index + 1) % len(self._stubs)
        return True


def stream_backoff(attempt: int) -> float:
    """Seconds before opening a lost stream again once every address failed (up to 2 s)."""
    return float(min(0.1 * 2**attempt, 2.0) * (0.5 + random.random() / 2))


# A watch stream that ends with one of these after it was live is opened again (with
# `reconnect_for`): its replica went away, cut it (CANCELLED from the server or the network:
# the client never cancels a stream it still reads) or found it too slow ("reconnect and
# re-list"). Opening fails over on UNAVAILABLE only.
REOPEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
          grpc.StatusCode.RESOURCE_EXHAUSTED)
# A stream live for less than this before it ended does not restart the `reconnect_for`
# budget: a replica that opens streams and ends them at once is given up on.
STREAM_STABLE_S = 1.0


class StreamResume:
    """When and where a server stream (a watch) is opened again; what the clients share.

    Opening fails over like a call: on UNAVAILABLE the next address is tried at once, and once
    every address failed, again after a backoff. A stream is live once its server says so in
    its initial metadata (`STREAM_LIVE`) or sends a message. A live stream that ends (see
    `REOPEN`) is opened again only with `reconnect_for` > 0, since the events between the two
    streams are not replayed: `on_lost(target, error)` when it ends, `on_resumed(target)`
    when another is live. The stream gives up (`failed` returns None) once `reconnect_for`
    seconds pass without a live stream; with 0, after one try of every address.
    """

    def __init__(self, replicas: _Replicas, reconnect_for: float,
                 on_lost: Callable[[str, KvbridgeError], None] | None = None,
                 on_resumed: Callable[[str], None] | None = None) -> None:
        self.replicas = replicas
        self.reconnect_for = reconnect_for
        self.on_lost, self.on_resumed = on_lost, on_resumed
        self._since = monotonic()  # the start, or when the last stable live stream ended
        self._tried = 1  # addresses tried in this round
        self._attempt = 0  # rounds of every address since `_since`
        self._lost = False  # a live stream ended and none is live again yet
        self._index = 0  # the replica of the stream opened last
        self._live_at: float | None = None  # when that stream went live (None: not yet)
        self._ever_live = False

    def opened(self, index: int, metadata: Any) -> None:
        """A stream was opened on replica `index`; `metadata`: its initial metadata."""
        self._index, self._live_at = index, None
        if stream_is_live(metadata):
            self._went_live()

    def event(self) -> None:
        """The stream sent a message (live, even from a server that does not say so)."""
        if self._live_at is None:
            self._went_live()

    def _went_live(self) -> None:
        self._live_at = monotonic()
        self._ever_live = True
        self._tried = 1
        if self._lost:
            self._lost = False
            if self.on_resumed is not None:
                self.on_resumed(self.replicas.targets[self._index])

    def failed(self, err: grpc.RpcError) -> float | None:
        """The stream opened last failed with `err`: seconds to wait before opening one again
        (on the replica active then), or None when the caller gives up (`error`)."""
        code, now, index = err.code(), monotonic(), self._index
        live_at, self._live_at = self._live_at, None  # this stream's; the next one is new
        if self.replicas.closed:
            return None
        if live_at is not None:
            if self.reconnect_for <= 0 or code not in REOPEN:
                return None
            if now - live_at >= STREAM_STABLE_S:
                self._since, self._attempt = now, 0
            self._lost = True  # (`_tried` is 1 since it went live)
            if self.on_lost is not None:
                self.on_lost(self.replicas.targets[index], from_rpc_error(err))
        elif code not in RETRYABLE:
            return None
        if self.replicas._failed(index, code) and self._tried < len(self.replicas._stubs):
            self._tried += 1
            return 0.0
        left = self._since + self.reconnect_for - now
        if left <= 0:
            return None
        self._tried, self._attempt = 1, self._attempt + 1
        return min(stream_backoff(self._attempt - 1), left)  # the last try at the end

    def error(self, err: grpc.RpcError) -> KvbridgeError | None:
        """The error to raise for `err`, or None when the stream just ends: the client was
        closed under it, or it was cancelled and is not to be opened again (as before
        `reconnect_for`). Its `stream_ended` says whether some stream had been live."""
        if err.code() == grpc.StatusCode.CANCELLED and (
                self.replicas.closed or self.reconnect_for <= 0):
            return None
        error = from_rpc_error(err)
        error.stream_ended = self._ever_live  # type: ignore[attr-defined]
        return error


class SyncClient(_Replicas):
    """Blocking client over one channel per replica address. Thread-safe."""

    stub_class: ClassVar[Any]

    def __init__(self, target: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = 3, channel: grpc.Channel | None = None,
                 token: str | None = None, tls: TlsFiles | None = None) -> None:
        self.targets = split_targets(target)
        self.target = ",".join(self.targets)
        self.timeout = timeout
        self.retries = retries
        creds = self._security(token, tls)
        self._channels = [channel] if channel is not None else [
            grpc.secure_channel(t, creds, options=CHANNEL_OPTIONS) if creds is not None
            else grpc.insecure_channel(t, options=CHANNEL_OPTIONS) for t in self.targets]
        self._stubs = [self.stub_class(c) for c in self._channels]
        self._active = 0

    def close(self) -> None:
        self.closed = True
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, *, idempotent: bool = True,
              timeout: float | None = None) -> Any:
        budget = self.timeout if timeout is None else timeout
        deadline = monotonic() + budget  # the clock the holder's deadlines run on
        attempt, tried = 0, 1
        sent = False  # whether some attempt may have reached a server
        while True:
            left = deadline - monotonic()
            if left <= 0:
                raise _failed_call(DeadlineExceeded(
                    f"{method} to {self.target}: no reply within {budget:g}s"), sent)
            index = self._active
            try:
                return getattr(self._stubs[index], method)(request, timeout=left,
                                                           metadata=self.metadata)
            except grpc.RpcError as err:
                code = err.code()
                error = from_rpc_error(err)
                sent = sent or _may_have_applied(err, error)
                if (self._failed(index, code) and idempotent and code in RETRYABLE
                        and tried < len(self._stubs)):
                    tried += 1  # another replica, at once
                    continue
                if (idempotent and attempt < self.retries and code in RETRYABLE
                        and deadline - monotonic() > backoff(attempt)):
                    time.sleep(backoff(attempt))
                    attempt += 1
                    continue
                raise _failed_call(error, sent) from None


class AsyncClient(_Replicas):
    """asyncio client over one channel per replica address."""

    stub_class: ClassVar[Any]

    def __init__(self, target: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = 3, channel: grpc.aio.Channel | None = None,
                 token: str | None = None, tls: TlsFiles | None = None,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None) -> None:
        """`interceptors`: the channels' (`kvbridge.tracing.client_interceptors`); none by
        default."""
        self.targets = split_targets(target)
        self.target = ",".join(self.targets)
        self.timeout = timeout
        self.retries = retries
        creds = self._security(token, tls)
        self._channels = [channel] if channel is not None else [
            grpc.aio.secure_channel(t, creds, options=CHANNEL_OPTIONS,
                                    interceptors=interceptors) if creds is not None
            else grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS, interceptors=interceptors)
            for t in self.targets]
        self._stubs = [self.stub_class(c) for c in self._channels]
        self._active = 0

    async def close(self) -> None:
        self.closed = True
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any, *, idempotent: bool = True,
                    timeout: float | None = None) -> Any:
        budget = self.timeout if timeout is None else timeout
        deadline = monotonic() + budget  # the clock the holder's deadlines run on
        attempt, tried = 0, 1
        sent = False  # whether some attempt may have reached a server
        while True:
            left = deadline - monotonic()
            if left <= 0:
                raise _failed_call(DeadlineExceeded(
                    f"{method} to {self.target}: no reply within {budget:g}s"), sent)
            index = self._active
            try:
                return await getattr(self._stubs[index], method)(request, timeout=left,
                                                                 metadata=self.metadata)
            except grpc.RpcError as err:
                code = err.code()
                error = from_rpc_error(err)
                sent = sent or _may_have_applied(err, error)
                if (self._failed(index, code) and idempotent and code in RETRYABLE
                        and tried < len(self._stubs)):
                    tried += 1  # another replica, at once
                    continue
                if (idempotent and attempt < self.retries and code in RETRYABLE
                        and deadline - monotonic() > backoff(attempt)):
                    await asyncio.sleep(backoff(attempt))
                    attempt += 1
                    continue
                raise _failed_call(error, sent) from None
