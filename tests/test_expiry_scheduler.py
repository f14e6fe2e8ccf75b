"""The registry's expiry scheduler: how often it ticks when deadlines keep falling due."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvbridge.clock import SystemClock
from kvbridge.services.registry._config import RegistryConfig
from kvbridge.services.registry._server import RegistryServer


class _AlwaysDue:
    """A store whose next deadline is always now (a stream of pins expiring), counting ticks;
    with `idle`, one that knows of no deadline at all."""

    def __init__(self, config: RegistryConfig, idle: bool = False) -> None:
        self.config = config
        self.idle = idle
        self.clock = SystemClock()
        self.ticks = 0
        self.turns: set[float] = set()
        self.not_serving = ""

    async def tick(self, *, turn: float = 0.0) -> int:
        self.turns.add(turn)
        self.ticks += 1
        return 0

    def next_deadline(self) -> float | None:
        return None if self.idle else self.clock.monotonic()


async def _ticks_in(seconds: float, idle: bool = False, **settings: Any) -> int:
    return (await _run_scheduler(seconds, idle, **settings)).ticks


async def _run_scheduler(seconds: float, idle: bool = False, **settings: Any) -> _AlwaysDue:
    config = RegistryConfig(insecure=True, **settings)
    store = _AlwaysDue(config, idle)
    server = RegistryServer(config, store, None, None, 0, None, None,  # type: ignore[arg-type]
                            None)
    task = asyncio.create_task(server._run_expiry())
    await asyncio.sleep(seconds)
    server._stopping = True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return store


@pytest.mark.timeout(30)
async def test_due_deadlines_are_batched_into_ticks_expiry_tick_s_apart():
    # 0.5 s with a tick at most every 0.1 s: at most 6 ticks (the first runs at once), however
    # fast the machine; without the floor, a deadline always due would tick without pause.
    assert 1 <= await _ticks_in(0.5, expiry_tick_s=0.1) <= 6


@pytest.mark.timeout(30)
async def test_expiry_tick_above_the_longest_pause_is_honoured():
    # The scheduler otherwise wakes at least every quarter second; a longer tick floor wins.
    assert 1 <= await _ticks_in(0.5, expiry_tick_s=0.3, min_idle_ttl_s=5.0) <= 2


@pytest.mark.timeout(30)
async def test_with_nothing_due_it_ticks_a_few_times_a_second():
    # Each replica (and each shard) of a shared store pays a script call per tick: an idle
    # fleet must not tick 50 times a second. The first tick runs at once, then one a quarter
    # second at most (3 in 0.6 s; a 20 ms pause would make 30).
    assert 2 <= await _ticks_in(0.6, idle=True) <= 4


@pytest.mark.timeout(30)
async def test_with_short_ttls_allowed_it_wakes_before_a_new_grant_could_expire():
    # A grant made while the scheduler sleeps may expire min_idle_ttl_s later: it must be
    # awake by then, whatever it knew of before (0.1 s: at least 5 ticks in 0.6 s).
    assert 5 <= await _ticks_in(0.6, idle=True, min_idle_ttl_s=0.1) <= 8
    assert 5 <= await _ticks_in(0.6, idle=True, min_holder_ttl_s=0.1) <= 8


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tick_s, turn", [(0.01, 0.26), (0.3, 0.6)])
async def test_the_turn_at_a_shared_stores_ticks_outlasts_the_longest_sleep(tick_s: float,
                                                                            turn: float):
    # A replica ticks again within its longest sleep (a quarter second, or the tick floor when
    # longer): its turn lasts one tick floor more, so that it keeps the turn as it ticks
    # instead of handing it over on every quiet cycle.
    store = await _run_scheduler(0.35, expiry_tick_s=tick_s)
    assert len(store.turns) == 1 and store.turns.pop() == pytest.approx(turn)


def test_expiry_tick_must_be_positive():
    with pytest.raises(ValueError, match="expiry_tick_s must be positive"):
        RegistryConfig(insecure=True, expiry_tick_s=0)
