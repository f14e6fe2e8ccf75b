"""The lease registry: holders, conversation leases, read pins and reclaim notices.

- `LeaseTable` (`_core`): the transport-free state machine, with an injected clock.
- `LeaseStore` (`_store`): the storage interface the servicer uses; `MemoryStore` adapts
  `LeaseTable`, `RedisStore` (`_redis`, needs the `redis` extra) is shared by replicas.
- `RegistryConfig` (`_config`): limits and defaults, from flags or `KVBRIDGE_*` variables.
- `RegistryServicer`, `create_server`, `serve` (`_servicer`, `_server`): the gRPC adapter.
"""

from kvbridge.services.registry._config import RegistryConfig
from kvbridge.services.registry._core import (
    Grant,
    GrantSpec,
    HolderSpec,
    LeaseTable,
    Read,
    Registration,
    Renewal,
    Snapshot,
)
from kvbridge.services.registry._model import (
    EventType,
    Holder,
    HolderState,
    Lease,
    LeaseEvent,
    LeaseState,
    MissReason,
    Pin,
)
from kvbridge.services.registry._store import LeaseStore, MemoryStore

__all__ = [
    "EventType",
    "Grant",
    "GrantSpec",
    "Holder",
    "HolderSpec",
    "HolderState",
    "Lease",
    "LeaseEvent",
    "LeaseState",
    "LeaseStore",
    "LeaseTable",
    "MemoryStore",
    "MissReason",
    "Pin",
    "Read",
    "Registration",
    "RegistryConfig",
    "Renewal",
    "Snapshot",
]

from kvbridge.services.registry._server import (
    RegistryServer,
    create_server,
    open_store,
    serve,
)

__all__ += ["RegistryServer", "create_server", "open_store", "serve"]
