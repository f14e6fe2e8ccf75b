"""Ids the registry derives from a request's own id, so that a retried request finds what the
first attempt made. Part of the API: a holder computes the lease id of a grant it sent (holder
id, request id) to ask about it when the grant's outcome is unknown. A pin id is not: whoever
holds one may release the pin, so it is keyed with a secret only the registry knows."""

from __future__ import annotations

import hashlib

from kvbridge.errors import InvalidArgument


def check_identifier(field: str, value: str, max_length: int) -> None:
    """InvalidArgument naming `field` unless `value` is an id: 1..max_length characters of
    printable ASCII without spaces (safe in logs, metrics labels, Redis keys and headers).
    The one id rule of every service and of the access checks before them."""
    # The common case first, in C string methods (every read checks four ids).
    if 0 < len(value) <= max_length and value.isascii() and value.isprintable() \
            and " " not in value:
        return
    if not value:
        raise InvalidArgument(field, "is required")
    if len(value) > max_length:
        raise InvalidArgument(field, f"longer than {max_length} characters", length=len(value))
    raise InvalidArgument(field, "must be printable ASCII without spaces")


def derived_id(prefix: str, scope: str, request_id: str) -> str:
    """A stable id for a retried request: the same (scope, request id) gives the same id."""
    digest = hashlib.blake2b(f"{scope}\x00{request_id}".encode(), digest_size=8).hexdigest()
    return f"{prefix}-{digest}"


class PinIds:
    """The pin ids of reads keyed with a secret (the registry's; shared by Redis replicas):
    `make(tenant, reader_id, request_id, caller)` is the id of the pin a read with that
    request id makes, the same for every retry of that read, and unguessable without the
    secret even to someone who knows the reader and request ids. The tenant keeps two
    tenants' reads apart, the caller (the authenticated principal's name, "" without auth) two
    principals' reads: neither can then release the other's pin.

    The id is "p-" and the hex of the 8-byte BLAKE2b of "tenant NUL reader NUL request", with
    "NUL caller" after it when there is one, keyed with the secret; `keyed` is the hash's
    state after the key, copied for each id."""

    __slots__ = ("keyed",)

    def __init__(self, secret: bytes) -> None:
        self.keyed = hashlib.blake2b(digest_size=8, key=secret)

    def __call__(self, tenant: str, reader_id: str, request_id: str, caller: str = "") -> str:
        h = self.keyed.copy()
        scope = f"{tenant}\x00{reader_id}\x00{request_id}"
        h.update((f"{scope}\x00{caller}" if caller else scope).encode())
        return f"p-{h.hexdigest()}"


def pin_id_maker(secret: bytes) -> PinIds:
    """The pin ids of reads keyed with `secret` (see `PinIds`)."""
    return PinIds(secret)


def grant_lease_id(holder_id: str, request_id: str) -> str:
    """The id of the lease a grant with `request_id` from `holder_id` makes, by which GetLease
    finds it on every backend (a registry sharded over Redis appends its shard's tag: `.sK`)."""
    return derived_id("l", holder_id, request_id)
