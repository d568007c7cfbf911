"""What rlstream keeps inside a trainer's checkpoint directory: the consumer's state and a spill of TQ's rows.

A trainer that checkpoints calls `save_into_checkpoint(directory, consumer, store)` while it writes
its checkpoint (before it makes the directory the latest, e.g. by renaming it into place), then
`consumer.checkpoint_durable(state)` with the state it returned once the checkpoint is safely
stored. The directory then holds `rlstream-consumer.json` (the state, plain JSON) and `rows.spill`
(`spill.py`), bound to each other by the state's run and cut: after a whole-job restart, `resume.py`
reads both back, puts back the rows that records past the checkpoint still need, and tells what
will be handed back instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from streams.tq import STAGING, KVStore
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.errors import SpillError
from workers.trainer.spill import SPILL_FILE, SpillSummary, spill_rows
from workers.trainer.spill_read import Spill, read_spill

STATE_FILE = "rlstream-consumer.json"


def spill_binding(state: Mapping[str, Any]) -> str:
    """The name a spill carries of the consumer state it was written with: its run and cut."""
    return f"{state.get('run', '')}:{state.get('cut', -1)}"


def save_into_checkpoint(
    directory: str | Path, consumer: ExperienceConsumer, store: KVStore, *, spill: bool = True
) -> tuple[dict[str, Any], SpillSummary | None]:
    """Write the consumer's state (and, unless `spill` is off, every row of its TQ partitions) into `directory`.

    Returns the state, for `consumer.checkpoint_durable(state)` once the checkpoint is stored, and what
    the spill wrote. The state is cut first: rows acked after it stay in TQ until a later durable
    checkpoint, so every group the state does not count as resolved is in the spill, by its train
    rows or by its staged ones, unless TQ lost them before.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = consumer.state_dict()
    summary = None
    if spill:
        # Staging first: a group finalized while the spill reads has its train rows put before its
        # staging is cleared, so it is caught in one form or the other, never in neither.
        partitions = (STAGING, consumer.config.train_partition)
        summary = spill_rows(store, directory, binding=spill_binding(state), partitions=partitions)
    tmp = directory / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, directory / STATE_FILE)
    return state, summary


def load_state(directory: str | Path) -> dict[str, Any]:
    """The consumer state saved in `directory`, for `ExperienceConsumer.load_state_dict` (SpillError if unreadable)."""
    path = Path(directory) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpillError(f"{path}: no readable rlstream consumer state ({exc})") from None
    # JSON keys are strings; the state's partitions are numbered.
    state["partitions"] = {int(p): mark for p, mark in state.get("partitions", {}).items()}
    return state


def load_from_checkpoint(directory: str | Path) -> tuple[dict[str, Any], Spill | None]:
    """The consumer state saved in `directory`, and its spill (None when it was saved without one).

    Raises SpillError when the state is missing or unreadable, or a spill is there but unusable.
    """
    state = load_state(directory)
    if not (Path(directory) / SPILL_FILE).exists():
        return state, None
    return state, read_spill(directory, binding=spill_binding(state))
