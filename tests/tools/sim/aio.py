"""Coroutines of a model run on the calling thread, on an event loop whose clock is the environment's.

TQ's client runs every call as a coroutine on its own loop thread; `TQStore` bounds them with
`asyncio.wait_for`. The model runs the same coroutine on the caller's thread instead (no thread of
its own), on a loop whose `time()` is `env.now()` and whose idle wait is `env.wait_until`: a deadline
fires when virtual time reaches it, and a request that lands (on any thread) wakes the loop.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from typing import Any, TypeVar

from tests.tools.sim.env import Environment, Request

T = TypeVar("T")


class _Waker:
    """The loop's stand-in for a selector: its idle wait is the environment's."""

    def __init__(self, env: Environment):
        self._env = env
        self._woken = False

    def wake(self) -> None:
        self._woken = True

    def select(self, timeout: float | None) -> list:
        if not self._woken:
            deadline = math.inf if timeout is None else self._env.now() + timeout
            self._env.wait_until(lambda: self._woken, deadline)
        self._woken = False
        return []

    def close(self) -> None:
        pass


class VirtualLoop(asyncio.BaseEventLoop):
    """An event loop driven by an `Environment`: virtual time, no sockets, no threads."""

    def __init__(self, env: Environment):
        super().__init__()
        self._env = env
        self._selector = _Waker(env)
        # Above the spacing of floats at epoch-scale times (2e-7 s), or a timer due now never fires.
        self._clock_resolution = 1e-6

    def time(self) -> float:
        return self._env.now()

    def _process_events(self, event_list) -> None:
        pass

    def _write_to_self(self) -> None:
        self._selector.wake()


def run(env: Environment, coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end on the calling thread, in the environment's time."""
    loop = VirtualLoop(env)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def reply(env: Environment, request: Request, timeout: float | None = None) -> Any:
    """Send `request` (the environment lands it when it decides) and wait for its reply.

    With `timeout`, `TimeoutError` once it passes with no reply; the request stays in flight. A
    cancelled wait (the caller's deadline) leaves it in flight too.
    """
    env.deliver(request)
    if not request.landed:
        loop = asyncio.get_running_loop()
        landed = loop.create_future()

        def wake(_req: Request) -> None:
            try:
                loop.call_soon_threadsafe(_settle, landed)
            except RuntimeError:  # the loop is gone: nobody waits for this reply any more
                pass

        request.on_landed(wake)
        if timeout is None:
            await landed
        else:
            await asyncio.wait_for(landed, timeout)
    return request.reply()


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
