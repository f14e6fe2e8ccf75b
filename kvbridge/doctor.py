"""`kvbridge doctor`: check a running deployment, say what is wrong and how to fix it.

Passive checks ask the registry and the router what they know (versions, clocks, holders and
their heartbeats, instances, engine health). The probe then runs a two-turn conversation
through the gateway and reads what prefill decided on turn 2 (the `X-Kvbridge-*` headers), which
is where the failures users of disaggregated KV reuse actually hit show up: no decision at all
(the connector is not loaded on prefill), no lease (not loaded on decode, or the conversation
key never reaches it), a hash mismatch at block 0 (engines with a different model, dtype or
block size), an expired lease (idle TTL shorter than the user's think time), a failed or slow
NIXL read. Exit status 1 when anything is wrong.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

import click

from kvbridge import __version__
from kvbridge.auth import TOKEN_ENV
from kvbridge.clients._cli import address_callback

OK, WARN, FAIL = "ok", "warn", "fail"
_CLOCK_SKEW_S = 2.0


@dataclass
class Finding:
    level: str  # ok | warn | fail
    check: str
    message: str
    fix: str = ""


@dataclass
class Turn:
    """What the gateway said about one probe turn."""

    status: int
    decision: str | None
    reused: int = 0
    recomputed: int = 0
    prefill_ms: float = 0.0
    transfer_ms: float | None = None
    mismatch_block: int | None = None
    prefill: str = ""
    decode: str = ""
    error: str = ""
    text: str = ""


def _skew(check: str, version: str, server_time: float, now: float) -> list[Finding]:
    out = []
    mine, theirs = __version__, version
    if theirs != mine:
        out.append(Finding(WARN, check, f"runs kvbridge {theirs}, this CLI is {mine}",
                           "run the same kvbridge release everywhere"))
    skew = server_time - now
    if abs(skew) > _CLOCK_SKEW_S:
        out.append(Finding(WARN, check, f"its clock is {skew:+.1f}s off this machine's",
                           "sync clocks (NTP); leases use durations and stay correct, but "
                           "expire_time fields and logs will mislead"))
    return out


def check_holders(holders: list[Any], decode_engines: set[str] | None) -> list[Finding]:
    """Registered decode engines: heartbeats, layouts, versions, and whether the router knows
    them. `decode_engines`: engine ids the router has as decode instances (None: no router)."""
    out: list[Finding] = []
    if not holders:
        out.append(Finding(FAIL, "holders", "no decode engine is registered with the registry",
                           "start decode engines with the connector (kv_connector "
                           "KVBridgeConnector) and kvbridge.registry set"))
        return out
    layouts = {(h.block_size, h.engine_fingerprint) for h in holders}
    if len(layouts) > 1:
        out.append(Finding(WARN, "holders",
                           f"decode engines disagree on block size / fingerprint: "
                           f"{sorted((b, f[:12]) for b, f in layouts)}",
                           "KV is only reusable between engines with the same model, dtype, "
                           "block size and tp: start them alike"))
    for h in holders:
        ttl = h.ttl.seconds + h.ttl.nanos / 1e9
        left = h.expires_in.seconds + h.expires_in.nanos / 1e9
        if h.state == 1 and ttl and left < ttl / 3:
            out.append(Finding(FAIL, "holders",
                               f"{h.holder_id} is registered but not heartbeating "
                               f"({left:.1f}s left of a {ttl:.0f}s TTL)",
                               "the engine is stuck or cannot reach the registry; its KV "
                               "will be dropped when the TTL runs out"))
        version = h.software_version.split()[0].removeprefix("kvbridge/") \
            if h.software_version else ""
        if version and version != __version__:
            out.append(Finding(WARN, "holders", f"{h.holder_id} runs kvbridge {version} "
                               f"({h.software_version}), this CLI is {__version__}",
                               "run the same kvbridge release everywhere"))
        if decode_engines is not None and h.state == 1 and h.holder_id not in decode_engines:
            out.append(Finding(WARN, "holders",
                               f"{h.holder_id} holds KV but is not a decode instance of the "
                               "router: conversations are not routed back to it",
                               "attach it to the router (kvbridge engine run --router ...)"))
    if not [f for f in out if f.check == "holders"]:
        out.append(Finding(OK, "holders", f"{len(holders)} decode engine(s) registered and "
                           "heartbeating"))
    return out


def check_instances(instances: list[Any], holder_ids: set[str] | None,
                    health: dict[str, str | None]) -> list[Finding]:
    """Router instances: both roles present, decode instances registered as holders, engines
    healthy. `health`: instance id -> None when /health answered 200, else the error."""
    out: list[Finding] = []
    roles = {1: "prefill", 2: "decode"}
    for number, role in roles.items():
        if not any(i.role == number for i in instances):
            out.append(Finding(FAIL, "instances", f"no live {role} instance at the router",
                               f"start a {role} engine attached to the router (kvbridge "
                               "engine run --router ..., or kvbridge up --cpu-engines)"))
    for i in instances:
        error = health.get(i.instance_id)
        if error:
            out.append(Finding(FAIL, "engines", f"{roles.get(i.role, '?')} {i.instance_id} at "
                               f"{i.http_url} is not healthy: {error}",
                               "check the engine's log; the router drops it once its "
                               "heartbeats stop"))
        if i.role == 2 and holder_ids is not None and i.engine_id not in holder_ids:
            out.append(Finding(FAIL, "instances",
                               f"decode {i.instance_id} (engine {i.engine_id}) is not a "
                               "registry holder: its KV is never leased",
                               "load the connector on it (kv_connector KVBridgeConnector, "
                               "kv_connector_module_path kvbridge.connector) with "
                               "kvbridge.registry set, and the same engine_id"))
    if not out:
        out.append(Finding(OK, "instances", f"{len(instances)} instance(s), all healthy"))
    return out


def diagnose_probe(first: Turn, second: Turn | None, lease_seen: bool) -> list[Finding]:
    """What two probe turns say about the data path."""
    where = f"prefill {first.prefill} / decode {first.decode}"
    if first.status != 200:
        return [Finding(FAIL, "probe", f"turn 1 failed: HTTP {first.status} {first.error}",
                        "see the gateway's log line for this request")]
    if first.decision is None:
        return [Finding(FAIL, "probe",
                        f"prefill {first.prefill} reported no kvbridge decision: the connector "
                        "is not loaded there, or it has neither kvbridge.registry nor "
                        "kvbridge.router",
                        "start prefill with kv_connector KVBridgeConnector, "
                        "kv_connector_module_path kvbridge.connector and kvbridge.registry (or "
                        "router) in kv_connector_extra_config")]
    if not lease_seen:
        return [Finding(FAIL, "probe",
                        f"decode {first.decode} granted no lease after turn 1: the connector "
                        "is not loaded on it, the conversation key does not reach it, or its "
                        "grants fail",
                        "check decode's log for lease_grant_failed / kvbridge_disabled; send "
                        "turns through the gateway (or carry kv_transfer_params.kvbridge on "
                        "both prefill and decode requests)")]
    if second is None or second.status != 200:
        return [Finding(FAIL, "probe", f"turn 2 failed: HTTP {second.status if second else '-'}"
                        f" {second.error if second else ''}",
                        "see the gateway's log line for this request")]
    d = second.decision or ""
    if d == "hit":
        out = [Finding(OK, "probe", f"turn 2 reused {second.reused} tokens from decode "
                       f"{second.decode} (read {second.transfer_ms} ms, {where})")]
        per_token_read = (second.transfer_ms or 0.0) / max(second.reused, 1)
        per_token_compute = first.prefill_ms / max(first.recomputed, 1)
        if second.transfer_ms is not None and per_token_read > per_token_compute:
            out.append(Finding(WARN, "nixl", f"reading KV ({per_token_read:.3f} ms/token) was "
                               f"slower than computing it ({per_token_compute:.3f} ms/token)",
                               "NIXL may be on TCP: check UCX_TLS / the NIXL backend between "
                               "engines (prefill, deciding by measured cost, recomputes "
                               "meanwhile once it has measured both)"))
        return out
    fixes = {
        "miss_hash_mismatch": None,
        "miss_expired": (WARN, "the lease expired before turn 2",
                         "raise kvbridge.idle_ttl_s on decode engines (a user's think time "
                         "plus tool calls), or have clients POST "
                         "/v1/conversations/{id}/keepalive while they pause"),
        "miss_no_lease": (FAIL, "no lease at turn 2 although decode granted one",
                          "a newer turn or a revocation replaced it: check decode's memory "
                          "pressure (kvbridge_connector_leases_revoked_total)"),
        "miss_holder_gone": (FAIL, "the lease's decode engine is gone or not heartbeating",
                             "check decode's health and its heartbeats to the registry"),
        "deadline": (WARN, "prefill's AcquireRead did not answer within read_deadline_s",
                     "raise kvbridge.read_deadline_s on prefill, or check the registry's and "
                     "router's latency and CPU"),
        "registry_error": (FAIL, "prefill cannot reach the registry or router",
                           "check kvbridge.registry / kvbridge.router on prefill and the "
                           "network between them"),
        "transfer_failed": (FAIL, "the NIXL read from decode failed",
                            "check NIXL between the engines: decode's side channel host and "
                            "port reachable from prefill, UCX transports (UCX_TLS), matching "
                            "kv_buffer_device"),
        "recompute_cheaper": (WARN, "prefill measured recomputing as faster than reading "
                              "here, so it did not read",
                              "expected on a small model or a short history; to see the "
                              "read path work regardless, run prefill with the connector "
                              "setting decision=threshold"),
        "declined_by_engine": (WARN, "prefill's engine declined the read",
                               "its own prefix cache held all the read would have brought, "
                               "or the engine's NIXL is older than the connector expects"),
        "pin_margin": (WARN, "the read's pin was about to end",
                       "raise kvbridge.pin_ttl_s or lower pin_margin_s"),
        "pin_margin_when_asked_again": (
            WARN, "the request waited for KV blocks on prefill until its pin ran low",
            "prefill is short of KV blocks (see its queue and kv cache usage), or raise "
            "kvbridge.pin_ttl_s"),
    }
    if d == "miss_hash_mismatch":
        k = second.mismatch_block or 0
        if k == 0:
            return [Finding(FAIL, "probe", "prefill and decode hash the same tokens differently "
                            "(mismatch at block 0)",
                            "start prefill and decode with the same model, dtype, block size "
                            "and tensor-parallel size (the engine fingerprint)")]
        return [Finding(WARN, "probe", f"turn 2's history differs from turn 1's at block {k}",
                        "the client rewrote earlier messages (e.g. stripped reasoning) or the "
                        "chat template renders history differently between turns")]
    if d in fixes and fixes[d] is not None:
        level, message, fix = fixes[d]  # type: ignore[misc]
        return [Finding(level, "probe", f"turn 2: {message} ({d})", fix)]
    return [Finding(WARN, "probe", f"turn 2 reused nothing ({d})",
                    "see prefill's prefill_decision log line for this request")]


# ---- running it -----------------------------------------------------------------------------


def _http(url: str, method: str = "GET", body: Any = None, api_key: str = "",
          timeout: float = 120) -> tuple[int, dict[str, str], Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, dict(resp.headers), json.loads(raw) if raw else None
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError:
            payload = raw.decode(errors="replace")
        return err.code, dict(err.headers), payload


def _turn(gateway: str, api_key: str, model: str, prompt: str, conversation: str) -> Turn:
    try:
        status, headers, body = _http(f"{gateway}/v1/completions", "POST", {
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "conversation_id": conversation}, api_key)
    except (urllib.error.URLError, OSError) as err:
        return Turn(0, None, error=str(err))
    h = {k.lower(): v for k, v in headers.items()}
    text = ""
    if status == 200 and isinstance(body, dict):
        text = body["choices"][0].get("text", "")
    transfer = h.get("x-kvbridge-transfer-ms")
    mismatch = h.get("x-kvbridge-mismatch-block")
    return Turn(status, h.get("x-kvbridge-decision"), int(h.get("x-kvbridge-reused-tokens", 0)),
                int(h.get("x-kvbridge-recomputed-tokens", 0)),
                float(h.get("x-kvbridge-prefill-ms", 0)),
                float(transfer) if transfer else None, int(mismatch) if mismatch else None,
                h.get("x-kvbridge-prefill-instance", ""), h.get("x-kvbridge-decode-instance", ""),
                error="" if status == 200 else str(body)[:300], text=text)


def probe(gateway: str, api_key: str, model: str = "", lease_wait_s: float = 10.0
          ) -> list[Finding]:
    try:
        status, _, body = _http(f"{gateway}/v1/models", api_key=api_key, timeout=10)
    except (urllib.error.URLError, OSError) as err:
        return [Finding(FAIL, "gateway", f"cannot reach the gateway at {gateway}: {err}",
                        "is `kvbridge gateway serve` (or `kvbridge up`) running there?")]
    if status != 200 or not isinstance(body, dict):
        return [Finding(FAIL, "gateway", f"GET /v1/models: HTTP {status} {body}",
                        "check the API key and the gateway's log")]
    models = [m["id"] for m in body.get("data") or []]
    if not models:
        return [Finding(FAIL, "gateway", "the gateway lists no model: no engine is attached",
                        "attach engines to the router")]
    model = model or models[0]
    rng = random.Random()
    words = "the cache keeps keys and values for every token of the conversation".split()
    prompt = " ".join(rng.choice(words) for _ in range(300))
    conversation = f"kvbridge-doctor-{int(time.time())}-{rng.randrange(10**6)}"
    first = _turn(gateway, api_key, model, prompt, conversation)
    lease_seen = False
    if first.status == 200 and first.decision is not None:
        deadline = time.monotonic() + lease_wait_s
        while time.monotonic() < deadline and not lease_seen:
            status, _, info = _http(f"{gateway}/v1/conversations/{conversation}",
                                    api_key=api_key, timeout=10)
            lease_seen = status == 200 and isinstance(info, dict) and info["state"] == "active"
            time.sleep(0.2)
    second = None
    if lease_seen:
        second = _turn(gateway, api_key, model, prompt + first.text + " and then some more "
                       "words for the next turn of the probe", conversation)
    _http(f"{gateway}/v1/conversations/{conversation}", "DELETE", api_key=api_key, timeout=10)
    return [Finding(OK, "gateway", f"{gateway} serves {', '.join(models)}"),
            *diagnose_probe(first, second, lease_seen)]


def run_checks(registry: str, router: str, gateway: str, api_key: str, model: str,
               do_probe: bool, lease_wait_s: float = 10.0) -> list[Finding]:
    from kvbridge.clients import RegistryClient
    from kvbridge.clients._router import RouterClient
    from kvbridge.errors import KvbridgeError

    findings: list[Finding] = []
    holders: list[Any] | None = None
    instances: list[Any] | None = None
    if registry:
        try:
            with RegistryClient(registry, timeout=3.0, retries=1,
                                token=os.environ.get(TOKEN_ENV) or None) as client:
                info = client.get_server_info()
                holders = list(client.iter_holders())
            now = time.time()
            findings.append(Finding(OK, "registry", f"{registry} is up (kvbridge "
                                    f"{info.version})"))
            findings += _skew("registry", info.version, info.current_time.seconds
                              + info.current_time.nanos / 1e9, now)
        except KvbridgeError as err:
            findings.append(Finding(FAIL, "registry", f"cannot reach the registry at "
                                    f"{registry}: {err.message}",
                                    "is `kvbridge registry serve` running there?"))
    if router:
        try:
            with RouterClient(router, timeout=3.0, retries=1,
                              token=os.environ.get(TOKEN_ENV) or None) as rclient:
                rinfo = rclient.get_server_info()
                instances = rclient.list_instances()
            now = time.time()
            findings.append(Finding(OK, "router", f"{router} is up (kvbridge {rinfo.version})"))
            findings += _skew("router", rinfo.version, rinfo.current_time.seconds
                              + rinfo.current_time.nanos / 1e9, now)
        except KvbridgeError as err:
            findings.append(Finding(FAIL, "router", f"cannot reach the router at {router}: "
                                    f"{err.message}", "is `kvbridge router serve` running?"))
    if holders is not None:
        decode_engines = ({i.engine_id for i in instances if i.role == 2}
                          if instances is not None else None)
        findings += check_holders(holders, decode_engines)
    if instances is not None:
        health: dict[str, str | None] = {}
        for i in instances:
            try:
                status, _, _ = _http(f"{i.http_url}/health", timeout=5)
                health[i.instance_id] = None if status == 200 else f"HTTP {status}"
            except (urllib.error.URLError, OSError) as err:
                health[i.instance_id] = str(err)
        findings += check_instances(instances, {h.holder_id for h in holders}
                                    if holders is not None else None, health)
    if gateway and do_probe:
        findings += probe(gateway, api_key, model, lease_wait_s)
    return findings


@click.command("doctor")
@click.option("--registry", default="127.0.0.1:50051", show_default=True,
              envvar="KVBRIDGE_REGISTRY", callback=address_callback(optional=True),
              help="registry HOST:PORT ('' to skip)")
@click.option("--router", default="127.0.0.1:50061", show_default=True,
              envvar="KVBRIDGE_ROUTER", callback=address_callback(optional=True),
              help="router HOST:PORT ('' to skip)")
@click.option("--gateway", default="http://127.0.0.1:8080", show_default=True,
              envvar="KVBRIDGE_GATEWAY", help="gateway URL for the probe ('' to skip)")
@click.option("--api-key", default="kvbridge-doctor", show_default=True,
              envvar="KVBRIDGE_API_KEY", help="API key for the probe conversation")
@click.option("--model", default="", help="model for the probe (default: the first listed)")
@click.option("--no-probe", is_flag=True, help="passive checks only (no probe conversation)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per finding")
def doctor_command(registry: str, router: str, gateway: str, api_key: str, model: str,
                   no_probe: bool, as_json: bool) -> None:
    """Check a running deployment and say what is wrong and how to fix it.

    Asks the registry and router (versions, clocks, holders and their heartbeats, instances,
    engine health), then runs a two-turn probe conversation through the gateway and explains
    turn 2's reuse decision. Exits 1 when anything is wrong."""
    findings = run_checks(registry, router, gateway.rstrip("/"), api_key, model, not no_probe)
    for f in findings:
        if as_json:
            click.echo(json.dumps(asdict(f)))
            continue
        click.echo(f"{f.level.upper():<4}  {f.check:<9} {f.message}")
        if f.fix:
            click.echo(f"{'':<15} fix: {f.fix}")
    bad = [f for f in findings if f.level != OK]
    if not as_json:
        click.echo(f"{len(findings) - len(bad)} ok, {len(bad)} problem(s)")
    if bad:
        raise SystemExit(1)
