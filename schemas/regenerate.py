"""`Regenerate`: a prompt group handed back to the rollout workers because its tensors are gone.

After a whole-job restart (Ray and TQ lost, Kafka kept) a group's receipts or finalized record may name
rows TQ no longer holds. Instead of a `missing_rows` dead letter the group is handed back: this record
names the prompt to generate again, the group it replaces, the weight version it was sampled at and
why. The regenerated group gets a derived id (`regenerated_group_id`), so its receipts can never be
taken for, or deduplicated against, the original's.
"""

from __future__ import annotations

from schemas.codec import Message
from schemas.errors import SchemaError
from schemas.validate import at_least, non_empty

# Why a group was handed back.
STAGING_LOST = "staging_lost"  # the reassembler found none of its staging rows in TQ
TRAIN_ROWS_LOST = "train_rows_lost"  # the trainer found a finalized record whose train rows are gone
REGENERATE_REASONS = frozenset({STAGING_LOST, TRAIN_ROWS_LOST})

# A group regenerated this many times whose staging is gone again is dead-lettered, not handed back:
# a publisher whose receipts name rows it never staged must not loop through regeneration forever.
MAX_REGENERATIONS = 3

# Separates an original group id from its regeneration count: `g~r1`, `g~r2`, ...
_MARK = "~r"


def regeneration_of(group_id: str) -> tuple[str, int]:
    """(original group id, how many times it was regenerated): `("g", 0)` for `g`, `("g", 2)` for `g~r2`."""
    base, sep, count = group_id.rpartition(_MARK)
    if sep and base and count.isdigit() and not count.startswith("0"):
        return base, int(count)
    return group_id, 0


def regenerated_group_id(group_id: str) -> str:
    """The id the next regeneration of `group_id` is published under (`g` -> `g~r1`, `g~r1` -> `g~r2`).

    Derived, not random, so a hand-back sent twice (at least once delivery) regenerates under one id,
    and the reassembler's duplicate checks drop the second copy.
    """
    base, n = regeneration_of(group_id)
    return f"{base}{_MARK}{n + 1}"


class Regenerate(Message, frozen=True, tag="regenerate"):
    """Generate prompt `prompt_idx` again as group `new_group_id`, replacing `group_id` (whose rows are lost).

    Keyed by `group_id` on `<prefix>.rollout.regenerate`. `weight_version` is the highest policy version
    the lost group was sampled at (a regeneration may use a newer one); `source` names the record that
    was handed back (`topic[partition]@offset`, or `@first-last` for the receipts of a group the
    reassembler hands back), so it can be accounted for after a restart.
    """

    prompt_idx: int
    group_id: str
    new_group_id: str
    group_size: int
    weight_version: int
    reason: str
    source: str
    worker_id: str
    time_ms: int

    def _validate(self) -> None:
        at_least("regenerate.prompt_idx", self.prompt_idx, 0)
        non_empty("regenerate.group_id", self.group_id)
        non_empty("regenerate.new_group_id", self.new_group_id)
        if self.new_group_id == self.group_id:
            raise SchemaError("regenerate.new_group_id", "must differ from the group it replaces")
        at_least("regenerate.group_size", self.group_size, 1)
        at_least("regenerate.weight_version", self.weight_version, 0)
        # Any non-empty reason: a newer writer may add reasons in a minor version.
        non_empty("regenerate.reason", self.reason)
        non_empty("regenerate.source", self.source)
        non_empty("regenerate.worker_id", self.worker_id)
        at_least("regenerate.time_ms", self.time_ms, 0)
