"""The TCP fault proxy: pass-through, delay, drop, reset, a dead target, gRPC through it, and
its command line. Everything talks over 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import ThreadedRegistry

from kvbridge.clients import RegistryClient
from kvbridge.errors import DeadlineExceeded, Unavailable
from kvbridge.faultproxy import Faults, ThreadedFaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(echo_port: int) -> Iterator[ThreadedFaultProxy]:
    with ThreadedFaultProxy("127.0.0.1", echo_port) as p:
        yield p


def roundtrip(port: int, payload: bytes, timeout: float = 5.0) -> tuple[bytes, float]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        start = time.perf_counter()
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        return got, time.perf_counter() - start


def test_bytes_pass_through_unchanged(proxy: ThreadedFaultProxy) -> None:
    payload = os.urandom(300_000)
    got, _ = roundtrip(proxy.port, payload)
    assert got == payload
    assert proxy.proxy.bytes_forwarded == 2 * len(payload)


def test_delay_is_added_each_way_and_keeps_order(proxy: ThreadedFaultProxy) -> None:
    _, plain = roundtrip(proxy.port, b"ping")
    proxy.set(delay_s=0.15)
    payload = b"".join(i.to_bytes(4, "big") for i in range(5000))
    got, delayed = roundtrip(proxy.port, payload)
    assert got == payload  # in order, nothing lost
    assert delayed >= 0.3 > plain, (plain, delayed)  # 150 ms there, 150 ms back
    proxy.clear()
    _, healthy = roundtrip(proxy.port, b"ping")
    assert healthy < 0.3


def test_drop_is_silence_then_traffic_resumes(proxy: ThreadedFaultProxy) -> None:
    proxy.set(drop=True)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=0.3) as sock:
        sock.sendall(b"lost")
        with pytest.raises(TimeoutError):
            sock.recv(10)
    proxy.set(drop=False)
    assert roundtrip(proxy.port, b"back")[0] == b"back"


def test_reset_new_and_open_connections(proxy: ThreadedFaultProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"a")
        assert sock.recv(1) == b"a"
        assert proxy.reset_all() == 2  # the client side and the target side
        with pytest.raises(ConnectionResetError):
            sock.sendall(b"b")
            sock.recv(1)
    proxy.set(reset=True)
    with pytest.raises((ConnectionResetError, BrokenPipeError)), \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"c")
        if not sock.recv(1):
            raise ConnectionResetError("closed")


def test_target_down_looks_like_a_reset() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with ThreadedFaultProxy("127.0.0.1", dead) as proxy:
        try:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
                try:
                    data = sock.recv(1)
                except ConnectionResetError:
                    data = b""
        except ConnectionResetError:  # the reset arrived before connect() returned
            data = b""
        assert data == b""
        assert proxy.proxy.connections == 1


def test_faults_are_validated() -> None:
    with pytest.raises(ValueError, match="delay_s"):
        Faults(delay_s=-1.0)
    with pytest.raises(ValueError, match="delay_s"):
        Faults(delay_s=float("nan"))


def test_grpc_through_the_proxy_sees_deadlines_and_outages() -> None:
    registry = ThreadedRegistry()
    try:
        with ThreadedFaultProxy("127.0.0.1", registry.port) as proxy, \
                RegistryClient(proxy.address, timeout=2.0, retries=0) as client:
            assert client.get_server_info().version
            proxy.set(delay_s=0.3)  # slower than the call's deadline
            with pytest.raises(DeadlineExceeded):
                client.get_server_info(timeout=0.2)
            proxy.set(delay_s=0.0, reset=True)
            proxy.reset_all()
            with pytest.raises(Unavailable):
                client.get_server_info(timeout=1.0)
            proxy.clear()
            deadline = time.monotonic() + 10  # gRPC reconnects on its own (with backoff)
            while True:
                try:
                    assert client.get_server_info(timeout=1.0).version
                    break
                except Unavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
    finally:
        registry.close()


def test_command_line(echo_port: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", "fault-proxy", "--target",
         f"127.0.0.1:{echo_port}", "--delay-ms", "50"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), (line, proc.stderr.read() if proc.stderr else "")
        got, took = roundtrip(int(line.split()[1]), b"hello")
        assert got == b"hello" and took >= 0.1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    bad = subprocess.run([sys.executable, "-m", "kvbridge.cli", "fault-proxy", "--target",
                          "nowhere"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
