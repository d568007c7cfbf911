"""Exactly once across a verl crash: rlstream's consumer state beside verl's checkpoint, and where to resume.

verl 0.9.1 has one checkpoint hook, ``trainer.checkpoint_callback_class``: built on the driver with
``cls(config=<full config>)``, called as ``on_save(trainer, global_step, checkpoint_dir, async_save)``
at the end of ``PPOTrainer._save_checkpoint``, and nothing on load. So:

- `RlstreamCheckpointCallback.on_save` hands the save to verl's replay buffer (rlstream's, reached as
  ``trainer.replay_buffer``), which acks the batches verl trained, writes the consumer's
  ``state_dict()`` to ``global_step_N/rlstream/consumer_state.json`` and declares it durable (offsets
  committed, rows cleared). With ``async_save`` (Megatron) verl writes no tracker yet and the workers
  may still be writing: durability waits until ``latest_checkpointed_iteration.txt`` shows the step.
- verl writes that tracker *before* calling ``on_save``: a crash in between resumes verl at N with no
  state file for N. The replay buffer therefore keeps a step journal (`write_journal`, at every
  training sample): the state before the step and the records handed out in it. verl writes the
  tracker only after the step trained, so the journal of step N plus its records is the state at N.
- `restore_point` mirrors verl's ``_load_checkpoint`` (resume_mode ``auto``/``resume_path``/
  ``disable``) and returns the state to load, before the consumer's first poll.

Files are JSON written to a temporary name, fsynced and renamed: a crash leaves the old or the new.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from schemas.errors import InvalidArgument
from workers.trainer.checkpoint import PartitionMark, decode_state, encode_state

TRACKER = "latest_checkpointed_iteration.txt"  # verl's; read as its find_latest_ckpt_path reads it
STATE_FILE = os.path.join("rlstream", "consumer_state.json")
log = logging.getLogger("rlstream.adapters.verl")
JOURNAL = "rlstream_step_journal.json"


def write_json(path: str, data: Any) -> None:
    """`data` as JSON at `path`, atomically and durably (the old file or the new one after a crash)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def _read_json(path: str) -> Any | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def read_tracker(root: str) -> int | None:
    """The step verl's tracker file names as its latest complete checkpoint, None without one."""
    try:
        with open(os.path.join(root, TRACKER)) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def save_state(checkpoint_dir: str, state: Mapping[str, Any]) -> str:
    """The consumer's state inside verl's ``global_step_N`` folder; returns the file."""
    path = os.path.join(checkpoint_dir, STATE_FILE)
    write_json(path, dict(state))
    return path


def write_journal(root: str, step: int, state: Mapping[str, Any], handed_out: Iterable[tuple[int, int]]) -> None:
    """Step `step`'s journal: the consumer's state and the (partition, offset) of the groups handed out, not acked."""
    write_json(os.path.join(root, JOURNAL), {"step": step, "state": dict(state), "handed_out": list(handed_out)})


def mark_trained(state: Mapping[str, Any], positions: Iterable[tuple[int, int]], *, topic: str, group: str) -> dict:
    """`state` with the records at `positions` counted as trained (a journal's step, once verl's tracker shows it)."""
    st = decode_state(dict(state), topic=topic, consumer_group=group)
    marks = dict(st.partitions)
    for part, offset in positions:
        mark = marks.get(part)
        if mark is None:
            raise InvalidArgument(f"journal: partition {part} handed out a group but has no mark in the state")
        if offset < mark.offset:
            continue  # resolved before the state already
        ranges = sorted([*mark.trained, (offset, offset)])
        merged: list[tuple[int, int]] = []
        for first, last in ranges:
            if merged and first <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], last))
            else:
                merged.append((first, last))
        start = mark.offset
        if merged and merged[0][0] == start:  # trained from the mark on: the mark moves past them
            start = merged.pop(0)[1] + 1
        marks[part] = PartitionMark(start, merged)
    return encode_state(msgspec.structs.replace(st, partitions=marks))


def _step_of(resume_from_path: str) -> int:
    if "global_step_" not in resume_from_path:
        raise InvalidArgument(f"resume_from_path {resume_from_path!r} names no global_step_ folder (verl asserts so)")
    return int(resume_from_path.rstrip("/").split("global_step_")[-1])


def resume_step(root: str, resume_mode: str, resume_from_path: str | None) -> int | None:
    """The step verl's ``_load_checkpoint`` resumes from, None when it starts from scratch."""
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return read_tracker(root)
    if resume_mode == "resume_path":
        return _step_of(resume_from_path or "")
    raise InvalidArgument(f"resume_mode must be auto, resume_path or disable, got {resume_mode!r}")


