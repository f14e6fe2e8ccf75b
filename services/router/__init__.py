"""The routing service: live prefill and decode instances, and where each turn goes.

- `InstanceTable` (`_policy`): the transport-free policy, with an injected clock, and who
  owns each instance.
- `EngineUrlPolicy` (`_urls`): which engine URLs are accepted (`--engine-url-allow`).
- `RouterConfig` (`_config`): flags and `KVBRIDGE_ROUTER_*` variables.
- `RouterServicer`, `create_server`, `serve` (`_servicer`, `_server`): the gRPC adapter.
"""

from kvbridge.services.router._config import RouterConfig
from kvbridge.services.router._policy import (
    Decision,
    DecodeReason,
    Instance,
    InstanceSpec,
    InstanceTable,
    Load,
    Role,
)
from kvbridge.services.router._server import RouterServer, create_server, serve

__all__ = [
    "Decision",
    "DecodeReason",
    "Instance",
    "InstanceSpec",
    "InstanceTable",
    "Load",
    "Role",
    "RouterConfig",
    "RouterServer",
    "create_server",
    "serve",
]
