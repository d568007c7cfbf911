"""What the pipeline reports, behind one interface per role with a do-nothing default.

Workers call their sensor unconditionally; what happens to a reading is the sensor's business:
`ReassemblerStats` keeps the totals behind the rate line and the actor's return value, the
Prometheus sensors (`workers.telemetry.prometheus`) feed `/metrics`, and `fan_out` combines them.
Nothing here keeps per-event history: every reading folds into a fixed-size total.
"""

from __future__ import annotations

from collections.abc import Mapping


class ReassemblerSensor:
    """Readings of a reassembler worker; the base class ignores them all."""

    def on_receipts(self, n: int) -> None:
        """`n` receipt records were consumed."""

    def on_commit(self, *, seconds: float, finalized: int, dead_letters: Mapping[str, int]) -> None:
        """A step's transaction committed, with how long the step took and what it emitted."""

    def on_abort(self) -> None:
        """A step's transaction failed; the worker rebuilt from committed state."""

    def on_retry(self, what: str) -> None:
        """A Kafka call the worker needs (restoring a partition, a new producer) failed and is retried."""

    def on_open_groups(self, n: int, *, paused: bool) -> None:
        """Open prompt groups after a step, and whether fetching is paused for backpressure."""

    def on_lag(self, topic: str, lags: Mapping[int, int]) -> None:
        """Records between the worker's position and the end, per assigned partition (others dropped)."""

    def on_swept(self, n: int) -> None:
        """A sweep of the staging partition cleared `n` staged rows no receipt will use (0: none found)."""

    def on_handed_back(self, n: int) -> None:
        """`n` groups whose staging rows were all gone (TQ lost with the job) were handed back to regenerate."""

    def on_fenced(self, what: str) -> None:
        """The worker's `what` ("producer" or "member") was fenced: another process took its id, or the
        coordinator aborted a transaction past its timeout; ridden out once, or the worker stops."""


class TrainerSensor:
    """Readings of the trainer's experience consumer; the base class ignores them all."""

    def on_yield(self, version: int, group_min_wv: int) -> None:
        """A prompt group was handed to the trainer at weight version `version`."""

    def on_evict(self, n: int = 1) -> None:
        """Groups dropped (or routed to replay) as too stale."""

    def on_duplicate(self, n: int = 1) -> None:
        """Finalized records dropped because their prompt group was already taken in."""

    def on_undecodable(self, n: int = 1) -> None:
        """Finalized records that did not decode, sent to the trainer's dead-letter topic."""

    def on_missing_rows(self, n: int = 1) -> None:
        """Groups never consumed whose rows were missing from TQ: handed back, else dead-lettered."""

    def on_handed_back(self, n: int = 1) -> None:
        """Of those, groups handed back to the rollout workers to generate again."""

    def on_version(self, version: int) -> None:
        """The trainer's weight version is now `version` (at start, on each step, on a restore)."""

    def on_partitions_waiting(self, n: int) -> None:
        """Partitions assigned to the trainer and not read yet, their start unknown (`workers/trainer/starts.py`):
        a commit not read yet or unreadable, the progress entry it names missing, a seek refused."""

    def on_commit_reads_failed(self, n: int = 1) -> None:
        """Attempts to start an assigned partition that failed (each is asked again after a delay)."""


class PoolSensor:
    """Readings of a supervisor of worker processes (`rlstream reassemble --workers N`); the base ignores them."""

    def on_worker(self, worker_id: str) -> None:
        """The pool runs a worker under `worker_id` (its first process started)."""

    def on_exit(self, worker_id: str, how: str) -> None:
        """A process of `worker_id` ended: `how` is one of `POOL_EXITS`."""

    def on_restart(self, worker_id: str, *, by_spare: bool) -> None:
        """A crashed worker runs again: the warm spare took its id (`by_spare`), or a new process started."""

    def on_running(self, workers: int, *, spare_ready: bool) -> None:
        """Worker processes running now, and whether a warm spare is ready to take over."""


# How a pool's worker process can end: crashed (to be restarted), fenced (exit 78, a live twin holds
# its id: never restarted), stopped (a forwarded stop, or exit 0) and failed (a non-zero exit the pool
# does not restart: during a stop, or with nothing to restart it with).
POOL_EXITS = ("crashed", "fenced", "stopped", "failed")


class ReassemblerStats(ReassemblerSensor):
    """Running totals of one worker: what the rate line prints and the actor returns."""

    def __init__(self) -> None:
        self.receipts = 0
        self.finalized = 0
        self.dead_letters: dict[str, int] = {}
        self.transactions = 0
        self.aborts = 0
        self.retries = 0
        self.open_groups = 0
        self.paused = False
        self.commit_seconds_total = 0.0
        self.swept = 0
        self.handed_back = 0

    def on_receipts(self, n: int) -> None:
        self.receipts += n

    def on_commit(self, *, seconds: float, finalized: int, dead_letters: Mapping[str, int]) -> None:
        self.transactions += 1
        self.finalized += finalized
        self.commit_seconds_total += seconds
        for kind, n in dead_letters.items():
            self.dead_letters[kind] = self.dead_letters.get(kind, 0) + n

    def on_abort(self) -> None:
        self.aborts += 1

    def on_retry(self, what: str) -> None:
        self.retries += 1

    def on_open_groups(self, n: int, *, paused: bool) -> None:
        self.open_groups, self.paused = n, paused

    def on_swept(self, n: int) -> None:
        self.swept += n

    def on_handed_back(self, n: int) -> None:
        self.handed_back += n

    def snapshot(self) -> dict[str, object]:
        """Plain totals (what a Ray actor returns)."""
        return {
            "receipts": self.receipts,
            "finalized": self.finalized,
            "dead_letters": dict(self.dead_letters),
            "transactions": self.transactions,
            "aborts": self.aborts,
            "retries": self.retries,
            "open_groups": self.open_groups,
            "swept": self.swept,
            "handed_back": self.handed_back,
        }


class _FanOut:
    def __init__(self, sensors) -> None:
        self._sensors = tuple(sensors)

    def __getattr__(self, name: str):
        calls = [getattr(s, name) for s in self._sensors]

        def call(*args, **kwargs) -> None:
            for c in calls:
                c(*args, **kwargs)

        return call


def fan_out(*sensors):
    """One sensor that passes every reading to each of `sensors` (of one role)."""
    return sensors[0] if len(sensors) == 1 else _FanOut(sensors)
