"""The routing policy: live instances, their load, and where each turn goes. Transport-free,
with an injected clock, so that it is tested over many instances without servers.

Load is what an instance last reported (running and waiting requests, KV usage, tokens in
flight) plus the turns routed to it since that report, so that a burst between two heartbeats
does not all land on the instance that looked idlest.

Where a turn with no usable lease goes (a new conversation, or one whose lease is gone): its
conversation stays on that decode for its later turns, and decode retains its KV between them,
so memory decides among the decodes that can serve it now. Of the decodes whose queue is within
`decode_load_margin` of the shortest (the same tolerance that keeps a turn on its lease
holder), the one with the least KV in use, in steps of KV_USAGE_STEP of its pool (closer than
that is noise, and the shorter queue decides), counting the prompts of turns placed there since
its report at the KV capacity it reported (a decode that reports none: at the median of those
that do); then the shorter queue, then the exact KV in use, then the name. Queue alone would
place conversations by a snapshot of requests that finish in seconds, while what they leave
behind stays for minutes: one decode fills and revokes while the other idles. Where no decode
reports its capacity, placements between reports cannot be counted, and the queue (which counts
them) comes first, as it did before capacities were reported.

Ownership (with authentication; in insecure local mode every caller is the same admin, and
nothing below changes anything):
- An instance belongs to the principal (token) that registered it. Only that principal, or an
  admin, heartbeats, deregisters or re-registers (replaces) it; anyone else gets
  PERMISSION_DENIED with reason INSTANCE_OWNED, and nothing changes.
- An engine id that a live instance of another principal uses is refused (ENGINE_ID_TAKEN),
  with one exception against squatting: a principal *entitled* to the engine id (a holder token
  whose holder= scope names it, or an admin) displaces a live instance whose owner is not
  entitled to that instance's own engine id (e.g. a reader token that took `decode-1`).
- Tenants: a turn of tenant T is routed only to instances whose owner may serve T, i.e. whose
  token's tenants= scope matches T; tokens without tenants= serve every tenant. So a
  tenant-scoped engine token can register engines, but only its own tenants' turns reach them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import structlog

from kvbridge.auth import LOCAL_ADMIN, Principal
from kvbridge.clock import Clock
from kvbridge.errors import InstanceNotFound, InvalidArgument, NoInstance, PermissionDenied
from kvbridge.services.registry import _validate as check
from kvbridge.services.router._config import RouterConfig

log = structlog.get_logger("kvbridge.router")

# KV usages closer than this fraction of a pool are equal for placement: the shorter queue
# decides between them.
KV_USAGE_STEP = 0.05


class InstanceOwned(PermissionDenied):
    """The instance belongs to another principal: only it (or an admin) may heartbeat,
    deregister or replace it."""

    reason = "INSTANCE_OWNED"


class EngineIdTaken(PermissionDenied):
    """A live instance of another principal uses this engine id."""

    reason = "ENGINE_ID_TAKEN"


def entitled(principal: Principal, engine_id: str) -> bool:
    """Whether `principal`'s own scope names `engine_id`: an admin, or a holder token whose
    holder= scope matches it. Such a claim outranks one by a principal whose scope does not."""
    return principal.is_admin or (principal.role == "holder" and principal.may_hold(engine_id))


class Role(enum.IntEnum):  # the values of kvbridge.router.v1.Role
    PREFILL = 1
    DECODE = 2


class DecodeReason(enum.IntEnum):  # the values of kvbridge.router.v1.DecodeReason
    HOLDS_LEASE = 1
    NO_LEASE = 2
    HOLDER_OVERLOADED = 3
    HOLDER_UNAVAILABLE = 4
    REGISTRY_UNAVAILABLE = 5


@dataclass(slots=True)
class Load:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    tokens_in_flight: int = 0
    kv_capacity_tokens: int = 0  # 0: unknown


@dataclass(slots=True)
class InstanceSpec:
    instance_id: str
    role: Role
    http_url: str
    engine_id: str
    model: str
    nixl_host: str = ""
    nixl_port: int = 0
    ttl: float = 0.0  # 0: the router's default


@dataclass(slots=True)
class Instance:
    spec: InstanceSpec
    ttl: float
    expire_at: float
    load: Load = field(default_factory=Load)
    routed: int = 0  # turns routed here since the last heartbeat
    routed_tokens: int = 0
    placed_tokens: int = 0  # prompts of turns placed here without a lease since the heartbeat
    owner: Principal = LOCAL_ADMIN  # who registered it

    def managed_by(self, caller: Principal) -> bool:
        """An admin, or the token that registered it: the same name and role (its scopes may
        have changed since, with a token file reloaded)."""
        return caller.is_admin or (caller.name, caller.role) == (self.owner.name,
                                                                 self.owner.role)

    @property
    def squatted(self) -> bool:
        """Its owner is not entitled to its engine id: an entitled principal may displace it."""
        return not entitled(self.owner, self.spec.engine_id)

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @property
    def queue(self) -> int:
        """Requests it has or is about to get."""
        return self.load.running + self.load.waiting + self.routed

    @property
    def tokens(self) -> int:
        return self.load.tokens_in_flight + self.routed_tokens

    def kv_usage(self, fallback_capacity: int = 0) -> float:
        """KV usage as reported, plus the prompts placed here since, at the capacity reported
        (else `fallback_capacity`; neither: not counted): a burst of new conversations between
        two reports does not all land on one decode."""
        capacity = self.load.kv_capacity_tokens or fallback_capacity
        placed = self.placed_tokens / capacity if capacity else 0.0
        return self.load.kv_usage + placed


@dataclass(slots=True)
class Decision:
    prefill: Instance
    decode: Instance
    decode_reason: DecodeReason
    lease_holder: str  # "" when the conversation has no lease (or it is unknown)
    explanation: str


class InstanceTable:
    """Registered instances of one router."""

    def __init__(self, config: RouterConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self._instances: dict[str, Instance] = {}
        self._dead_engines: dict[str, float] = {}  # engine id -> when it stopped heartbeating

    # ---- membership -------------------------------------------------------------------------

    def check_spec(self, spec: InstanceSpec) -> float:
        """InvalidArgument unless `spec` is well formed (nothing about other instances); its
        TTL."""
        cfg = self.config
        check.identifier("instance_id", spec.instance_id, cfg.max_id_length)
        check.identifier("engine_id", spec.engine_id, cfg.max_id_length)
        check.identifier("model", spec.model, cfg.max_id_length)
        if spec.role not in (Role.PREFILL, Role.DECODE):
            raise InvalidArgument("role", "must be ROLE_PREFILL or ROLE_DECODE")
        if not spec.http_url.startswith(("http://", "https://")) or " " in spec.http_url:
            raise InvalidArgument("http_url", "must be an http:// or https:// URL")
        if len(spec.http_url) > 2048:
            raise InvalidArgument("http_url", "longer than 2048 characters")
        if spec.nixl_host and len(spec.nixl_host) > cfg.max_id_length:
            raise InvalidArgument("nixl_host", f"longer than {cfg.max_id_length} characters")
        check.in_range("nixl_port", spec.nixl_port, 0, 65535)
        ttl = spec.ttl or cfg.default_instance_ttl_s
        check.duration("ttl", ttl, cfg.min_instance_ttl_s, cfg.max_instance_ttl_s)
        return ttl

    def register(self, spec: InstanceSpec, owner: Principal = LOCAL_ADMIN) -> Instance:
        """Add or replace (same instance id) an instance owned by `owner`; see the module
        docstring for who may replace what."""
        ttl = self.check_spec(spec)
        self.expire()
        may_displace = entitled(owner, spec.engine_id)
        previous = self._instances.get(spec.instance_id)
        # Another principal's instance of this id is taken over only from a squatter of an
        # engine id the caller itself is entitled to (not whatever id the caller now names).
        if previous is not None and not previous.managed_by(owner) and not (
                entitled(owner, previous.spec.engine_id) and previous.squatted):
            raise InstanceOwned(f"instance {spec.instance_id!r} belongs to another principal",
                                instance_id=spec.instance_id)
        displaced: list[Instance] = []
        for other in self._instances.values():
            if (other.spec.engine_id != spec.engine_id
                    or other.instance_id == spec.instance_id):
                continue
            if other.managed_by(owner):
                raise InvalidArgument("engine_id", f"already registered by instance "
                                      f"{other.instance_id!r}", engine_id=spec.engine_id)
            if not (may_displace and other.squatted):
                raise EngineIdTaken(f"engine id {spec.engine_id!r} is registered by another "
                                    "principal's live instance", engine_id=spec.engine_id)
            displaced.append(other)
        now = self.clock.monotonic()
        for other in displaced:
            del self._instances[other.instance_id]
            log.warning("instance_displaced", instance=other.instance_id,
                        engine_id=other.spec.engine_id, owner=other.owner.name, by=owner.name)
        instance = Instance(spec, ttl, now + ttl, owner=owner)
        if previous is not None and previous.spec.engine_id != spec.engine_id:
            self._dead_engines[previous.spec.engine_id] = now  # replaced: the old engine is gone
        self._instances[spec.instance_id] = instance
        self._dead_engines.pop(spec.engine_id, None)
        log.info("instance_registered", instance=spec.instance_id, role=spec.role.name.lower(),
                 url=spec.http_url, engine_id=spec.engine_id, model=spec.model, ttl_s=ttl,
                 again=previous is not None, owner=owner.name)
        return instance

    def heartbeat(self, instance_id: str, load: Load, caller: Principal = LOCAL_ADMIN
                  ) -> Instance:
        check.identifier("instance_id", instance_id, self.config.max_id_length)
        if load.running < 0 or load.waiting < 0 or load.tokens_in_flight < 0:
            raise InvalidArgument("load", "counts must not be negative")
        if not 0.0 <= load.kv_usage <= 1.0:  # also rejects NaN
            raise InvalidArgument("load.kv_usage", "must be between 0 and 1")
        if load.kv_capacity_tokens < 0:
            raise InvalidArgument("load.kv_capacity_tokens", "must not be negative")
        self.expire()
        instance = self._instances.get(instance_id)
        if instance is None:
            raise InstanceNotFound(f"no instance {instance_id!r}: register again",
                                   instance_id=instance_id)
        self._check_owner(instance, caller)
        if not caller.is_admin:
            instance.owner = caller  # its scopes as they are now (routing reads them)
        instance.load = load
        instance.routed = instance.routed_tokens = instance.placed_tokens = 0
        instance.expire_at = self.clock.monotonic() + instance.ttl
        return instance

    def deregister(self, instance_id: str, caller: Principal = LOCAL_ADMIN) -> bool:
        check.identifier("instance_id", instance_id, self.config.max_id_length)
        instance = self._instances.get(instance_id)
        if instance is None:
            return False
        self._check_owner(instance, caller)
        del self._instances[instance_id]
        self._dead_engines[instance.spec.engine_id] = self.clock.monotonic()
        log.info("instance_deregistered", instance=instance_id)
        return True

    @staticmethod
    def _check_owner(instance: Instance, caller: Principal) -> None:
        if not instance.managed_by(caller):
            raise InstanceOwned(f"instance {instance.instance_id!r} belongs to another "
                                "principal", instance_id=instance.instance_id)

    def expire(self) -> list[Instance]:
        """Drop instances past their TTL (and forget long-dead engines). Returns those dropped."""
        now = self.clock.monotonic()
        dropped = [i for i in self._instances.values() if i.expire_at <= now]
        for instance in dropped:
            del self._instances[instance.instance_id]
            self._dead_engines[instance.spec.engine_id] = now
            log.warning("instance_lost", instance=instance.instance_id,
                        role=instance.spec.role.name.lower(),
                        late_ms=round((now - instance.expire_at) * 1000, 1))
        memory = self.config.dead_engine_memory_s
        for engine_id in [e for e, at in self._dead_engines.items() if now - at > memory]:
            del self._dead_engines[engine_id]
        return dropped

    def instances(self, role: Role | None = None, model: str = "") -> list[Instance]:
        self.expire()
        return sorted((i for i in self._instances.values()
                       if (role is None or i.spec.role == role)
                       and (not model or i.spec.model == model)),
                      key=lambda i: (i.spec.role, i.instance_id))

    def engine_is_dead(self, engine_id: str) -> bool:
        """True when this engine was an instance here and stopped heartbeating or left."""
        self.expire()
        return engine_id in self._dead_engines

    def time_left(self, instance: Instance) -> float:
        return max(instance.expire_at - self.clock.monotonic(), 0.0)

    # ---- routing ----------------------------------------------------------------------------

    def route(self, prompt_tokens: int, model: str, lease_holder: str | None,
              exclude: Collection[str] = (), tenant: str | None = None) -> Decision:
        """Pick prefill and decode for one turn. `lease_holder` is the engine id holding the
        conversation's lease ("" when it has none), or None when the registry could not say.
        Instances in `exclude` are not picked, nor, for a `tenant`, instances whose owner may
        not serve it."""
        check.in_range("prompt_tokens", prompt_tokens, 0, 2**31)
        if model:
            check.identifier("model", model, self.config.max_id_length)
        if len(exclude) > 64:
            raise InvalidArgument("exclude_instance_ids", "at most 64")
        prefills = [i for i in self.instances(Role.PREFILL, model)
                    if i.instance_id not in exclude
                    and (tenant is None or i.owner.may_tenant(tenant))]
        decodes = [i for i in self.instances(Role.DECODE, model)
                   if i.instance_id not in exclude
                   and (tenant is None or i.owner.may_tenant(tenant))]
        if not prefills or not decodes:
            missing = "prefill" if not prefills else "decode"
            raise NoInstance(f"no live {missing} instance" + (f" serves {model!r}" if model
                                                                else ""),
                             role=missing, model=model)
        prefill = min(prefills, key=lambda i: (i.queue, i.tokens, i.instance_id))
        margin = self.config.decode_load_margin
        shortest = min(i.queue for i in decodes)
        least = min((i for i in decodes if i.queue - shortest <= margin),
                    key=_placement_key(decodes))
        decode, reason, why = least, DecodeReason.NO_LEASE, "no lease: least KV in use"
        if lease_holder is None:
            reason = DecodeReason.REGISTRY_UNAVAILABLE
            why = "registry unavailable: least KV in use"
        elif lease_holder:
            holder = next((i for i in decodes if i.spec.engine_id == lease_holder), None)
            if holder is None:
                reason = DecodeReason.HOLDER_UNAVAILABLE
                why = f"lease holder {lease_holder} is not a live instance: least KV in use"
            elif (holder.queue - shortest > margin
                  or holder.load.kv_usage >= self.config.decode_max_kv_usage):
                reason = DecodeReason.HOLDER_OVERLOADED
                why = (f"lease holder {holder.instance_id} is overloaded (queue {holder.queue}, "
                       f"KV {holder.load.kv_usage:.0%}; shortest {shortest}): least KV in use")
            else:
                decode, reason = holder, DecodeReason.HOLDS_LEASE
                why = (f"{holder.instance_id} holds the lease (queue {holder.queue}, shortest "
                       f"{shortest})")
        prefill.routed += 1
        prefill.routed_tokens += prompt_tokens
        decode.routed += 1
        if decode.spec.engine_id != lease_holder:  # a holder has this history already
            decode.placed_tokens += prompt_tokens
        return Decision(prefill, decode, reason, lease_holder or "",
                        f"decode {decode.instance_id}: {why}; prefill {prefill.instance_id}: "
                        f"least loaded (queue {prefill.queue - 1})")


def _placement_key(decodes: list[Instance]) -> Callable[[Instance], tuple[Any, ...]]:
    """How decodes are ordered for a turn with no usable lease (see the module docstring)."""
    capacities = sorted(i.load.kv_capacity_tokens for i in decodes if i.load.kv_capacity_tokens)
    if not capacities:
        return lambda i: (i.queue, i.load.kv_usage, i.instance_id)
    median = capacities[len(capacities) // 2]

    def key(i: Instance) -> tuple[Any, ...]:
        usage = i.kv_usage(median)
        return (math.floor(usage / KV_USAGE_STEP + 1e-9), i.queue, usage, i.instance_id)
    return key
