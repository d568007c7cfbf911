"""The default environment and the virtual-time loop: what the models rely on from any environment."""

from __future__ import annotations

import asyncio

import pytest

from tests.tools.sim import aio
from tests.tools.sim.env import Deadlock, ManualEnv, Request


def test_advance_runs_the_timers_due_in_time_order_and_no_later_one():
    env, ran = ManualEnv(), []
    t0 = env.now()
    env.call_at(t0 + 2, lambda: ran.append(("b", env.now() - t0)))
    env.call_at(t0 + 1, lambda: ran.append(("a", env.now() - t0)))
    env.call_at(t0 + 5, lambda: ran.append(("c", env.now() - t0)))
    env.advance(3)
    assert ran == [("a", 1), ("b", 2)] and env.now() == t0 + 3


def test_a_wait_moves_the_clock_to_the_next_timer_until_its_predicate_holds():
    env = ManualEnv()
    t0, box = env.now(), []
    env.call_at(t0 + 4, lambda: box.append(1))
    assert env.wait_until(lambda: bool(box), t0 + 10) and env.now() == t0 + 4
    assert not env.wait_until(lambda: False, t0 + 6) and env.now() == t0 + 6


def test_a_wait_that_nothing_can_end_is_a_deadlock_not_a_hang():
    with pytest.raises(Deadlock):
        ManualEnv().wait_until(lambda: False, float("inf"))


def test_a_held_request_waits_for_its_release_and_lands_once():
    env, applied = ManualEnv(), []
    stop = env.hold(lambda r: r.name == "x")
    r = Request("x", lambda: applied.append(1) or "done", k=1)
    env.deliver(r)
    assert not r.landed and env.held == [r]
    env.release()
    r.land()
    assert r.reply() == "done" and applied == [1]
    stop()
    other = Request("x", lambda: 2)
    env.deliver(other)
    assert other.landed


def test_a_points_hook_can_fail_the_call_at_that_point():
    env = ManualEnv()

    def fail(name, details):
        raise ConnectionError(name)

    env.on_point("a.", fail)
    env.point("b.c")
    with pytest.raises(ConnectionError, match="a.d"):
        env.point("a.d", x=1)
    assert [name for _, name, _ in env.history] == ["b.c", "a.d"]


def test_a_deadline_fires_in_virtual_time_and_the_request_still_lands_later():
    env = ManualEnv()
    t0 = env.now()
    env.hold(lambda r: True)
    request = Request("slow", lambda: "late")
    env.call_at(t0 + 30, env.release)

    async def call():
        return await asyncio.wait_for(aio.reply(env, request), 5)

    with pytest.raises(TimeoutError):
        aio.run(env, call())
    assert env.now() == pytest.approx(t0 + 5) and not request.landed
    env.advance(30)
    assert request.landed and request.result == "late"


def test_a_coroutine_sleeps_in_virtual_time():
    env = ManualEnv()
    t0 = env.now()

    async def nap():
        await asyncio.sleep(12.5)
        return env.now() - t0

    assert aio.run(env, nap()) == pytest.approx(12.5)


def test_the_same_seed_gives_the_same_randomness():
    assert [ManualEnv(seed=3).rng.random() for _ in range(2)] == [ManualEnv(seed=3).rng.random()] * 2
