"""Running kvbridge's asyncio services: on uvloop where it is installed (a core dependency on
Linux and macOS), else on the standard event loop.

uvloop serves more registry RPCs per second than the standard loop at the same CPU (see
docs/registry.md, "Event loop"). `kvbridge bench registry` runs its echo baseline on the same
loop, so its ratios compare like with like.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")

# KVBRIDGE_EVENT_LOOP=asyncio forces the standard loop (e.g. to rule uvloop out when debugging).
EVENT_LOOP_ENV = "KVBRIDGE_EVENT_LOOP"


def loop_name() -> str:
    """The event loop `run` uses: "uvloop" or "asyncio"."""
    choice = os.environ.get(EVENT_LOOP_ENV, "auto")
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"{EVENT_LOOP_ENV} must be auto, uvloop or asyncio, got {choice!r}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError(f"{EVENT_LOOP_ENV}=uvloop but uvloop is not installed") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """asyncio.run on the loop `loop_name()` picks."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


async def wait_for_stop_signal() -> str:
    """Wait for SIGTERM or SIGINT (services stop gracefully on either); returns its name."""
    stop = asyncio.Event()
    received: list[str] = []
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return received[0]
