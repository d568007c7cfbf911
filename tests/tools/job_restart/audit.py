"""The job-restart drill's audit: what became of every prompt group, from the system's own outputs.

- **produced**: distinct group ids with a receipt committed on the receipts topic (originals and
  regenerations alike);
- **handed back**: distinct group ids a `Regenerate` names (by a reassembler: staging lost; by the
  trainer: train rows lost);
- **trained**: the journal in the run's final checkpoint, the groups in the trained model's history
  (a group trained after a checkpoint and before the kill is rolled back with the weights);
- **dead-lettered** and **evicted**: the reassemblers' dead letters and the trainer's evictions
  (the drill runs with a staleness bound no group reaches, so none should be evicted).

Every produced group must end in exactly one of these; `lost` counts those that end in none,
`trained twice` the groups (or prompts, across their regenerations) in the journal more than once.
The drill produces no bad input, so a dead letter is a failure too (a group with a failed rollout
whose staging was lost is handed back, not dead-lettered); `handed back with a failed rollout`
counts such groups, and `duplicate` names the group whose finalized record the drill published again.

Each fault the round asked for must be seen to have fired, or the round fails (a drill whose fault
silently did nothing proves nothing): `failed`, groups with a failed rollout's receipt; `held`, the
partitions a transaction held when resume began (its report); `duplicate`, the duplicates past the
cut resume found (its report) while the republished group is trained once.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from schemas.deadletter import DeadLetter
from schemas.errors import SchemaError
from schemas.receipt import Receipt
from schemas.regenerate import Regenerate
from streams.config import KafkaConfig
from streams.consumer import read_topic
from workers.topics import TopicNames


@dataclass
class Audit:
    prefix: str
    produced: int = 0
    trained_once: int = 0
    trained_twice: list[str] = field(default_factory=list)
    prompts_trained_twice: list[int] = field(default_factory=list)
    handed_back: int = 0
    handed_back_by: dict[str, int] = field(default_factory=dict)
    regenerated_and_trained: int = 0
    dead_lettered: int = 0
    evicted: int = 0
    lost: list[str] = field(default_factory=list)
    handed_back_with_failed: int = 0
    duplicate: str | None = None
    killed_at_step: int = 0
    first_batch_s: float | None = None
    rewards: tuple[float, float] | None = None
    faults: frozenset[str] = frozenset()  # the faults the round asked for
    failed_groups: int = 0  # groups with a failed rollout's receipt
    held_partitions: int | None = None  # partitions a transaction held when resume began (None: not said)
    duplicates_found: int | None = None  # duplicates past the cut resume found (None: not said)

    def not_fired(self) -> list[str]:
        """The faults asked for whose effect the round's outputs do not show."""
        out = []
        if "failed" in self.faults and not self.failed_groups:
            out.append("failed: no receipt of a failed rollout")
        if "held" in self.faults and not self.held_partitions:
            out.append("held: resume found no transaction open when it began")
        if "duplicate" in self.faults and (self.duplicate is None or not self.duplicates_found):
            out.append(f"duplicate: resume found no duplicate past the cut (republished {self.duplicate or 'none'})")
        return out

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} lost (e.g. {self.lost[:3]})")
        if self.trained_twice or self.prompts_trained_twice:
            out.append(f"trained twice: groups {self.trained_twice[:3]}, prompts {self.prompts_trained_twice[:3]}")
        if self.dead_lettered:
            out.append(f"{self.dead_lettered} dead-lettered: the drill's input is all good")
        out += [f"fault did not fire: {what}" for what in self.not_fired()]
        accounted = self.trained_once + self.handed_back + self.dead_lettered + self.evicted
        if accounted != self.produced:
            out.append(f"trained once + handed back + dead-lettered + evicted = {accounted}, produced {self.produced}")
        return out

    def lines(self) -> list[str]:
        by = ", ".join(f"{n} by the {who}" for who, n in sorted(self.handed_back_by.items())) or "none"
        first = f"{self.first_batch_s:.1f}s" if self.first_batch_s is not None else "-"
        reward = f"{self.rewards[0]:.3f} -> {self.rewards[1]:.3f}" if self.rewards else "-"
        return [
            f"killed at step {self.killed_at_step}; restart to first trained batch {first}; reward {reward}",
            f"groups produced {self.produced}: trained once {self.trained_once}, handed back {self.handed_back}"
            f" ({by}), regenerated and trained {self.regenerated_and_trained}, dead-lettered"
            f" {self.dead_lettered}, evicted {self.evicted}, lost {len(self.lost)}, trained twice"
            f" {len(self.trained_twice) + len(self.prompts_trained_twice)}",
            f"handed back with a failed rollout {self.handed_back_with_failed}; duplicate past the cut:"
            f" {self.duplicate or 'none'}",
            f"faults fired: groups with a failed rollout {self.failed_groups}, partitions held open at resume"
            f" {'-' if self.held_partitions is None else self.held_partitions}, duplicates found by resume"
            f" {'-' if self.duplicates_found is None else self.duplicates_found}",
        ]


