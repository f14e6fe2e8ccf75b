"""`kvbridge doctor`: the diagnosis of probe turns (every failure it names), the passive checks
against a real registry and router, and the command against a gateway whose decode engine
grants no lease (fake engines from test_gateway)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_gateway import close, make_stack

from kvbridge.clients import duration
from kvbridge.doctor import FAIL, OK, WARN, Turn, check_holders, check_instances, diagnose_probe
from kvbridge.doctor import run_checks as doctor_checks
from kvbridge.services.registry import RegistryServer

FIRST = Turn(200, "miss_no_lease", 0, 725, prefill_ms=400.0, prefill="p0", decode="d0")


def hit(**kw: Any) -> Turn:
    fields = dict(status=200, decision="hit", reused=700, recomputed=25, prefill_ms=50.0,
                  transfer_ms=30.0, prefill="p0", decode="d0")
    fields.update(kw)
    return Turn(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("first", "second", "lease", "level", "needle"), [
    (FIRST, hit(), True, OK, "reused 700 tokens"),
    (Turn(503, None, error="no engine"), None, False, FAIL, "turn 1 failed: HTTP 503"),
    (Turn(200, None, prefill="p0"), None, False, FAIL, "reported no kvbridge decision"),
    (FIRST, None, False, FAIL, "granted no lease"),
    (FIRST, hit(decision="miss_hash_mismatch", reused=0, mismatch_block=0), True, FAIL,
     "mismatch at block 0"),
    (FIRST, hit(decision="miss_hash_mismatch", reused=0, mismatch_block=7), True, WARN,
     "differs from turn 1's at block 7"),
    (FIRST, hit(decision="miss_expired", reused=0), True, WARN, "lease expired"),
    (FIRST, hit(decision="registry_error", reused=0), True, FAIL, "cannot reach the registry"),
    (FIRST, hit(decision="deadline", reused=0), True, WARN, "read_deadline_s"),
    (FIRST, hit(decision="transfer_failed", reused=0), True, FAIL, "NIXL read"),
    (FIRST, hit(decision="miss_holder_gone", reused=0), True, FAIL, "gone"),
    (FIRST, hit(decision="recompute_cheaper", reused=0), True, WARN, "decision=threshold"),
    (FIRST, hit(status=502, error="bad gateway"), True, FAIL, "turn 2 failed"),
])
def test_probe_diagnosis(first: Turn, second: Turn | None, lease: bool, level: str,
                         needle: str) -> None:
    findings = diagnose_probe(first, second, lease)
    assert findings[0].level == level, findings
    assert needle in findings[0].message + findings[0].fix
    if level != OK:
        assert findings[0].fix, "every problem comes with a fix"


def test_slow_read_is_flagged_as_possible_tcp_fallback() -> None:
    findings = diagnose_probe(FIRST, hit(transfer_ms=2000.0), True)
    assert [f.level for f in findings] == [OK, WARN]
    assert "UCX_TLS" in findings[1].fix


def _holder(holder_id: str, *, ttl: float = 9.0, left: float = 8.0, block_size: int = 32,
            fingerprint: str = "fp", version: str = "", state: int = 1) -> Any:
    return SimpleNamespace(holder_id=holder_id, ttl=duration(ttl), expires_in=duration(left),
                           block_size=block_size, engine_fingerprint=fingerprint,
                           software_version=version, state=state)


def test_holder_checks() -> None:
    assert check_holders([], None)[0].level == FAIL
    assert [f.level for f in check_holders([_holder("d0")], {"d0"})] == [OK]
    stale = check_holders([_holder("d0", left=2.0)], {"d0"})
    assert stale[0].level == FAIL and "not heartbeating" in stale[0].message
    mixed = check_holders([_holder("d0"), _holder("d1", block_size=16)], {"d0", "d1"})
    assert any("disagree on block size" in f.message for f in mixed)
    old = check_holders([_holder("d0", version="kvbridge/0.0.1 vllm/0.32.0")], {"d0"})
    assert old[0].level == WARN and "0.0.1" in old[0].message
    unrouted = check_holders([_holder("d0")], set())
    assert "not a decode instance of the router" in unrouted[0].message


def test_instance_checks() -> None:
    prefill = SimpleNamespace(instance_id="p0", role=1, engine_id="ep", http_url="http://p")
    decode = SimpleNamespace(instance_id="d0", role=2, engine_id="ed", http_url="http://d")
    assert [f.level for f in check_instances([prefill, decode], {"ed"}, {})] == [OK]
    missing = check_instances([prefill], {"ed"}, {})
    assert missing[0].level == FAIL and "no live decode instance" in missing[0].message
    not_holder = check_instances([prefill, decode], set(), {})
    assert "is not a registry holder" in not_holder[0].message
    sick = check_instances([prefill, decode], {"ed"}, {"p0": "HTTP 500"})
    assert sick[0].level == FAIL and "not healthy" in sick[0].message


async def test_doctor_against_a_gateway_whose_decode_grants_nothing(
        registry_server: RegistryServer, tmp_path: Path, kv: Any) -> None:
    s = await make_stack(registry_server, tmp_path)
    try:
        # The registry knows decode d0 as a holder (as its connector would register it).
        await s.registry_client.register_holder("engine-d0", "127.0.0.1", 5600, kv.block_size,
                                                kv.fingerprint, ttl=60)
        registry = f"127.0.0.1:{registry_server.port}"
        router = f"127.0.0.1:{s.router.port}"
        findings = await asyncio.to_thread(doctor_checks, registry, router, s.url, "sk-doc", "",
                                           True, 2.0)
        by_check = {(f.check, f.level) for f in findings}
        assert ("registry", OK) in by_check and ("router", OK) in by_check
        assert ("instances", OK) in by_check and ("gateway", OK) in by_check
        problems = [f for f in findings if f.level != OK]
        # The fake decode engine has no connector: no lease after turn 1.
        assert len(problems) == 1 and "granted no lease" in problems[0].message, problems
    finally:
        await close(s)


async def test_doctor_reports_what_it_cannot_reach(unused_tcp_port: int) -> None:
    findings = await asyncio.to_thread(
        doctor_checks, f"127.0.0.1:{unused_tcp_port}", f"127.0.0.1:{unused_tcp_port}",
        f"http://127.0.0.1:{unused_tcp_port}", "k", "", True)
    assert [(f.check, f.level) for f in findings] == [
        ("registry", FAIL), ("router", FAIL), ("gateway", FAIL)]
    assert "kvbridge registry serve" in findings[0].fix
