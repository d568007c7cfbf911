"""`TrainerVersion`: the trainer's current weight version, published on a compacted topic for admission gates."""

from __future__ import annotations

from schemas.codec import Message
from schemas.validate import at_least, non_empty


class TrainerVersion(Message, frozen=True, tag="trainer_version"):
    """The weight version a trainer trains at now, how many prompt groups one version consumes, and how
    many groups it lost.

    Keyed by `trainer_id` on a compacted topic, so the latest record per trainer is what a rollout
    worker's admission gate reads (`workers/rollout/gate.py`). `batch_groups` is the number of prompt
    groups the trainer consumes per weight-version step (its batch times the batches per step).
    `lost_groups` counts the groups it took in and will never train (evicted as too stale, dropped for
    rows missing from TQ), each once, since `run` (one publisher's life) began: the gate gives their
    capacity back. Both are newer than 1.0: a record without them decodes as 0 and "" (no losses known).
    """

    trainer_id: str
    consumer_group: str
    version: int
    batch_groups: int
    time_ms: int
    lost_groups: int = 0
    run: str = ""

    def _validate(self) -> None:
        if (
            self.trainer_id
            and self.consumer_group
            and self.version >= 0
            and self.batch_groups >= 1
            and self.time_ms >= 0
            and self.lost_groups >= 0
        ):
            return
        non_empty("trainer_version.trainer_id", self.trainer_id)
        non_empty("trainer_version.consumer_group", self.consumer_group)
        at_least("trainer_version.version", self.version, 0)
        at_least("trainer_version.batch_groups", self.batch_groups, 1)
        at_least("trainer_version.time_ms", self.time_ms, 0)
        at_least("trainer_version.lost_groups", self.lost_groups, 0)
