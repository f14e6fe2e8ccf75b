"""Who may call each registry method (see `kvbridge.auth` for the roles and the token table).

Checks that need only the request run here, before the servicer; checks against a stored lease
(whose holder and tenant a lease id does not show) run in the servicer through `may_touch`.
"""

from __future__ import annotations

from typing import Any

from kvbridge import auth
from kvbridge.auth import Principal, Rule, deny_holder, deny_tenant, rule
from kvbridge.errors import PermissionDenied
from kvbridge.services.registry._model import Lease

_ALL = ("holder", "reader", "gateway", "router", "tenant")
_LEASE_MANAGERS = ("holder", "gateway", "router", "tenant")
_READERS = ("reader", "gateway", "router")


def _holder_field(principal: Principal, request: Any) -> None:
    deny_holder(principal, request.holder_id)


def _holder_if_named(principal: Principal, request: Any) -> None:
    if request.holder_id:
        deny_holder(principal, request.holder_id)


def _grant(principal: Principal, request: Any) -> None:
    deny_holder(principal, request.holder_id)
    deny_tenant(principal, request.tenant)


def _register(principal: Principal, request: Any) -> None:
    deny_holder(principal, request.holder_id)
    for i, held in enumerate(request.held_leases):
        deny_tenant(principal, held.tenant, f"held_leases[{i}].tenant")


def _renew(principal: Principal, request: Any) -> None:
    if principal.role == "holder" and request.conversations:
        raise PermissionDenied("a holder renews its leases by lease id, not by conversation",
                               field="conversations")
    for i, ref in enumerate(request.conversations):
        deny_tenant(principal, ref.tenant, f"conversations[{i}].tenant")


def _scope_listing(principal: Principal, request: Any) -> None:
    """Listing and watching are scoped: a holder sees its own leases, a tenant-limited caller
    its own tenants'. An unset filter is filled in when the scope names exactly one."""
    if principal.role == "holder":
        if not request.holder_id:
            request.holder_id = principal.single_holder
            if not request.holder_id:
                raise PermissionDenied("name the holder_id to list (this token covers several)",
                                       field="holder_id")
        deny_holder(principal, request.holder_id)
    if principal.tenants is not None:
        if not request.tenant:
            request.tenant = principal.single_tenant
            if not request.tenant:
                raise PermissionDenied("name the tenant to list (this token covers several)",
                                       field="tenant")
        deny_tenant(principal, request.tenant)


RULES: dict[str, Rule] = {
    "RegisterHolder": rule("holder", check=_register),
    "HeartbeatHolder": rule("holder", check=_holder_field),
    "DeregisterHolder": rule("holder", check=_holder_field),
    "ListHolders": rule(),  # admin only: holders' NIXL endpoints
    "GrantLease": rule("holder", check=_grant),
    "RenewLeases": rule(*_LEASE_MANAGERS, check=_renew),
    "RevokeLease": rule(*_LEASE_MANAGERS, check=_holder_if_named),
    "GetLease": rule(*_LEASE_MANAGERS),
    "ListLeases": rule(*_LEASE_MANAGERS, check=_scope_listing),
    "AcquireRead": rule(*_READERS, tenant_field="tenant"),
    "PinLease": rule(*_READERS, tenant_field="tenant"),
    "ReleaseRead": rule(*_READERS),  # a pin id is an unguessable capability (kvbridge.ids)
    "GetServerInfo": rule(*_ALL),
    "WatchLeases": rule(*_LEASE_MANAGERS, check=_scope_listing),
}


def may_touch(lease: Lease) -> None:
    """Raise PermissionDenied unless the current caller may see or change `lease`."""
    principal = auth.current()
    if principal.is_admin:
        return
    if principal.role == "holder" and not principal.may_hold(lease.holder.holder_id):
        raise PermissionDenied(f"lease {lease.lease_id!r} belongs to another holder",
                               lease_id=lease.lease_id)
    if not principal.may_tenant(lease.tenant):
        raise PermissionDenied(f"lease {lease.lease_id!r} belongs to another tenant",
                               lease_id=lease.lease_id)


def scoped() -> bool:
    """Whether the current caller is limited to some holders or tenants (so leases named by id
    must be checked one by one)."""
    principal = auth.current()
    return principal.role == "holder" or principal.tenants is not None
