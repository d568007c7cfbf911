"""What the trainer does with a group it never consumed whose rows are gone from TQ: hand it back, or dead-letter it.

Rows vanish for good when TQ dies with the job while Kafka keeps the finalized record (a whole-job
restart), or when someone else cleared them. Such a group cannot be trained, but its prompt can be
generated again: the trainer sends a `Regenerate` (reason `train_rows_lost`) to
`<prefix>.rollout.regenerate` for the rollout workers, in place of the `missing_rows` dead letter it
used to be. A group already regenerated `MAX_REGENERATIONS` times, or any group when
`ConsumerConfig.hand_back_lost_rows` is off, still ends as that dead letter: receipts that keep
naming rows nobody stages must not loop through regeneration.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from schemas.finalized import FinalizedGroup
from schemas.regenerate import MAX_REGENERATIONS, TRAIN_ROWS_LOST, Regenerate, regenerated_group_id, regeneration_of
from workers.trainer.config import ConsumerConfig
from workers.trainer.deadletters import MISSING_ROWS, make_letter
from workers.trainer.outbox import Notice

# The kind of a hand-back notice (a dead letter's kind is its error kind).
HANDED_BACK = "handed_back"


def lost_rows_notice(
    config: ConsumerConfig,
    group: FinalizedGroup,
    partition: int,
    offset: int,
    lost: Sequence[str],
    *,
    worker_id: str,
    time_ms: int | None = None,
) -> tuple[Notice, str]:
    """The notice to send about `group` (at finalized[partition]@offset), whose rows `lost` are gone; and why.

    `time_ms` is when, by the trainer's runtime (None: this process's clock now)."""
    time_ms = int(time.time() * 1000) if time_ms is None else time_ms
    topic, train = config.finalized_topic, config.train_partition
    where = f"{topic}[{partition}]@{offset}"
    message = (
        f"group {group.group_id} at {where}: {len(lost)} of {len(group.sample_ids)} rows missing"
        f" from TQ partition {train!r} (e.g. {', '.join(lost[:3])}), and it was never consumed"
    )
    _, times = regeneration_of(group.group_id)
    if config.hand_back_lost_rows and times < MAX_REGENERATIONS:
        back = Regenerate(
            prompt_idx=group.prompt_idx,
            group_id=group.group_id,
            new_group_id=regenerated_group_id(group.group_id),
            group_size=group.total_row_count,
            weight_version=group.group_max_wv,
            reason=TRAIN_ROWS_LOST,
            source=where,
            worker_id=worker_id,
            time_ms=time_ms,
        )
        notice = Notice(config.topics.regenerate, group.group_id.encode(), back.to_bytes(), HANDED_BACK, where)
        return notice, f"{message}; handed back as {back.new_group_id} on {notice.topic}"
    if config.hand_back_lost_rows:
        message += f"; regenerated {times} times already, so not handed back again"
    letter = make_letter(
        topic,
        partition,
        offset,
        group.group_id.encode(),
        group.to_bytes(),
        MISSING_ROWS,
        message,
        worker_id=worker_id,
        time_ms=time_ms,
    )
    notice = Notice(config.topics.trainer_deadletter, letter.source_key, letter.to_bytes(), MISSING_ROWS, where)
    return notice, f"{message}; dropped and sent to {notice.topic}"
