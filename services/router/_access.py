"""Who may call each router method (see `kvbridge.auth` for the roles and the token table).

Engines' instance agents register with the engine's own token: a decode engine's (role holder)
only as a decode instance of an engine id its scope names, a prefill engine's (role reader) only
as a prefill instance. The gateway routes; prefill connectors read through the router.
Which instance a caller may heartbeat, deregister or replace, and which tenants' turns reach
it, depend on who registered it: the ownership rules are in `_policy`'s docstring.
"""

from __future__ import annotations

from typing import Any

from kvbridge.auth import Principal, Rule, deny_holder, rule
from kvbridge.errors import PermissionDenied
from kvbridge.router.v1 import router_pb2 as pb

_ENGINES = ("holder", "reader")


def _register(principal: Principal, request: Any) -> None:
    if principal.role == "holder":
        if request.role != pb.ROLE_DECODE:
            raise PermissionDenied("a holder token registers decode instances only",
                                   field="role")
        deny_holder(principal, request.engine_id, "engine_id")
    elif principal.role == "reader" and request.role != pb.ROLE_PREFILL:
        raise PermissionDenied("a reader token registers prefill instances only", field="role")


RULES: dict[str, Rule] = {
    "RegisterInstance": rule(*_ENGINES, check=_register),
    "HeartbeatInstance": rule(*_ENGINES),
    "DeregisterInstance": rule(*_ENGINES),
    "ListInstances": rule("gateway"),
    "Route": rule("gateway", tenant_field="tenant"),
    "GetServerInfo": rule("holder", "reader", "gateway", "router", "tenant"),
    "AcquireRead": rule("reader", "gateway", tenant_field="tenant"),
    "ReleaseRead": rule("reader", "gateway"),
}
