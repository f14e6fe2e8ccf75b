"""The Redis store's lease events: the functions write them to a Redis Stream (in the same call
as the change they tell of); each replica tails the stream and hands every event to its
listeners (watch streams, metrics), so `WatchLeases` on any replica sees the whole fleet."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from kvbridge.clock import monotonic
from kvbridge.services.registry._core import Listener
from kvbridge.services.registry._model import EventType, LeaseEvent

log = structlog.get_logger("kvbridge.registry")

_EVENT_BATCH = 1000
EVENT_BLOCK_MS = 200  # also bounds how long close() waits for the tail to stop
_RENEW_WATCH_MS = 5000  # replicas watching renewals re-announce it at least this often


class EventTail:
    """The part of `RedisStore` that tails the fleet's event stream."""

    prefix: str
    _events_key: str
    _redis: aioredis.Redis | None
    _tail: aioredis.Redis | None  # blocking XREADs get their own connection
    _closing: bool
    _listeners: list[Listener]
    _renewal_listeners: list[Listener]
    _events_lost: Callable[[str], None] | None

    def _chore(self, coro: Coroutine[Any, Any, None]) -> None:
        raise NotImplementedError  # RedisStore's

    def _unreachable(self, during: str, exc: Exception) -> None:
        raise NotImplementedError  # RedisStore's

    def add_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        self._listeners.append(listener)
        if renewals:
            self._renewal_listeners.append(listener)
            self._chore(self._announce_renewal_watch())

    def remove_listener(self, listener: Listener, *, renewals: bool = False) -> None:
        self._listeners.remove(listener)
        if renewals:
            self._renewal_listeners.remove(listener)

    def listener_count(self) -> int:
        return len(self._listeners)

    def on_events_lost(self, callback: Callable[[str], None]) -> None:
        self._events_lost = callback

    async def _announce_renewal_watch(self) -> None:
        """Renewals are written to the stream only while some replica watches them."""
        if self._redis is not None:
            try:
                await self._redis.set(self.prefix + "renew_watch", 1, px=_RENEW_WATCH_MS * 2)
            except (RedisError, OSError) as exc:
                log.warning("redis_unreachable", during="renew_watch", error=str(exc))

    async def _read_events(self, last_id: Any) -> None:
        """Tail the fleet's event stream and hand each event to this replica's listeners.

        Each read first checks, on the same connection, that the stream still holds the last
        event delivered: a Redis that restarted without its data or from an older snapshot, a
        failover to a replica that lagged (redis-py reconnects without a word), or a trim to
        MAXLEN past a tail that fell behind all lose events, and `on_events_lost` hears of it.
        """
        assert self._tail is not None
        announced = 0.0
        gone: Any = None  # a last id found missing and told of: read past, not checked again
        while not self._closing:
            try:
                async with self._tail.pipeline(transaction=False) as pipe:
                    if last_id not in (b"0-0", gone):  # (0-0: nothing delivered to check)
                        pipe.xrange(self._events_key, min=last_id, max=last_id)
                    pipe.xread({self._events_key: last_id}, count=_EVENT_BATCH,
                               block=EVENT_BLOCK_MS)
                    *kept, reply = await pipe.execute()
                if kept and not kept[0]:
                    last_id = gone = await self._events_gap(last_id)
                    continue
            except Exception as exc:  # the tail must outlive any one failure
                if self._closing:
                    return
                self._unreachable("events", exc)
                await asyncio.sleep(0.5)
                continue
            streams = reply.items() if isinstance(reply, dict) else reply or []
            entries: Any
            for _key, entries in streams:
                for event_id, fields in entries:
                    last_id = event_id
                    try:
                        self._deliver(fields)
                    except Exception as exc:  # one unreadable event must not stop the tail
                        log.warning("redis_event_skipped", id=_event_id(event_id),
                                    reason=f"{type(exc).__name__}: {exc}")
            if self._renewal_listeners and monotonic() - announced > _RENEW_WATCH_MS / 1e3:
                announced = monotonic()
                await self._announce_renewal_watch()

    async def _events_gap(self, last_id: Any) -> Any:
        """The stream no longer holds `last_id`, the last event delivered: tell
        `on_events_lost`, and return where to read on. Entries after `last_id` came since (ids
        follow the clock): from `last_id`. A stream whose entries all come before it (an older
        snapshot's, or new ones under a clock behind ours: they cannot be told apart) is read
        from after its newest entry, and an empty one from its start."""
        assert self._tail is not None
        log.warning("redis_events_lost", after=_event_id(last_id),
                    hint="watch streams end: watchers re-list")
        if self._events_lost is not None:
            try:
                self._events_lost(
                    "lease events may have been lost while Redis was unreachable (its event "
                    f"stream no longer holds event {_event_id(last_id)}, the last this "
                    "replica delivered)")
            except Exception:  # the tail goes on whatever the callback does
                log.exception("events_lost_callback_failed")
        newest = await self._tail.xrevrange(self._events_key, count=1)
        if not newest:
            return b"0-0"
        return last_id if _id_order(newest[0][0]) > _id_order(last_id) else newest[0][0]

    def _deliver(self, fields: dict[bytes, bytes]) -> None:
        kind = EventType(int(fields[b"t"]))
        targets = self._renewal_listeners if kind is EventType.RENEWED else self._listeners
        if not targets:
            return
        event = LeaseEvent.of(kind, _s(fields[b"l"]), sys.intern(_s(fields[b"tn"])),
                              _s(fields[b"c"]), _s(fields[b"h"]), int(fields[b"e"]),
                              float(fields[b"w"]), float(fields[b"lt"]))
        for listener in tuple(targets):
            try:
                listener(event)
            except Exception:  # one bad listener must not stop the stream for the others
                log.exception("event_listener_failed", type=kind.name)


def _s(value: bytes) -> str:
    return value.decode()


def _id_order(event_id: Any) -> tuple[int, int]:
    """A stream entry id `ms-seq` as a pair that sorts as Redis does."""
    ms, _, seq = _event_id(event_id).partition("-")
    return int(ms), int(seq or 0)


def _event_id(event_id: Any) -> str:
    return event_id.decode() if isinstance(event_id, bytes) else str(event_id)
