"""Ids the registry derives from a request's own id, so that a retried request finds what the
first attempt made. Part of the API: a holder computes the lease id of a grant it sent (holder
id, request id) to ask about it when the grant's outcome is unknown. A pin id is not: whoever
holds one may release the pin, so it is keyed with a secret only the registry knows."""

from __future__ import annotations

import hashlib
from collections.abc import Callable


def derived_id(prefix: str, scope: str, request_id: str) -> str:
    """A stable id for a retried request: the same (scope, request id) gives the same id."""
    digest = hashlib.blake2b(f"{scope}\x00{request_id}".encode(), digest_size=8).hexdigest()
    return f"{prefix}-{digest}"


def pin_id_maker(secret: bytes) -> Callable[[str, str, str], str]:
    """The pin ids of reads keyed with `secret` (the registry's; shared by Redis replicas):
    `make(tenant, reader_id, request_id)` is the id of the pin a read with that request id
    makes, the same for every retry of that read, and unguessable without `secret` even to
    someone who knows the reader and request ids. The tenant keeps two tenants' reads apart.
    The keyed hash's state after the key is computed once, and copied for each id."""
    keyed = hashlib.blake2b(digest_size=8, key=secret)

    def make(tenant: str, reader_id: str, request_id: str) -> str:
        h = keyed.copy()
        h.update(f"{tenant}\x00{reader_id}\x00{request_id}".encode())
        return f"p-{h.hexdigest()}"

    return make


def grant_lease_id(holder_id: str, request_id: str) -> str:
    """The id of the lease a grant with `request_id` from `holder_id` makes (both backends)."""
    return derived_id("l", holder_id, request_id)
