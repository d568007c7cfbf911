"""The explorer's scheduler: one actor runs at a time, the seed alone decides the interleaving, waits move
virtual time, a frozen process's actors and ticks stop and go on where they stopped, a killed one never
runs again."""

from __future__ import annotations

import threading

from tests.tools.explore.runtime import SimRuntime
from tests.tools.explore.sched import Scheduler


def _interleaving(seed: int) -> tuple[list[str], str]:
    sched = Scheduler(seed, switch=0.5)
    order: list[str] = []
    for name in ("a", "b", "c"):
        proc = sched.process(name, name)

        def body(name=name) -> None:
            for i in range(20):
                sched.point("step", i=i)
                order.append(name)

        sched.spawn(proc, "main", body, main=True)
    assert sched.run(lambda: all(a.done for a in sched.actors), sched.now() + 10) == "done"
    sched.close()
    return order, sched.digest()


def test_the_seed_alone_decides_the_interleaving():
    first, again, other = _interleaving(3), _interleaving(3), _interleaving(4)
    assert first == again
    assert first[0] != other[0] or first[1] != other[1]
    order = first[0]
    assert sorted(order) == sorted("abc" * 20)
    assert any(order[i] != order[i + 1] for i in range(len(order) - 1)), "actors interleave"


def test_only_one_actor_runs_at_a_time():
    sched = Scheduler(1, switch=0.9)
    inside, most = [0], [0]
    lock = threading.Lock()
    for name in ("a", "b", "c", "d"):
        proc = sched.process(name, name)

        def body() -> None:
            for _ in range(30):
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                    inside[0] -= 1
                sched.point("p")

        sched.spawn(proc, "main", body, main=True)
    sched.run(lambda: all(a.done for a in sched.actors), sched.now() + 10)
    sched.close()
    assert most[0] == 1


def test_waits_move_virtual_time_to_the_next_deadline_only_when_nothing_can_run():
    sched = Scheduler(0)
    t0 = sched.now()
    woke: list[tuple[str, float]] = []
    for name, delay in (("slow", 30.0), ("fast", 2.0)):
        proc = sched.process(name, name)

        def body(name=name, delay=delay) -> None:
            sched.sleep(delay)
            woke.append((name, sched.now() - t0))

        sched.spawn(proc, "main", body, main=True)
    sched.run(lambda: len(woke) == 2, t0 + 100)
    sched.close()
    assert woke == [("fast", 2.0), ("slow", 30.0)]


def test_a_frozen_process_misses_its_ticks_and_goes_on_where_it_stopped():
    sched = Scheduler(0, switch=0.0)
    proc = sched.process("w", "w")
    rt = SimRuntime(sched, proc)
    ticks: list[float] = []
    steps: list[float] = []
    rt.periodic(0.5, lambda: ticks.append(sched.elapsed), name="watch")

    def body() -> None:
        for _ in range(10):
            rt.sleep(1.0)
            steps.append(sched.elapsed)

    sched.spawn(proc, "main", body, main=True)
    sched.call_at(sched.now() + 3.2, lambda: sched.freeze(proc, 20.0, lambda: None))
    sched.run(lambda: len(steps) == 10, sched.now() + 100)
    sched.close()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) >= 20.0, "the watch saw the freeze as a gap between ticks"
    assert [s for s in steps if 3.2 < s < 23.2] == [], "nothing of the process ran while it was frozen"
    assert steps[-1] > 23.2


def test_a_killed_process_never_runs_again_and_its_threads_end_with_the_run():
    sched = Scheduler(0, switch=0.0)
    proc = sched.process("w", "w")
    ran: list[float] = []
    after: list[str] = []

    def body() -> None:
        try:
            while True:
                sched.sleep(1.0)
                ran.append(sched.elapsed)
        finally:
            after.append("finally")  # runs only as the run ends, every model call refused

    actor = sched.spawn(proc, "main", body, main=True)
    sched.call_at(sched.now() + 3.5, lambda: sched.kill(proc))
    assert sched.run(lambda: False, sched.now() + 20) == "stuck"
    assert ran == [1.0, 2.0, 3.0]
    sched.close()
    actor.thread.join(5)
    assert not actor.thread.is_alive() and after == ["finally"]
