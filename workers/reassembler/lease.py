"""Whether a worker may still write to TQ: the zombie guard Kafka cannot give for TQ.

A worker frozen past its session timeout (SIGSTOP, a paused VM, a long stop-the-world pause) has
lost its partitions to a successor without knowing it. Kafka fences its transaction, but a TQ put it
makes on waking would still land: over rows the successor committed, or recreating rows a trainer
already released, which nobody would clear. Nothing in TQ can refuse a put by owner, so the worker
refuses it itself whenever it cannot be sure it still owns its partitions:

- **A freeze**: a watch thread ticks every `tick_s`; a gap between ticks of at least half the
  session timeout means the whole process was stopped (heartbeats too). From then on every put is
  refused until the worker has *confirmed* its membership with the broker: a transaction that
  sends its committed offsets with its consumer-group metadata, which the group coordinator
  refuses from a member of an older generation (KIP-447). Time alone proves nothing here: the
  first poll after waking can hand out prefetched records before the heartbeat that would reveal
  the lost membership has even been answered.
- **A slow step**: more than 3/4 of `max.poll.interval.ms` since the last poll, after which the
  consumer leaves its group even though it kept heartbeating. Each TQ call of the worker, the
  controller's round trips included, is given up well inside the remaining quarter
  (`call_budget_s`, `streams.tq.with_call_deadline`), so a put checked in time also lands in time
  or is abandoned in time (TQ may still apply what it had sent: docs/DESIGN.md, "Zombies").

The lease is asked before every put, not once per step. What remains is a freeze that starts after
the check and before the put has landed: the length of one bounded TQ call, not of a whole step.
"""

from __future__ import annotations

import threading

from workers.runtime import REAL_RUNTIME, Runtime

# The share of max.poll.interval after the last poll past which no put starts.
SLOW_STEP_SHARE = 0.75
# The share of the rest of max.poll.interval that one TQ call may take: room to spare for the commit.
CALL_SHARE_OF_REST = 0.8


def call_budget_s(max_poll_interval_s: float) -> float:
    """The longest one TQ call of a worker may take: a put the lease allowed, at most 3/4 of the poll
    interval after a poll, then ends before the interval does (TQ's own: no bound on the controller,
    3 x 200 s on a storage unit)."""
    return max_poll_interval_s * (1 - SLOW_STEP_SHARE) * CALL_SHARE_OF_REST


class Lease:
    """Freeze and poll-interval watch of one worker process."""

    def __init__(
        self,
        session_timeout_s: float,
        max_poll_interval_s: float,
        *,
        tick_s: float = 0.1,
        runtime: Runtime = REAL_RUNTIME,
        watch: bool = True,
    ):
        self.session_timeout_s = session_timeout_s
        self.max_poll_interval_s = max_poll_interval_s
        self._clock = clock = runtime.monotonic
        self._tick_s = tick_s
        self._last_tick = self._polled = clock()
        self._lock = threading.Lock()
        # Freezes seen so far; a confirmation counts only if none was seen while it ran.
        self._freezes = 0
        self._unconfirmed = False
        self._freeze_s = 0.0
        # Seconds the process spent frozen since the last poll: no step's work (see `slow_step`).
        self._frozen_since_poll = 0.0
        # The watch: a tick every tick_s on a thread of its own (the runtime's).
        self._watch = runtime.periodic(tick_s, self.tick, name="rlstream-lease") if watch else None

    def polled(self) -> None:
        with self._lock:
            self._polled = self._clock()
            self._frozen_since_poll = 0.0

    def tick(self) -> None:
        """One tick of the watch: notes a freeze since the previous one."""
        now = self._clock()
        with self._lock:
            self._note(now - self._last_tick)
            self._last_tick = now

    def _note(self, gap: float) -> None:
        if gap >= self.session_timeout_s / 2:
            self._freezes += 1
            self._unconfirmed = True
            self._freeze_s = max(self._freeze_s, gap)
            self._frozen_since_poll += gap

    def _check_freeze(self) -> None:
        # A freeze the watch thread has not ticked through yet (the caller woke first). Counted
        # once: the check then stands for the tick, or the watch would count the same gap again.
        now = self._clock()
        with self._lock:
            gap = now - self._last_tick - self._tick_s
            self._note(gap)
            if gap >= self.session_timeout_s / 2:
                self._last_tick = now

    @property
    def unconfirmed(self) -> bool:
        """A freeze was seen and the worker has not confirmed its membership since."""
        self._check_freeze()
        with self._lock:
            return self._unconfirmed

    def freezes(self) -> int:
        """A mark to pass to `confirmed` once the confirmation that starts now has succeeded."""
        self._check_freeze()
        with self._lock:
            return self._freezes

    def confirmed(self, mark: int) -> bool:
        """The broker accepted this member's generation after `freezes()` returned `mark`.

        Puts are allowed again unless another freeze was seen meanwhile (the confirmation may itself
        have been frozen before it was sent); returns whether they are.
        """
        self._check_freeze()
        with self._lock:
            if self._freezes == mark:
                self._unconfirmed = False
                self._freeze_s = 0.0
            return not self._unconfirmed

    def refusal(self) -> str | None:
        """Why a put now could be a zombie's, or None while the worker may put."""
        self._check_freeze()
        with self._lock:
            if self._unconfirmed:
                return (
                    f"the process was frozen for {self._freeze_s:.1f}s (session timeout {self.session_timeout_s:.0f}s) "
                    "and has not confirmed its consumer-group membership since"
                )
        since_poll = self._clock() - self._polled
        if since_poll >= self.max_poll_interval_s * SLOW_STEP_SHARE:
            return f"{since_poll:.1f}s since the last poll (max.poll.interval {self.max_poll_interval_s:.0f}s)"
        return None

    def slow_step(self) -> bool:
        """Whether the current step's own work has run past the share of max.poll.interval that puts may
        use: time the process spent frozen is left out (a freeze is no reason to finalize fewer groups)."""
        self._check_freeze()
        with self._lock:
            worked = self._clock() - self._polled - self._frozen_since_poll
        return worked >= self.max_poll_interval_s * SLOW_STEP_SHARE

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
