"""Domain errors, and the ONE table that maps them to canonical gRPC status codes.

Cores raise these; gRPC servicers turn them into a status whose details carry a
`google.rpc.ErrorInfo` (domain `ERROR_DOMAIN`, the error's `reason`, its metadata). Clients turn
such a status back into the same exception class, so callers catch domain errors, not gRPC ones.
"""

from __future__ import annotations

import grpc

ERROR_DOMAIN = "kvbridge.dev"


class KvbridgeError(Exception):
    """Base of every domain error. `reason` is a stable UPPER_SNAKE_CASE identifier."""

    reason = "INTERNAL"

    def __init__(self, message: str, **metadata: object) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = {k: str(v) for k, v in metadata.items()}


class InvalidArgument(KvbridgeError):
    """The request is malformed or out of bounds; nothing changed."""

    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str, **metadata: object) -> None:
        super().__init__(f"{field}: {message}", field=field, **metadata)
        self.field = field


class HolderNotFound(KvbridgeError):
    """No such holder (never registered, lost, or the registry restarted): re-register."""

    reason = "HOLDER_NOT_FOUND"


class HolderConflict(KvbridgeError):
    """A holder with this id is registered with a different layout or endpoint."""

    reason = "HOLDER_CONFLICT"


class HolderDraining(KvbridgeError):
    """The holder deregistered; it can grant no new leases."""

    reason = "HOLDER_DRAINING"


class LeaseNotFound(KvbridgeError):
    """No such lease (never granted, or already reclaimed)."""

    reason = "LEASE_NOT_FOUND"


class NotLeaseHolder(KvbridgeError):
    """The lease belongs to another holder."""

    reason = "NOT_LEASE_HOLDER"


class IdempotencyConflict(KvbridgeError):
    """A request id was reused for a different request."""

    reason = "REQUEST_ID_REUSED"


class CapacityExhausted(KvbridgeError):
    """The registry is at a configured limit (leases, pins, watchers)."""

    reason = "CAPACITY_EXHAUSTED"


class Unavailable(KvbridgeError):
    """The service is unreachable, shutting down or not ready; retry elsewhere or later."""

    reason = "UNAVAILABLE"


class DeadlineExceeded(KvbridgeError):
    """The call did not complete within its deadline."""

    reason = "DEADLINE_EXCEEDED"


class InstanceNotFound(KvbridgeError):
    """The router knows no such instance (never registered, or dropped): register again."""

    reason = "INSTANCE_NOT_FOUND"


class NoInstance(KvbridgeError):
    """No live instance can take the request (none registered for the role and model)."""

    reason = "NO_INSTANCE"


class PermissionDenied(KvbridgeError):
    """The caller may not do this."""

    reason = "PERMISSION_DENIED"


class Unauthenticated(KvbridgeError):
    """The call carries no valid credentials (missing, malformed or unknown token)."""

    reason = "UNAUTHENTICATED"


class Recovering(KvbridgeError):
    """The registry lost its state (a restart of the memory backend, an emptied Redis) and is
    within its recovery grace: it cannot tell that a lease it does not know never existed,
    since a holder that has not re-registered yet may still hold it, pinned by a reader."""

    reason = "RECOVERING"


class TenantQuotaExceeded(KvbridgeError):
    """The tenant is at its quota (leases or retained blocks) and nothing of its own could be
    released to make room."""

    reason = "TENANT_QUOTA_EXCEEDED"


class RateLimited(KvbridgeError):
    """The caller made more calls of this kind than its rate allows: retry after a while."""

    reason = "RATE_LIMITED"


# The one mapping from domain errors to gRPC codes (etcd v3rpc/util.go style).
STATUS_CODES: dict[type[KvbridgeError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    HolderNotFound: grpc.StatusCode.NOT_FOUND,
    LeaseNotFound: grpc.StatusCode.NOT_FOUND,
    HolderConflict: grpc.StatusCode.FAILED_PRECONDITION,
    HolderDraining: grpc.StatusCode.FAILED_PRECONDITION,
    NotLeaseHolder: grpc.StatusCode.PERMISSION_DENIED,
    IdempotencyConflict: grpc.StatusCode.ALREADY_EXISTS,
    CapacityExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    InstanceNotFound: grpc.StatusCode.NOT_FOUND,
    NoInstance: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    TenantQuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RateLimited: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Recovering: grpc.StatusCode.FAILED_PRECONDITION,
    KvbridgeError: grpc.StatusCode.INTERNAL,
}

ERRORS_BY_REASON: dict[str, type[KvbridgeError]] = {cls.reason: cls for cls in STATUS_CODES}

# For statuses that carry no ErrorInfo (raised by gRPC itself, or a proxy): the closest class.
ERRORS_BY_CODE: dict[grpc.StatusCode, type[KvbridgeError]] = {
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def status_code(error: KvbridgeError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL
