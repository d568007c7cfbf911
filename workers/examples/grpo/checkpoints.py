"""The example trainer's checkpoints: weights, its journal, and rlstream's consumer state and spill of TQ rows.

A checkpoint is a directory `step-NNNNN` under the run's checkpoint root holding `weights.pt` (policy
and optimizer, torch's own format, local disk only), `progress.json` (version, the journal of groups
trained and evicted, the step figures, the untrained policy's reward, the steps at which the run
restarted) and what `workers.trainer.checkpoint_dir` writes (the consumer's state and the spill).
It is written under a temporary name (rlstream's spill of TQ off the trainer's thread, which trains
on meanwhile: `begin`, then `finish` once it is written), synced, renamed into place and named in
`LATEST` (replaced atomically); only then is it declared durable to the consumer, which commits its
offsets and clears the rows it covers. A job killed at any instant restarts from the last
checkpoint `LATEST` names; `load` restores the consumer with the groups it had resolved, so their
duplicates past the checkpoint are dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streams.tq import KVStore
from workers.examples.grpo.train import GrpoTrainer, StepStats
from workers.trainer.checkpoint_dir import CheckpointWrite, begin_checkpoint, load_state

LATEST = "LATEST"
KEEP = 2  # checkpoints kept: the latest, and the one before it while the latest is declared durable


@dataclass
class Progress:
    """What a checkpoint keeps of the run besides the weights."""

    version: int = 0
    trained: list[tuple[str, int]] = field(default_factory=list)
    evicted: list[tuple[str, int]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    untrained_reward: float = 0.0
    restarts: list[int] = field(default_factory=list)  # the step each restart resumed at


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Saving:
    """A checkpoint written but not yet made the latest: its spill may still be running (off the trainer's thread)."""

    root: Path
    name: str
    tmp: Path
    write: CheckpointWrite

    def done(self) -> bool:
        return self.write.done()


def begin(root: Path, trainer: GrpoTrainer, store: KVStore, progress: Progress) -> Saving:
    """Write a checkpoint of `trainer` as it stands now, its spill of TQ in the background; `finish` it."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{len(trainer.steps):05d}"
    tmp = root / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save({"policy": trainer.policy.state_dict(), "optimizer": trainer.optimizer.state_dict()}, tmp / "weights.pt")
    progress.version = trainer.version
    progress.trained = list(trainer.trained)
    progress.evicted = list(trainer.evicted_groups)
    progress.steps = [dataclasses.asdict(s) for s in trainer.steps]
    (tmp / "progress.json").write_text(json.dumps(dataclasses.asdict(progress)))
    return Saving(root, name, tmp, begin_checkpoint(tmp, trainer.consumer, store))


def finish(saving: Saving, trainer: GrpoTrainer) -> Path:
    """Once its spill is written: sync the checkpoint, make it the latest, then declare it durable."""
    saving.write.wait()
    root, tmp, final = saving.root, saving.tmp, saving.root / saving.name
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _sync_dir(root)
    pointer = root / f"{LATEST}.tmp"
    pointer.write_text(saving.name)
    os.replace(pointer, root / LATEST)
    _sync_dir(root)
    trainer.consumer.checkpoint_durable(saving.write.state)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir() and p.suffix != ".tmp")[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save(root: Path, trainer: GrpoTrainer, store: KVStore, progress: Progress) -> Path:
    """Write a checkpoint of `trainer` now, make it the latest, then declare it durable; returns its directory."""
    return finish(begin(root, trainer, store, progress), trainer)


def journal_prompts(directory: Path) -> set[int]:
    """Prompts a checkpoint's journal says were trained or evicted."""
    raw = json.loads((directory / "progress.json").read_text())
    return {int(idx) for _, idx in raw["trained"]} | {int(idx) for _, idx in raw["evicted"]}


def latest(root: Path) -> Path | None:
    """The checkpoint `LATEST` names, None before the first."""
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return root / name


def load(directory: Path, trainer: GrpoTrainer) -> Progress:
    """Restore `trainer` (weights, optimizer, version, journal, consumer state) from a checkpoint; its progress."""
    weights = torch.load(directory / "weights.pt", weights_only=True)
    trainer.policy.load_state_dict(weights["policy"])
    trainer.optimizer.load_state_dict(weights["optimizer"])
    raw = json.loads((directory / "progress.json").read_text())
    progress = Progress(
        version=raw["version"],
        trained=[tuple(t) for t in raw["trained"]],
        evicted=[tuple(t) for t in raw["evicted"]],
        steps=raw["steps"],
        untrained_reward=raw["untrained_reward"],
        restarts=raw["restarts"],
    )
    trainer.version = progress.version
    trainer.trained = list(progress.trained)
    trainer.evicted_groups[:] = progress.evicted
    trainer.steps = [StepStats(**s) for s in progress.steps]
    trainer.consumer.load_state_dict(load_state(directory))
    return progress
