"""What rlstream keeps inside a trainer's checkpoint directory: the consumer's state, its resolved groups
and a spill of TQ's rows.

A trainer that checkpoints calls `save_into_checkpoint(directory, consumer, store)` while it writes
its checkpoint (before it makes the directory the latest, e.g. by renaming it into place), then
`consumer.checkpoint_durable(state)` with the state it returned once the checkpoint is safely
stored. `begin_checkpoint` is the same with the spill written off the trainer's thread: the trainer
trains on and finishes the checkpoint once `done()` (the spill reads every row TQ holds, which
would otherwise stall it; acks in the meantime keep their rows, as between any two checkpoints).

The directory then holds `rlstream-consumer.json` (the state, plain JSON), `rlstream-resolved`
(`resolved.py`: the groups the consumer remembered resolved, to drop their duplicates after a
restore) and `rows.spill` (`spill.py`), bound to each other by the state's run and cut. After a
whole-job restart, `resume.py` reads them back, puts back the rows that records past the checkpoint
still need, and tells what will be handed back instead; `load_state` gives a restored consumer
its state and resolved groups.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from schemas.errors import InvalidArgument
from streams.tq import STAGING, KVStore
from workers.trainer.checkpoint import decode_state, resolved_at_cut
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.errors import SpillError
from workers.trainer.resolved import has_resolved, read_resolved, write_resolved
from workers.trainer.spill import SPILL_FILE, SpillSummary, spill_rows
from workers.trainer.spill_read import Spill, read_spill

STATE_FILE = "rlstream-consumer.json"


def spill_binding(state: Mapping[str, Any]) -> str:
    """The name a spill carries of the consumer state it was written with: its run and cut."""
    return f"{state.get('run', '')}:{state.get('cut', -1)}"


class CheckpointWrite:
    """rlstream's part of a checkpoint being written: the state cut now, the spill (maybe) still running.

    `state` is for `consumer.checkpoint_durable(state)` once the trainer stored its checkpoint; it is
    given only once `wait()` returned: declared durable while its spill still reads, the checkpoint's
    commits and clears would run ahead of a spill that may yet fail, and the trainer must not make a
    checkpoint the latest before its spill is written. `wait` raises what the spill raised: that
    checkpoint must not be made the latest, and its state is never given.
    """

    def __init__(self, state: dict[str, Any], run) -> None:
        self._state = state
        self._summary: SpillSummary | None = None
        self._error: BaseException | None = None
        self._waited = run is None
        self._thread: threading.Thread | None = None
        if run is None:
            return
        self._thread = threading.Thread(target=self._run, args=(run,), name="rlstream-spill", daemon=True)
        self._thread.start()

    @property
    def state(self) -> dict[str, Any]:
        """The state cut for this checkpoint; InvalidArgument before `wait()` returned, or if the spill failed."""
        if self._error is not None and self._waited:
            raise InvalidArgument(f"this checkpoint's spill failed ({type(self._error).__name__}: {self._error})")
        if not self._waited:
            raise InvalidArgument("the checkpoint's spill may still be running: wait() for it before using its state")
        return self._state

    def _run(self, run) -> None:
        try:
            self._summary = run()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread by wait()
            self._error = exc

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> SpillSummary | None:
        """The spill's summary once written (None without a spill); TimeoutError if still running."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"the checkpoint's spill is still being written after {timeout_s} s")
        self._waited = True
        if self._error is not None:
            raise self._error
        return self._summary


def begin_checkpoint(
    directory: str | Path, consumer: ExperienceConsumer, store: KVStore, *, spill: bool = True, background: bool = True
) -> CheckpointWrite:
    """Write the consumer's state and its resolved groups into `directory` now, and (unless `spill` is off)
    every row of its TQ partitions, in the background unless `background` is off.

    The state is cut first: rows acked after it stay in TQ until a later durable checkpoint, so every
    group the state does not count as resolved is in the spill, by its train rows or by its staged
    ones, unless TQ lost them before. The resolved groups are taken on this thread, at the cut.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = consumer.state_dict()
    binding = spill_binding(state)
    marks = decode_state(state, topic=state["topic"], consumer_group=state["consumer_group"]).partitions
    resolved = list(resolved_at_cut(consumer.resolved_groups(), marks))
    tmp = directory / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, directory / STATE_FILE)
    # Staging first: a group finalized while the spill reads has its train rows put before its
    # staging is cleared, so it is caught in one form or the other, never in neither.
    partitions = (STAGING, consumer.config.train_partition)

    def run() -> SpillSummary | None:
        write_resolved(directory, binding, resolved)
        if not spill:
            return None
        return spill_rows(store, directory, binding=binding, partitions=partitions)

    if background:
        return CheckpointWrite(state, run)
    done = CheckpointWrite(state, None)
    done._summary = run()
    return done


def save_into_checkpoint(
    directory: str | Path, consumer: ExperienceConsumer, store: KVStore, *, spill: bool = True
) -> tuple[dict[str, Any], SpillSummary | None]:
    """`begin_checkpoint` done on this thread: returns the state, for `consumer.checkpoint_durable(state)`
    once the checkpoint is stored, and what the spill wrote."""
    write = begin_checkpoint(directory, consumer, store, spill=spill, background=False)
    return write.state, write.wait()


def load_state(directory: str | Path, *, resolved: bool = True) -> dict[str, Any]:
    """The consumer state saved in `directory`, with the groups it had resolved (unless `resolved` is off),
    for `ExperienceConsumer.load_state_dict` (SpillError if unreadable)."""
    path = Path(directory) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpillError(f"{path}: no readable rlstream consumer state ({exc})") from None
    # JSON keys are strings; the state's partitions are numbered.
    state["partitions"] = {int(p): mark for p, mark in state.get("partitions", {}).items()}
    if resolved and has_resolved(directory):
        marks = decode_state(state, topic=state.get("topic"), consumer_group=state.get("consumer_group")).partitions
        # Also for a file written before it was filtered so (issue 30 review, item 1).
        state["resolved"] = list(resolved_at_cut(read_resolved(directory, spill_binding(state)), marks))
    return state


def load_from_checkpoint(directory: str | Path, *, resolved: bool = True) -> tuple[dict[str, Any], Spill | None]:
    """The consumer state saved in `directory` (with its resolved groups unless `resolved` is off: `resume`
    reads them a message at a time), and its spill opened for reading (None when it was saved without one;
    the caller closes it).

    Raises SpillError when the state is missing or unreadable, or a spill is there but unusable.
    """
    state = load_state(directory, resolved=resolved)
    if not (Path(directory) / SPILL_FILE).exists():
        return state, None
    return state, read_spill(directory, binding=spill_binding(state))