def restore_point(
    root: str, resume_mode: str, resume_from_path: str | None, *, topic: str, group: str
) -> tuple[int, dict] | None:
    """The step verl resumes from and the consumer state that goes with it; None to start afresh.

    The state file of that step, else the journal of that step with its records counted as trained
    (the crash fell between verl's tracker and ``on_save``). Neither: InvalidArgument, as nothing tells
    which groups the restored model trained.
    """
    step = resume_step(root, resume_mode, resume_from_path)
    if step is None:
        return None
    folder = resume_from_path if resume_mode == "resume_path" else step_dir(root, step)
    state = _read_json(os.path.join(folder or "", STATE_FILE))
    if state is not None:
        # Validated here, by name, and with the partition numbers JSON turned into strings made ints again.
        return step, encode_state(decode_state(state, topic=topic, consumer_group=group))
    journal = _read_json(os.path.join(root, JOURNAL))
    if journal is not None and journal.get("step") == step:
        positions = [tuple(p) for p in journal["handed_out"]]
        return step, mark_trained(journal["state"], positions, topic=topic, group=group)
    missing = os.path.join(folder or "", STATE_FILE)
    raise InvalidArgument(
        f"verl resumes from step {step} but rlstream has no consumer state for it ({missing}"
        f" is missing and the journal is of another step): was trainer.checkpoint_callback_class set to"
        " RlstreamCheckpointCallback, and sampler_kwargs.rlstream.checkpoint_dir to trainer.default_local_dir?"
    )


class ConsumerCheckpoints:
    """The replay buffer's consumer state beside verl's checkpoints under `root` (verl's default_local_dir):
    restored before the first poll, journaled at each training sample, saved with each checkpoint and
    declared durable once verl's files are (module doc)."""

    def __init__(self, root: str, consumer: Any, resume_mode: str = "auto", resume_from_path: str | None = None):
        self.root = root
        self._consumer = consumer
        self._resume = (resume_mode, resume_from_path)
        self._not_durable: list[tuple[int, dict]] = []  # async saves waiting for verl's tracker

    def restore(self) -> int | None:
        """Load the consumer state of the checkpoint verl resumes from; the step, None when verl starts afresh."""
        config = self._consumer.config
        point = restore_point(self.root, *self._resume, topic=config.finalized_topic, group=config.consumer_group)
        if point is None:
            return None
        step, state = point
        self._consumer.load_state_dict(state)
        log.info("rlstream consumer restored to verl's step %d from %s", step, self.root)
        return step

    def journal(self, step: int, handed_out: Iterable[tuple[int, int]]) -> None:
        """The step's journal before verl gets its batch: the state now and the records handed out in it.

        Every batch acked so far was trained; verl writes its tracker for the step only once the
        records handed out in it trained too.
        """
        write_journal(self.root, step, self._consumer.state_dict(), handed_out)

    def save(self, global_step: int, checkpoint_dir: str, *, async_save: bool) -> None:
        """The state beside verl's checkpoint of `global_step`, declared durable now or once verl's tracker shows it."""
        self.declare_saved_durable()
        state = self._consumer.state_dict()
        save_state(checkpoint_dir, state)
        if async_save:
            self._not_durable.append((global_step, state))
            return
        self._not_durable = []  # a newer durable state covers what older pending ones would
        self._consumer.checkpoint_durable(state)

    def declare_saved_durable(self) -> None:
        """Async saves whose step verl's tracker now shows are durable, oldest first."""
        if not self._not_durable:
            return
        shown = read_tracker(self.root)
        while self._not_durable and shown is not None and self._not_durable[0][0] <= shown:
            _, state = self._not_durable.pop(0)
            self._consumer.checkpoint_durable(state)


class RlstreamCheckpointCallback:
    """``trainer.checkpoint_callback_class``: on each verl checkpoint, rlstream's state beside it (module doc).

    Duck-typed against verl's ``CheckpointCallback`` (verl loads it by name and checks nothing), so
    rlstream need not import verl.
    """

    def __init__(self, config: Any = None):
        self.config = config
        # verl builds this callback first in PPOTrainer.__init__, before its replay buffer: the TQ
        # guard goes in here too, so that a run failing in between cannot close rlstream's TQ.
        if _sampler_option(config, "guard_tq", True):
            from workers.adapters import verl_tq_guard

            verl_tq_guard.install()

    def on_save(self, trainer: Any, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        buffer = getattr(trainer, "replay_buffer", None)
        if not hasattr(buffer, "on_checkpoint"):
            raise InvalidArgument(
                "RlstreamCheckpointCallback needs rlstream's replay buffer (trainer.v1.sampler.custom_sampler):"
                f" verl's is {type(buffer).__name__}"
            )
        buffer.on_checkpoint(global_step, checkpoint_dir, async_save=async_save)


def _sampler_option(config: Any, name: str, default: Any) -> Any:
    """``trainer.v1.sampler.sampler_kwargs.rlstream.<name>`` of verl's config, `default` where absent."""
    node = config
    for key in ("trainer", "v1", "sampler", "sampler_kwargs", "rlstream", name):
        try:
            node = node.get(key) if node is not None else None
        except AttributeError:
            return default
    return default if node is None else node
