"""Conversion between domain errors and rich gRPC statuses (google.rpc.Status + ErrorInfo)."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
from grpc_status import rpc_status

from kvbridge.errors import (
    ERROR_DOMAIN,
    ERRORS_BY_CODE,
    ERRORS_BY_REASON,
    InvalidArgument,
    KvbridgeError,
    status_code,
)


def to_status(error: KvbridgeError) -> grpc.Status:
    """A rich status for `error`, ready for `context.abort_with_status`."""
    info = error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    proto = status_pb2.Status(
        code=status_code(error).value[0], message=error.message, details=[detail]
    )
    return rpc_status.to_status(proto)


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo carried by a failed call, if any."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except Exception:  # a malformed status trailer is treated as absent
        return None
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


def from_rpc_error(err: grpc.RpcError) -> KvbridgeError:
    """The domain error a failed call stands for: the server's own when it sent an ErrorInfo,
    else the closest class for the status code (Unavailable, DeadlineExceeded, ...)."""
    info = error_info(err)
    if info is None or info.domain != ERROR_DOMAIN:
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = (err.details() if hasattr(err, "details") else "") or str(code)
        return ERRORS_BY_CODE.get(code, KvbridgeError)(details, code=code.name)
    cls = ERRORS_BY_REASON.get(info.reason, KvbridgeError)
    message = str((err.details() if hasattr(err, "details") else str(err)) or info.reason)
    meta = dict(info.metadata)
    if cls is InvalidArgument:
        field = meta.pop("field", "request")
        prefix = f"{field}: "
        return InvalidArgument(field, message.removeprefix(prefix), **meta)
    error = cls(message, **meta)
    return error


# The initial metadata a server stream sends once it is subscribed (WatchLeases): from then on
# the stream is live, and its loss is a gap in what its watcher saw.
STREAM_LIVE = ("kvbridge-stream", "live")


def stream_is_live(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether a stream's initial metadata (key, value pairs) says its server subscribed it."""
    return any(tuple(item) == STREAM_LIVE for item in (metadata or ()))
