"""Train rows an earlier attempt put for a group that is now decided without rows: cleared in the deciding step.

A group's training rows have deterministic sample ids, `{group_id}_g{i}` for every i below its
group size (`schemas.payload.group_sample_ids`): a finalized group always has all of them, so two
attempts that both finalize it put the same keys (the second overwrites the first) and its record
names every one. An attempt that put them and never committed (killed after its put, aborted, or a
zombie's refused step) leaves them behind, though, when the attempt that does commit decides the
group otherwise: dead-lettered (a successor of another version judging its re-read receipts more
strictly, a build that now fails) or handed back (its staged rows gone meanwhile). No record will
ever name those rows, so no trainer reads or clears them.

They are cleared before the deciding step commits, not after: until that transaction commits no
committed record can name a group's rows (a group closes exactly once), so any `{group_id}_g{i}`
row found then is an uncommitted attempt's. A crash before the commit leaves a group its successor
decides again (and finalizes with rows put anew if it does finalize); after the commit nothing is
left to clear. No window, no state entry to carry the keys. The clear asks the worker's lease
before deleting, like a put (`streams.tq.with_clear_guard`); a refusal aborts the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.payload import group_sample_ids
from streams.errors import ClearRefused, TQError
from streams.tq import KVStore
from workers.reassembler.errors import LeaseRefused, StepAborted
from workers.reassembler.groups import OpenGroup


def clear_abandoned_rows(store: KVStore, train_partition: str, rowless: Sequence[OpenGroup]) -> None:
    """Clear every train row an earlier attempt may have put for `rowless`, groups this step decides without rows.

    One TQ call for all of them; keys never put are skipped by the clear's own lookup.
    """
    keys = [k for g in rowless for k in group_sample_ids(g.group_id, g.group_size)]
    if not keys:
        return
    try:
        store.clear(train_partition, keys)
    except ClearRefused as exc:
        raise LeaseRefused(f"not clearing train rows of group(s) decided without rows: {exc}") from exc
    except TQError as exc:  # nothing is committed yet: the rebuilt step decides the same groups again
        raise StepAborted(f"clearing train rows an earlier attempt put failed ({exc})") from exc
