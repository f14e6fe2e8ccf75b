"""What the gRPC clients share: channel options, and the call with a deadline and retries.

A call's `timeout` is its whole budget: retries (on UNAVAILABLE, idempotent calls only, with
jittered backoff) happen inside it, and a status that comes back is raised as the domain error
it carries (`kvbridge.errors`), so callers never handle grpc.RpcError.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, ClassVar

import grpc

from kvbridge._grpc_status import from_rpc_error
from kvbridge.errors import DeadlineExceeded

DEFAULT_TIMEOUT = 2.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # retries are ours, bounded by the call's deadline
    # Reconnect soon after an outage (gRPC's default backoff grows to two minutes).
    # (min_reconnect_backoff_ms is left alone: it is also the connection attempt's timeout.)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def backoff(attempt: int) -> float:
    return float(min(0.05 * 2**attempt, 0.5) * (0.5 + random.random() / 2))


class SyncClient:
    """Blocking client over one channel. Thread-safe."""

    stub_class: ClassVar[Any]

    def __init__(self, target: str, *, timeout: float = DEFAULT_TIMEOUT, retries: int = 3,
                 channel: grpc.Channel | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = self.stub_class(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, *, idempotent: bool = True,
              timeout: float | None = None) -> Any:
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"{method} to {self.target}: no reply within {budget:g}s")
            try:
                return getattr(self._stub, method)(request, timeout=left)
            except grpc.RpcError as err:
                if (idempotent and attempt < self.retries and err.code() in RETRYABLE
                        and deadline - time.monotonic() > backoff(attempt)):
                    time.sleep(backoff(attempt))
                    attempt += 1
                    continue
                raise from_rpc_error(err) from None


class AsyncClient:
    """asyncio client over one channel."""

    stub_class: ClassVar[Any]

    def __init__(self, target: str, *, timeout: float = DEFAULT_TIMEOUT, retries: int = 3,
                 channel: grpc.aio.Channel | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._channel = channel or grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = self.stub_class(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any, *, idempotent: bool = True,
                    timeout: float | None = None) -> Any:
        budget = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        attempt = 0
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise DeadlineExceeded(f"{method} to {self.target}: no reply within {budget:g}s")
            try:
                return await getattr(self._stub, method)(request, timeout=left)
            except grpc.RpcError as err:
                if (idempotent and attempt < self.retries and err.code() in RETRYABLE
                        and deadline - loop.time() > backoff(attempt)):
                    await asyncio.sleep(backoff(attempt))
                    attempt += 1
                    continue
                raise from_rpc_error(err) from None
