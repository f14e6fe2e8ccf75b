"""kvbridge client library: registry clients (sync and asyncio) and the holder session."""

from kvbridge.clients._holder_session import (
    GrantOutcomeUnknown,
    HeldLease,
    HolderSession,
    Revoked,
)
from kvbridge.clients._registry import (
    AsyncRegistryClient,
    RegistryClient,
    duration,
    seconds,
)

__all__ = ["AsyncRegistryClient", "GrantOutcomeUnknown", "HeldLease", "HolderSession",
           "RegistryClient", "Revoked", "duration", "seconds"]
