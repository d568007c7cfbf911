"""How many ready groups one reassembler step finalizes: fewer after a step too slow for the poll interval.

A step that runs past 3/4 of `max_poll_interval_ms` is aborted (the lease refuses its puts, or the
overlapped poll after its staging read, or its commit is refused once the consumer left its group)
and its records come back after the rebuild: finalizing as many again would only run out of time
again, forever. So the next steps take half
as many groups (the rest stay ready; offsets never pass them), doubling again after each step done
within 1/8 of the interval. Time the process spent frozen is not the step's (`Lease.slow_step`): a
freeze aborts a step without shrinking it.
"""

from __future__ import annotations

import logging

from workers.reassembler.lease import SLOW_STEP_SHARE

log = logging.getLogger("rlstream.reassembler")

# A step that finished within this share of max.poll.interval lets the next one finalize twice as many groups.
FAST_STEP_SHARE = 0.125


class StepSize:
    """The most ready groups the next step finalizes (`groups`), between 1 and `max_groups`."""

    def __init__(self, worker_id: str, max_groups: int, max_poll_interval_ms: int):
        self.worker_id, self.max_groups, self.max_poll_interval_ms = worker_id, max_groups, max_poll_interval_ms
        self.groups = max_groups

    def committed(self, finalized: int, seconds: float) -> None:
        """A step of `finalized` ready groups committed in `seconds`: a full one done fast lets the next grow."""
        if finalized >= self.groups and seconds < self.max_poll_interval_ms / 1000 * FAST_STEP_SHARE:
            self.groups = min(self.max_groups, self.groups * 2)

    def too_slow(self, groups: int) -> None:
        """A step of `groups` ready groups ran out of its share of the poll interval: the next take half."""
        self.groups = max(1, min(self.groups, groups) // 2)
        alone = groups <= 1
        log.log(
            logging.ERROR if alone else logging.WARNING,
            "%s: a step of %d group(s) ran past %.0f%% of max_poll_interval_ms (%d ms); next steps finalize at "
            "most %d%s",
            self.worker_id,
            groups,
            SLOW_STEP_SHARE * 100,
            self.max_poll_interval_ms,
            self.groups,
            " (one group alone is too slow: raise max_poll_interval_ms)" if alone else "",
        )