def _journal(checkpoints: Path) -> dict:
    name = (checkpoints / "LATEST").read_text().strip()
    return json.loads((checkpoints / name / "progress.json").read_text())


def audit_run(kafka: KafkaConfig, prefix: str, checkpoints: Path) -> Audit:
    names = TopicNames(prefix)
    result = Audit(prefix)
    produced: dict[str, int] = {}
    failed: set[str] = set()
    for r in read_topic(kafka, names.receipts):
        try:
            receipt = Receipt.from_bytes(r.value)
        except SchemaError:
            continue
        produced.setdefault(receipt.group_id, receipt.prompt_idx)
        if receipt.failure_reason is not None:
            failed.add(receipt.group_id)
    backs: dict[str, Regenerate] = {}
    for r in read_topic(kafka, names.regenerate):
        back = Regenerate.from_bytes(r.value)
        backs.setdefault(back.group_id, back)
    dead = {DeadLetter.from_bytes(r.value).source_key.decode() for r in read_topic(kafka, names.deadletter)}
    dead |= {DeadLetter.from_bytes(r.value).source_key.decode() for r in read_topic(kafka, names.trainer_deadletter)}
    journal = _journal(checkpoints)
    trained = Counter(gid for gid, _ in journal["trained"])
    evicted = {gid for gid, _ in journal["evicted"]}
    by_prompt = Counter(idx for _, idx in journal["trained"])

    result.produced = len(produced)
    result.trained_twice = sorted(g for g, n in trained.items() if n > 1)
    result.prompts_trained_twice = sorted(i for i, n in by_prompt.items() if n > 1)
    result.trained_once = sum(1 for g in produced if trained.get(g) == 1)
    result.handed_back = sum(1 for g in produced if g in backs)
    result.handed_back_by = dict(Counter("trainer" if b.worker_id.startswith("trainer") else "reassembler"
                                         for g, b in backs.items() if g in produced))  # fmt: skip
    result.handed_back_with_failed = sum(1 for g in failed if g in backs)
    result.failed_groups = sum(1 for g in failed if g in produced)
    result.dead_lettered = sum(1 for g in produced if g in dead and g not in trained and g not in backs)
    result.evicted = sum(1 for g in produced if g in evicted and g not in trained)

    def ends_trained(gid: str) -> bool:
        back = backs.get(gid)
        return trained.get(gid, 0) > 0 or (back is not None and ends_trained(back.new_group_id))

    result.regenerated_and_trained = sum(1 for g in produced if g in backs and ends_trained(backs[g].new_group_id))
    result.lost = sorted(
        g for g in produced if g not in trained and g not in backs and g not in dead and g not in evicted
    )
    return result


_HELD = re.compile(r"resume: transactions open when resume began: (none|(\d+) partition)")
_DUPLICATES = re.compile(r"resume: duplicates past the checkpoint of groups resolved before it [^:]*: (\d+)")


def fired_in_resume(output: str) -> tuple[int | None, int | None]:
    """From the restarted job's output, resume's report: partitions a transaction held when it began, and the
    duplicates past the cut it found (None where the report does not say)."""
    held = _HELD.search(output)
    duplicates = _DUPLICATES.search(output)
    return (
        None if held is None else int(held[2] or 0),
        None if duplicates is None else int(duplicates[1]),
    )
