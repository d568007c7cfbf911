"""Where a test or drill injects a fault into a reassembler step: an object passed in, never a setting.

`ReassemblerWorker` calls its `Faults` at fixed points of every step; the base class does nothing,
and no configuration file, flag or environment variable can reach another one. Tests and drills
build their worker with the faults they want (`tests/tools/faults.py` has the drills' crash and
freeze points; unit tests pass their own), so a production process cannot be told to kill itself.
"""

from __future__ import annotations

from collections.abc import Sequence


class Faults:
    """The points of a step, in order; each hook may raise, sleep, or stop the process."""

    def before_put(self, put: int, sample_ids: Sequence[str]) -> None:
        """Before the step's `put`-th TQ put (0-based) of these rows, before the lease is asked about it."""

    def after_put(self) -> None:
        """After the step's last TQ put, before its transaction begins."""

    def before_commit(self) -> None:
        """Inside the open transaction, its records flushed to the broker and its offsets sent, before the commit."""

    def after_commit(self) -> None:
        """After the commit, before the staging of the step's closed groups is cleared."""


NO_FAULTS = Faults()
