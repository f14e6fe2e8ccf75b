"""A read pinned when the turn was routed, as it travels from the gateway to the prefill engine.

The gateway asks the router to pin the conversation's whole lease while routing the turn
(`RouteRequest.pin_read`) and puts the answer in the prefill request's
`kv_transfer_params["kvbridge"]["read"]` as JSON:

    {"pin_id": "p-...", "expires_in_s": 9.98, "sent": {"boot": "<boot id>", "clock": 5123.4},
     "lease_id": "l-...", "epoch": 3,
     "token_count": 1123, "remote_request_id": "kvbridge-...",
     "holder": {"id": "decode-0", "host": "10.0.0.7", "port": 5600, "tp_size": 1,
                "block_size": 32},
     "block_ids": [...], "block_hashes": "<base64 of 16 bytes per block>",
     "partial": {"block_id": 91, "tokens": 3, "hash": "<base64>"}}

or, when there is nothing to read, `{"miss": "no_lease"}` (the registry's miss reason).
`"released_by": "gateway"` says the gateway releases the pin once prefill answers: an engine
that decides before any read not to read (say, recomputing is cheaper) then leaves the pin and
says so in its answer (`PIN_LEFT`), instead of releasing it itself from inside the engine
process, next to its compute.

The prefill connector checks its own prompt's chained hashes against `block_hashes` and reuses
only the leading blocks that match (and the partial block only when its hash matches too): the
registry's answer is verified locally, so it needs no lookup call on the request's path.
Durations cross the wire as the authority: `expires_in_s` is what was left of the pin when the
gateway sent the request. The request then spends time in transit and in the prefill engine
(its API server, its input queue: up to a whole engine step) before the connector sees it, and
that time comes off the pin too. `sent` says when, on the gateway's clock, and on which host
(its boot id): a prefill engine on the same host counts the pin from that moment exactly; one
on another host cannot compare clocks, and takes the pin to end `ROUTED_TRANSIT_SLACK_S`
sooner than counted from when it saw the request.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from typing import Any

from kvbridge import blockhash
from kvbridge.clients import seconds
from kvbridge.clock import boot_id, monotonic
from kvbridge.registry.v1 import registry_pb2 as pb

READ_KEY = "read"
RELEASED_BY = "released_by"
# In prefill's answer (kv_transfer_params): the engine left the routed pin to the gateway.
PIN_LEFT = "kvbridge_pin_left"
# In prefill's answer: whether the prompt held all of the read lease's tokens (verified by
# hash), so that the turn continues the lease's conversation rather than branching from it.
LEASE_WHOLE = "kvbridge_lease_whole"
# A routed read seen by a prefill engine on another host than the gateway's: the time it spent
# on its way (HTTP, the engine's API server and input queue), taken off its pin.
ROUTED_TRANSIT_SLACK_S = 1.0
_BOOT = boot_id()
_MAX_EXPIRES_IN_S = 86400.0  # far above any pin TTL a registry grants


def routed_read(pinned: pb.PinLeaseResponse, received: float, *,
                gateway_releases: bool = False) -> dict[str, Any]:
    """The JSON form of the router's pinned read, received at `received` (`monotonic()`),
    as of now: what is left of the pin (rounded down), and now as `sent`. With
    `gateway_releases`, the sender releases the pin once prefill answers, so an engine that
    decides not to read need not (`RELEASED_BY`)."""
    now = monotonic()
    read = pinned.read
    if not read.pin.pin_id:
        reason = pb.MissReason.Name(read.miss_reason).removeprefix("MISS_REASON_").lower()
        return {"miss": reason if read.miss_reason else "no_pin"}
    out: dict[str, Any] = {
        "pin_id": read.pin.pin_id,
        "expires_in_s": math.floor(max(seconds(read.pin.expires_in) - (now - received), 0.0)
                                   * 1e4) / 1e4,
        "sent": {"boot": _BOOT, "clock": now},
        "lease_id": read.lease.lease_id,
        "epoch": read.lease.epoch,
        "token_count": read.lease.token_count,
        "remote_request_id": read.lease.remote_request_id,
        "holder": {"id": read.holder.holder_id, "host": read.holder.nixl_host,
                   "port": read.holder.nixl_port, "tp_size": read.holder.tp_size or 1,
                   "block_size": read.holder.block_size},
        "block_ids": list(read.remote_block_ids),
        "block_hashes": base64.b64encode(pinned.block_hashes).decode("ascii"),
    }
    if gateway_releases:
        out[RELEASED_BY] = "gateway"
    if read.partial_block_tokens:
        out["partial"] = {"block_id": read.partial_block_id,
                          "tokens": read.partial_block_tokens,
                          "hash": base64.b64encode(read.partial_block_hash).decode("ascii")}
    return out


def routed_pin_base(routed: Mapping[str, Any], seen: float) -> tuple[float, bool]:
    """When a routed read's `expires_in_s` counts from, on this host's clock, for a request
    this engine saw at `seen`; and whether that is exact (the gateway is on this host)."""
    sent = routed.get("sent")
    if isinstance(sent, Mapping) and _BOOT and sent.get("boot") == _BOOT:
        clock = sent.get("clock")
        if isinstance(clock, (int, float)) and not isinstance(clock, bool):
            try:
                at = float(clock)  # an int too large for a float: OverflowError
            except OverflowError:
                at = math.inf
            if math.isfinite(at) and at <= seen:
                return at, True
    return seen - ROUTED_TRANSIT_SLACK_S, False


class BadRoutedRead(ValueError):
    """The routed read is malformed: the connector ignores it and looks the lease up itself."""


def _int(value: Any, name: str, lo: int = 0, hi: int = 2**32 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRoutedRead(f"{name} must be an integer in [{lo}, {hi}]")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise BadRoutedRead(f"{name} must be a non-empty string")
    return value


def _b64(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise BadRoutedRead(f"{name} must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as err:
        raise BadRoutedRead(f"{name}: {err}") from None


def verified_read(routed: Mapping[str, Any], prompt_hashes: bytes
                  ) -> tuple[pb.AcquireReadResponse, str | None]:
    """Check the prompt's full-block hashes against a routed read, as the registry's
    AcquireRead would: returns the equivalent AcquireReadResponse (matched blocks cut to those
    whose hashes agree; the partial block kept only when every full block matched, for the
    caller to verify) and, when the match left nothing to read, the pin to release."""
    if not isinstance(routed, Mapping):
        raise BadRoutedRead("read must be an object")
    if "miss" in routed:
        miss = routed["miss"]
        if not isinstance(miss, str):
            raise BadRoutedRead("miss must be a string")
        name = f"MISS_REASON_{miss.upper()}"
        known = (name in pb.MissReason.DESCRIPTOR.values_by_name
                 and name != "MISS_REASON_UNSPECIFIED")
        return pb.AcquireReadResponse(miss_reason=pb.MissReason.Value(name) if known
                                      else pb.MISS_REASON_NO_LEASE), None
    expires_in = routed.get("expires_in_s")
    if isinstance(expires_in, bool) or not isinstance(expires_in, (int, float)) or not (
            0 <= expires_in <= _MAX_EXPIRES_IN_S):  # (NaN compares false; a huge int is out)
        raise BadRoutedRead(f"expires_in_s must be a number in [0, {_MAX_EXPIRES_IN_S:g}]")
    holder = routed.get("holder")
    if not isinstance(holder, Mapping):
        raise BadRoutedRead("holder must be an object")
    block_ids = routed.get("block_ids")
    if not isinstance(block_ids, list):
        raise BadRoutedRead("block_ids must be a list")
    ids = [_int(b, "block_ids[]") for b in block_ids]
    lease_hashes = _b64(routed.get("block_hashes"), "block_hashes")
    if len(lease_hashes) != len(ids) * blockhash.HASH_SIZE:
        raise BadRoutedRead("block_hashes must hold one 16-byte hash per block id")
    block_size = _int(holder.get("block_size"), "holder.block_size", 1, 1 << 16)
    token_count = _int(routed.get("token_count"), "token_count")
    partial = routed.get("partial")
    if partial is not None and not isinstance(partial, Mapping):
        raise BadRoutedRead("partial must be an object")
    if token_count != len(ids) * block_size + (
            _int(partial.get("tokens"), "partial.tokens", 1, block_size - 1) if partial else 0):
        raise BadRoutedRead("token_count does not match the blocks")
    pin_id = _str(routed.get("pin_id"), "pin_id")

    k = blockhash.matching_prefix(lease_hashes, prompt_hashes)
    out = pb.AcquireReadResponse()
    out.lease.lease_id = _str(routed.get("lease_id"), "lease_id")
    out.lease.epoch = _int(routed.get("epoch"), "epoch", 0, 2**63 - 1)
    out.lease.token_count = token_count
    out.lease.remote_request_id = _str(routed.get("remote_request_id"), "remote_request_id")
    out.holder.holder_id = _str(holder.get("id"), "holder.id")
    out.holder.nixl_host = _str(holder.get("host"), "holder.host")
    out.holder.nixl_port = _int(holder.get("port"), "holder.port", 1, 65535)
    out.holder.tp_size = _int(holder.get("tp_size", 1), "holder.tp_size", 1, 1024)
    out.holder.block_size = block_size
    if partial and k == len(ids):
        out.partial_block_id = _int(partial.get("block_id"), "partial.block_id")
        out.partial_block_tokens = partial["tokens"]
        out.partial_block_hash = _b64(partial.get("hash"), "partial.hash")
    if k == 0 and not out.partial_block_tokens:
        out.miss_reason = (pb.MISS_REASON_HASH_MISMATCH if ids
                           else pb.MISS_REASON_BELOW_MINIMUM)
        return out, pin_id
    out.matched_blocks = k
    out.matched_tokens = k * block_size
    out.remote_block_ids.extend(ids[:k])
    out.pin.pin_id = pin_id
    out.pin.expires_in.FromNanoseconds(int(expires_in * 1e9))
    return out, None
