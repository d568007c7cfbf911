"""Train rows an earlier attempt put for a group that is now decided without rows: cleared in the deciding step.

A group's training rows have deterministic sample ids, `{group_id}_g{i}` for every i below its
group size (`schemas.payload.group_sample_ids`): a finalized group always has all of them, put in
one put, so two attempts that both finalize it put the same keys (the second overwrites the first)
and its record names every one. An attempt that put them and never committed (killed after its put,
aborted, or a zombie's refused step) leaves them behind, though, when the attempt that does commit
decides the group otherwise: dead-lettered (a successor of another version judging its re-read
receipts more strictly, a build that now fails) or handed back (its staged rows gone meanwhile). No
record will ever name those rows, so no trainer reads or clears them.

They are cleared before the deciding step commits. Which rows are an uncommitted attempt's:

- Each train row is tagged with the attempt that put it (`ATTEMPT_TAG`): its group's receipts
  partition and first receipt's offset, the same for every attempt at that group (each re-reads the
  same receipts) and another for a group of the same id published again after the first closed and
  was forgotten (`closed_retention_s`). Only rows tagged with the deciding group's position are
  cleared: a committed record of an earlier group of that id keeps its rows, which its trainer still
  reads. Rows a version before this tag put carry none and are left alone.
- Only groups decided while an earlier attempt can exist are looked at: the only uncommitted step of
  a partition is the one in flight when its last owner stopped, or this worker's own aborted step,
  and it read at most `max_poll_records` past the last commit (`PartitionTask.may_hold_earlier_attempt`).
  A worker past that asks TQ nothing, so TQ's controller does not log, every step, a WARNING listing
  the `{g}_g*` keys it did not find. Then one key a group is looked up (an attempt puts all of a
  group's rows in one put), and the rows of the groups found are cleared.
- Over Ray RPC (`RolloutReassemblerActor.finalize`, no receipts partition) nothing is committed and
  a repeated call may follow one whose record the caller took: nothing is cleared there.

A crash before the commit leaves a group its successor decides again (and finalizes with rows put
anew if it does finalize); after the commit nothing is left to clear. The clear asks the worker's
lease before deleting, like a put (`streams.tq.with_clear_guard`); a refusal aborts the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from schemas.payload import group_sample_ids
from streams.errors import ClearRefused, TQError
from streams.tq import KVStore
from workers.reassembler.errors import LeaseRefused, StepAborted
from workers.reassembler.groups import OpenGroup

# The train-row tag naming the attempt that put the row: [receipts partition, first receipt's offset].
ATTEMPT_TAG = "attempt"


def attempt_of(group: OpenGroup) -> list[int] | None:
    """`ATTEMPT_TAG`'s value for rows an attempt at `group` puts; None over Ray RPC (no receipts partition)."""
    return None if group.partition < 0 else [group.partition, group.first_offset]


def clear_abandoned_rows(store: KVStore, train_partition: str, rowless: Sequence[OpenGroup]) -> None:
    """Clear the train rows an earlier attempt at one of `rowless` put (groups this step decides without
    rows, each of which may have had one): one lookup of a key a group, then one clear."""
    firsts = {group_sample_ids(g.group_id, 1)[0]: g for g in rowless if attempt_of(g) is not None}
    if not firsts:
        return
    try:
        found = store.tags(train_partition, list(firsts))
        keys = [
            key
            for first, tag in found.items()
            if _same(tag.get(ATTEMPT_TAG), attempt_of(firsts[first]))
            for key in group_sample_ids(firsts[first].group_id, firsts[first].group_size)
        ]
        if keys:
            store.clear(train_partition, keys)
    except ClearRefused as exc:
        raise LeaseRefused(f"not clearing train rows of group(s) decided without rows: {exc}") from exc
    except TQError as exc:  # nothing is committed yet: the rebuilt step decides the same groups again
        raise StepAborted(f"clearing train rows an earlier attempt put failed ({exc})") from exc


def _same(tagged: Any, attempt: list[int] | None) -> bool:
    # A tag read back may be a list or a tuple, as the store serialized it.
    return isinstance(tagged, list | tuple) and list(tagged) == attempt
