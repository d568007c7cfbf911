"""Telling a live twin from a fence a worker rides out: when a fenced reassembler stops, and when it goes on.

Two fences reach a worker, and neither says who caused it:

- **Its producer's** (`_FENCED` on a commit or an abort): another producer initialised transactions
  under its transactional id (a twin, or a successor that took over from it while it was frozen),
  or the coordinator aborted a transaction that outlived `transaction_timeout_ms` (a commit stalled
  by a coordinator lost with its broker, or by a freeze of the worker itself).
- **Its consumer's** (static membership, `MemberFenced`): another consumer joined under its
  `group.instance.id`, or its own join, retried while the coordinator stalled, landed twice.

The rule, for both: a fence is ridden out once, with a new producer (or consumer) and the step
again from what was committed; fenced again soon after that, in a transaction shorter than its
timeout, the worker has a live twin and stops (`WorkerFenced`, exit 78, never restarted). A fence
of a transaction open past its timeout is the coordinator's and always ridden out.

Why the right one stops: two live processes under one id each ride out the first fence the other
causes, so they trade fences, and the one fenced again after re-initialising is the one that
re-initialised first, that is, the one that was fenced first: the older process. A zombie woken
from a long freeze finds its transaction fenced (by its successor's init, or by the coordinator:
open past its timeout either way), re-initialises and so fences the live worker; the live worker,
fenced once, re-initialises and fences the zombie back; the zombie, fenced again after having
re-initialised, stops. The live worker loses one step, which it retries.

"Soon" is `TWIN_WINDOW_SESSIONS` session timeouts: long enough for the other process's next
transaction to meet its fence, short enough that a coordinator outage ridden out an hour ago does
not make a worker take the next fence for a twin's. The order above needs the live worker to meet
its fence within that window of the zombie's re-initialising: a live worker with no transaction
for longer (nothing to finalize) re-initialises late, the zombie then takes its next fence for a
first one, and the live worker, fenced again soon after, is the one that stops. One of the two
goes on either way, and nothing is lost or duplicated on the way: every fence only aborts a step,
which is rebuilt from what was committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from workers.reassembler.errors import MemberFenced, WorkerFenced

log = logging.getLogger("rlstream.reassembler")

# A worker fenced again within this many session timeouts of riding out a fence has a live twin.
TWIN_WINDOW_SESSIONS = 10


class TwinWatch:
    """The fences one worker rode out, to tell the next one apart (see the module docstring)."""

    def __init__(
        self,
        worker_id: str,
        transactional_id: str,
        *,
        session_timeout_s: float,
        transaction_timeout_s: float,
        clock: Callable[[], float],
    ):
        self.worker_id, self.transactional_id = worker_id, transactional_id
        self.transaction_timeout_s = transaction_timeout_s
        self.window_s = TWIN_WINDOW_SESSIONS * session_timeout_s
        self._clock = clock
        # When this worker last started a new producer after a fence, and joined again after one.
        self._reinitialised_at: float | None = None
        self._rejoined_at: float | None = None

    def _soon(self, since: float | None) -> bool:
        return since is not None and self._clock() - since < self.window_s

    def producer_fenced(self, open_s: float) -> None:
        """The producer was fenced `open_s` into a transaction: returns when the worker should start a
        new producer and retry; raises `WorkerFenced` when a live twin holds the transactional id."""
        timeout_s = self.transaction_timeout_s
        if open_s >= timeout_s:
            log.warning(
                "%s: the transaction was open %.1fs, past its %.0fs timeout, so the coordinator aborted it; "
                "starting a new producer",
                self.worker_id,
                open_s,
                timeout_s,
            )
        elif self._soon(self._reinitialised_at):
            raise WorkerFenced(
                f"{self.worker_id}: another live worker uses transactional id {self.transactional_id!r}: fenced "
                f"{open_s:.1f}s into a transaction (within its {timeout_s:.0f}s timeout) less than "
                f"{self.window_s:.0f}s after this worker had started a new producer for the same reason; "
                "stopping this one"
            )
        else:
            log.warning(
                "%s: fenced %.1fs into a transaction, within its %.0fs timeout: another producer started under "
                "transactional id %r (a twin, or a worker that took over while this one was frozen); starting a "
                "new producer, and stopping if fenced so again within %.0fs",
                self.worker_id,
                open_s,
                timeout_s,
                self.transactional_id,
                self.window_s,
            )
        self._reinitialised_at = self._clock()

    def member_fenced(self, fenced: MemberFenced) -> None:
        """The coordinator fenced this static member: returns when the worker should join again with a
        new consumer; raises `fenced` when it was fenced so soon after joining again already."""
        if self._soon(self._rejoined_at):
            raise fenced
        self._rejoined_at = self._clock()
        log.warning("%s: %s; joining again with a new consumer", self.worker_id, fenced)
