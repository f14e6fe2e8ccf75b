"""Credentials are rotated without a restart (issue 32, item 10): SIGHUP makes a running router
reload its token file, and a running gateway its API keys; a file that does not parse is
logged and the credentials in use are kept. Real processes, real gRPC and HTTP on 127.0.0.1."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from test_security_registry import NEW, OLD, Serving, md, refused

from kvbridge.router.v1 import router_pb2 as rpb
from kvbridge.router.v1 import router_pb2_grpc as rpb_grpc


async def test_sighup_reloads_the_token_file_of_a_running_router(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{OLD} admin name=ops\n")
    router = Serving("--auth-tokens-file", str(tokens), service="router")
    channel = None
    try:
        started = router.wait_for("router_started")
        channel = grpc.aio.insecure_channel(started["listen"])
        stub = rpb_grpc.RouterServiceStub(channel)
        await stub.ListInstances(rpb.ListInstancesRequest(), metadata=md(OLD))
        tokens.write_text(f"{NEW} admin name=ops\n")
        mark = len(router.lines)
        router.proc.send_signal(signal.SIGHUP)
        assert router.wait_for("tokens_reloaded", mark)["token_roles"] == {"admin": 1}
        await refused(stub.ListInstances(rpb.ListInstancesRequest(), metadata=md(OLD)),
                      grpc.StatusCode.UNAUTHENTICATED)
        await stub.ListInstances(rpb.ListInstancesRequest(), metadata=md(NEW))
        tokens.write_text("short admin\n")
        mark = len(router.lines)
        router.proc.send_signal(signal.SIGHUP)
        router.wait_for("tokens_reload_failed", mark)
        await stub.ListInstances(rpb.ListInstancesRequest(), metadata=md(NEW))
    finally:
        if channel is not None:
            await channel.close()
        router.stop()


def _status(url: str, key: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_sighup_reloads_the_api_keys_of_a_running_gateway(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-old-key-0123456789 acme\n")
    gateway = Serving("--api-keys-file", str(keys), "--router", "127.0.0.1:1",
                      "--registry", "", service="gateway")
    try:
        url = gateway.wait_for("gateway_started")["url"] + "/v1/conversations/c1"
        # Past the key check, this gateway (no registry) answers 501; a refused key, 401.
        assert _status(url, "sk-old-key-0123456789") == 501
        keys.write_text("sk-new-key-0123456789 acme\n")
        mark = len(gateway.lines)
        gateway.proc.send_signal(signal.SIGHUP)
        assert gateway.wait_for("tokens_reloaded", mark)["source"] == "api_keys"
        assert _status(url, "sk-old-key-0123456789") == 401
        assert _status(url, "sk-new-key-0123456789") == 501
        keys.write_text("one-field-only\n")
        mark = len(gateway.lines)
        gateway.proc.send_signal(signal.SIGHUP)
        assert gateway.wait_for("tokens_reload_failed", mark)["source"] == "api_keys"
        assert _status(url, "sk-new-key-0123456789") == 501
    finally:
        gateway.stop()
