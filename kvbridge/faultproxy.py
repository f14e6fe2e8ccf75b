"""A TCP fault proxy for tests: placed between two components on 127.0.0.1, it forwards bytes
both ways and injects the faults a network can: added delay, dropped traffic (a black hole:
bytes are read and thrown away, connections stay open), and resets (connections closed with a
TCP RST). Faults can be changed while connections are open, from any thread.

    with ThreadedFaultProxy("127.0.0.1", registry_port) as proxy:
        client = RegistryClient(proxy.address)   # talks to the registry through the proxy
        proxy.set(delay_s=0.2)                   # every chunk now arrives 200 ms late
        proxy.set(drop=True)                     # nothing gets through; calls time out
        proxy.reset_all()                        # open connections are reset now
        proxy.set(reset=True)                    # and new ones are reset on arrival
        proxy.clear()                            # a healthy network again

`kvbridge fault-proxy --listen HOST:PORT --target HOST:PORT [--delay-ms N] [--drop]` runs one
from the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from dataclasses import dataclass, replace
from typing import Any

import click
import structlog

log = structlog.get_logger("kvbridge.faultproxy")

_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Faults:
    delay_s: float = 0.0
    """Added to every chunk forwarded, in each direction (order is kept)."""
    drop: bool = False
    """Read and discard everything: the peer sees silence, not an error."""
    reset: bool = False
    """Reset new connections as they arrive (with `reset_all`: existing ones too)."""

    def __post_init__(self) -> None:
        if not self.delay_s >= 0:
            raise ValueError(f"delay_s must be a non-negative number, got {self.delay_s}")


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """The proxy on an asyncio loop. Use `ThreadedFaultProxy` from synchronous code."""

    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0, faults: Faults | None = None) -> None:
        self.target = (target_host, target_port)
        self.listen = (listen_host, listen_port)
        self.faults = faults or Faults()
        self.port = 0
        self.connections = 0  # accepted so far
        self.bytes_forwarded = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def address(self) -> str:
        return f"{self.listen[0]}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, *self.listen)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("fault_proxy_started", listen=self.address,
                 target=f"{self.target[0]}:{self.target[1]}")

    def set(self, **changes: Any) -> Faults:
        """Change some faults (delay_s, drop, reset); returns the faults now in force."""
        self.faults = replace(self.faults, **changes)
        log.info("faults_set", **{k: getattr(self.faults, k) for k in ("delay_s", "drop",
                                                                       "reset")})
        return self.faults

    def reset_all(self) -> int:
        """Reset every open connection now; returns how many."""
        count = len(self._open)
        for writer in list(self._open):
            _abort(writer)
        self._open.clear()
        return count

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.reset_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.faults.reset:
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _abort(writer)  # the target is down: the client sees a reset, as it would
            return
        self._open.update((writer, up_writer))
        pumps = [asyncio.create_task(self._pump(reader, up_writer)),
                 asyncio.create_task(self._pump(up_reader, writer))]
        self._tasks.update(pumps)
        try:
            done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            # One side finished sending: the other may still answer (a half-close). One side
            # failed: the connection is over both ways.
            if pending and all(not t.cancelled() and t.exception() is None and t.result()
                               for t in done):
                await asyncio.wait(pending)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            for w in (writer, up_writer):
                self._open.discard(w)
                with contextlib.suppress(Exception):
                    w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Forward one direction until its end (True) or an error (False)."""
        loop = asyncio.get_running_loop()
        # Chunks keep their order: each is due `delay_s` after it was read.
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, chunk = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:  # the peer finished sending: pass the end on
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                # Counted before it goes: whoever sees the bytes arrive sees them counted.
                self.bytes_forwarded += len(chunk)
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while True:
                chunk = await reader.read(_CHUNK)
                faults = self.faults
                if chunk and faults.drop:
                    continue
                queue.put_nowait((loop.time() + faults.delay_s, chunk))
                if not chunk:
                    break
            await sender  # what was read before the end still goes, in order
            return True
        except (ConnectionError, OSError):
            return False
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await sender


class ThreadedFaultProxy:
    """A `FaultProxy` on a thread of its own, for synchronous tests and tools."""

    def __init__(self, target_host: str, target_port: int, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxy = FaultProxy(target_host, target_port, **kwargs)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="kvbridge-fault-proxy")

    def __enter__(self) -> ThreadedFaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        return self.proxy.address

    @property
    def port(self) -> int:
        return self.proxy.port

    def set(self, **changes: Any) -> Faults:
        faults: Faults = self._call(self.proxy.set, **changes)
        return faults

    def clear(self) -> Faults:
        return self.set(delay_s=0.0, drop=False, reset=False)

    def reset_all(self) -> int:
        count: int = self._call(self.proxy.reset_all)
        return count

    def _call(self, fn: Any, **kwargs: Any) -> Any:
        async def run() -> Any:
            return fn(**kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


def _hostport(value: str, *, listen: bool = False) -> tuple[str, int]:
    from kvbridge.clients._base import parse_hostport

    host, port = parse_hostport(value, listen=listen)
    if not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host, port


@click.command("fault-proxy")
@click.option("--listen", default="127.0.0.1:0", show_default=True,
              help="HOST:PORT to accept connections on (port 0: any free port)")
@click.option("--target", required=True, help="HOST:PORT to forward to")
@click.option("--delay-ms", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="added to every chunk, each direction")
@click.option("--drop", is_flag=True, help="read and discard all traffic (a black hole)")
@click.option("--reset", is_flag=True, help="reset every connection as it arrives")
def fault_proxy_command(listen: str, target: str, delay_ms: float, drop: bool,
                        reset: bool) -> None:
    """A TCP proxy that injects network faults between two components (for tests and drills):
    delay, dropped traffic, resets. Prints "PORT N" once listening; runs until SIGTERM or
    SIGINT."""
    from kvbridge import aio

    try:
        listen_host, listen_port = _hostport(listen, listen=True)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    try:
        target_host, target_port = _hostport(target)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--target") from None

    async def run() -> None:
        proxy = FaultProxy(target_host, target_port, listen_host=listen_host,
                           listen_port=listen_port, faults=Faults(delay_ms / 1000, drop, reset))
        await proxy.start()
        click.echo(f"PORT {proxy.port}", err=False)
        await aio.wait_for_stop_signal()
        await proxy.stop()

    try:
        aio.run(run())
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}: {exc}") from exc
