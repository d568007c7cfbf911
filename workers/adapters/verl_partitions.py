"""verl's own TQ partitions as rlstream's replay buffer finds them, and the prompts verl must dispatch again.

verl 0.9.1 keeps two partitions of its own in the TQ it shares with rlstream: ``train`` (a prompt key
per dispatched prompt, tagged ``is_prompt`` with a ``status`` and ``global_steps``, put by
``_submit_batch_to_rollout``; and the rows a sampler hands verl for a step) and ``val`` (validation
prompts and trajectories, cleared by verl's own buffer as it samples them). Both outlive a verl
process that dies, so a new run finds what the dead one left (`clean_on_start`).

rlstream's agent-loop worker clears a prompt's key once its group is published and marks it
``status: failure`` (verl's word) when the group will never reach the trainer (every rollout failed,
or nothing could be published). `Refills` turns those, and the groups rlstream's consumer counts as
lost, into prompts verl dispatches in their place (verl's ``refill_fn``), as verl's own buffers do
for the groups they evict: otherwise a trainer waits for groups that never come (for ever in
``sync`` mode, where verl dispatches exactly one batch per step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from streams.tq import KVStore
from workers.trainer.intake import ConsumerCounts

log = logging.getLogger("rlstream.adapters.verl")

TRAIN, VAL = "train", "val"
FAILURE = "failure"
# The tag of a prompt whose group will never reach the trainer, whole rather than just the status:
# the put creates the key if verl's has gone meanwhile, and it must still read as a prompt.
FAILED_PROMPT_TAG = {"is_prompt": True, "status": FAILURE}


def _prompt_keys(store: KVStore, *, status: str | None = None) -> list[str]:
    return [
        k
        for k, tag in store.list(TRAIN).items()
        if (tag or {}).get("is_prompt") and (status is None or tag.get("status") == status)
    ]


def sweep_rlstream_rows(store: KVStore, partition: str) -> int:
    """Clear rows an earlier run's sampler put into verl's `partition` (verl clears them only after training).

    Those of groups not trained come again on the same keys; those trained are covered by the
    restored state and would stay for ever.
    """
    left = [k for k, tag in store.list(partition).items() if "rlstream_group_id" in (tag or {})]
    if left:
        log.info("clearing %d row(s) of an earlier run from verl's partition %r", len(left), partition)
        store.clear(partition, left)
    return len(left)


class Refills:
    """Groups that will never reach verl's trainer, and verl's ``refill_fn`` to dispatch a prompt for each.

    Owed: each prompt key marked failure (taken off ``train``), and each group the consumer counts
    lost (evicted as stale, rows missing, dead-lettered as unusable) that was not handed back for
    regeneration, less those `excuse`d (groups of a dead run, not of this run's dispatch).
    """

    def __init__(self, store: KVStore, counts: ConsumerCounts, refill_fn: Callable[[int], object] | None):
        self._store = store
        self._counts = counts
        self._refill_fn = refill_fn
        self._excused = 0
        self._seen = self._lost()
        self.dispatched = 0  # prompts verl dispatched in place of lost groups, so far

    def _lost(self) -> int:
        return self._counts.lost - self._counts.handed_back - self._excused

    def excuse(self, n: int = 1) -> None:
        """`n` lost groups owe no prompt (not of this run's dispatch)."""
        self._excused += n

    def settle(self) -> int:
        """Have verl dispatch a prompt for each group owed since the last call; returns how many."""
        failed = _prompt_keys(self._store, status=FAILURE)
        lost = self._lost()
        owed = len(failed) + max(0, lost - self._seen)
        if owed and self._refill_fn is not None:
            try:
                self._refill_fn(owed)
            except ValueError as exc:
                # verl's _next_train_batch fetches whole gen_batch_size chunks; sync mode needs chunks
                # of 1. Raising would crash verl on the same losses after every restart: said, dropped.
                log.error(
                    "%d group(s) will never reach verl's trainer and verl cannot dispatch that many prompts in"
                    " their place (%s); in sync mode set trainer.v1.sampler.sync_refill_failed_groups=true, which"
                    " makes verl fetch prompts one at a time (data.gen_batch_size=1)",
                    owed,
                    exc,
                )
                owed = 0
            else:
                self.dispatched += owed
                log.warning(
                    "%d group(s) will never reach verl's trainer (%d of them failed in rollout); verl dispatched"
                    " as many prompts in their place",
                    owed,
                    len(failed),
                )
        elif self._refill_fn is None:
            owed = 0
        # Only now: a refill that raised otherwise (Ray, TQ) leaves them owed for the next call.
        if failed:
            self._store.clear(TRAIN, failed)  # nothing else reads them; verl's async resume skips them
        self._seen = max(self._seen, lost)
        return owed
