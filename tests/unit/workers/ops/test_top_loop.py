"""`rlstream top`'s redraw loop: one plain screen with --once, redraws until stopped, and Ctrl-C ends it
cleanly even when the interrupt lands inside a call that swallows exceptions (librdkafka's log callback)."""

import io
import os
import signal
import threading

from workers.ops.top import CLEAR_BELOW, HIDE_CURSOR, HOME, SHOW_CURSOR, run_top
from workers.ops.top_view import Snapshot


class Source:
    """Snapshots on demand; `during` runs inside each one; closed once."""

    def __init__(self, during=lambda n: None, most: int = 50):
        self.n, self.closed, self.during, self.most = 0, 0, during, most

    def snapshot(self) -> Snapshot:
        self.n += 1
        assert self.n <= self.most, "still redrawing: the stop was lost"
        self.during(self.n)
        return Snapshot(at=1_800_000_000.0 + self.n, prefix="run1", bootstrap_servers="k:9092")

    def close(self) -> None:
        self.closed += 1


def test_once_prints_one_plain_screen():
    out, source = io.StringIO(), Source()
    assert run_top(source, out, once=True) == 0
    text = out.getvalue()
    assert source.n == 1 and source.closed == 1
    assert text.startswith("rlstream top · prefix run1 · broker k:9092") and "\x1b" not in text


def test_the_view_redraws_in_place_until_stopped_and_restores_the_cursor():
    stop = threading.Event()
    source = Source(during=lambda n: stop.set() if n == 3 else None)
    out = io.StringIO()
    assert run_top(source, out, interval_s=0.01, stop=stop) == 0
    text = out.getvalue()
    assert source.n == 3 and source.closed == 1
    assert text.startswith(HIDE_CURSOR) and text.count(HOME) == 4 and text.endswith(SHOW_CURSOR + "\n")
    assert text.count("rlstream top · prefix run1") == 3 and CLEAR_BELOW in text


def test_ctrl_c_inside_a_call_that_swallows_it_still_ends_the_view():
    def interrupted(n):
        if n == 2:
            try:
                os.kill(os.getpid(), signal.SIGINT)  # delivered to this, the main thread, before kill returns
                signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a bytecode boundary: a pending handler runs
            except BaseException:  # noqa: BLE001 - what librdkafka's callback does with an exception
                pass

    before = signal.getsignal(signal.SIGINT)
    source = Source(during=interrupted, most=5)
    assert run_top(source, io.StringIO(), interval_s=0.01) == 0
    assert source.n == 2 and source.closed == 1
    assert signal.getsignal(signal.SIGINT) is before, "the caller's handler is back"
