"""The chaos drill's accounting: what a fresh read_committed consumer, the trainer's journal and TQ say at the end.

Every figure is computed from the system's own outputs after everything stopped, never from what
the drill believes it did: the finalized topic read again from the beginning, the dead-letter
topic, the trainer's journal (`tests/tools/chaos/trainer.py`) and the staging and train partitions of TQ.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from schemas.deadletter import ALL_ROLLOUTS_FAILED, DeadLetter
from schemas.errors import SchemaError
from schemas.finalized import FinalizedGroup
from schemas.trainer_version import TrainerVersion
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.tq import STAGING, TRAIN, KVStore
from workers.topics import TopicNames


@dataclass
class DrillEvents:
    """What the drill did to the system, as observed (exit codes, not intentions)."""

    kills_requested: int = 0
    kills: Counter = field(default_factory=Counter)  # SIGKILL deaths by kind: random or the crash point
    crash_workers_never_died: list[str] = field(default_factory=list)
    other_exits: list[str] = field(default_factory=list)  # worker exits that were no SIGKILL of ours
    zombie: str = "none"
    broker: str = "none"
    trainer_kills: int = 0
    trainer_killed_mid_step: int = 0  # groups in the killed trainer's unfinished batch
    publish_retries: int = 0
    producer_errors: list[str] = field(default_factory=list)
    # The pool's own lines (exits, restarts, promotions), the workers its spare took over, and exits
    # of a worker that stopped as fenced (78: which a transaction timeout must never cause).
    pool_lines: list[str] = field(default_factory=list)
    spare_takeovers: list[str] = field(default_factory=list)
    fenced_exits: list[str] = field(default_factory=list)
    pool_size: int = 0
    pool_size_at_end: int = 0
    frozen_builder: str = "none"
    frozen_builder_refused: bool = True
    coordinator: str = "none"
    coordinator_freeze_s: float = 0.0  # as scheduled (0: no freeze in this run)
    timeouts_ridden_out: int = 0
    lost_share: float = 0.0  # share of groups produced with every rollout failed
    batch_groups: int = 8  # groups the trainer trains per version
    gate: object = None  # the producer's admission gate counts at the end (GateCounts)
    timed_out: bool = False
    elapsed_s: float = 0.0


def read_journal(path: Path) -> tuple[Counter, list[tuple[str, int, list[str]]]]:
    """Trainings per group id (steps finished), and every journal line as (kind, pid, group ids)."""
    lines = []
    trained: Counter = Counter()
    if path.exists():
        for raw in path.read_text(encoding="utf-8").splitlines():
            kind, pid, *ids = raw.split()
            if kind == "rows":
                continue
            lines.append((kind, int(pid), ids))
            if kind == "trained":
                trained.update(ids)
    return trained, lines


def read_digests(path: Path) -> dict[str, set[str]]:
    """Per group id, the digests of the rows every trainer read for it (one, unless rows changed)."""
    seen: dict[str, set[str]] = {}
    if path.exists():
        for raw in path.read_text(encoding="utf-8").splitlines():
            kind, _, *pairs = raw.split()
            if kind == "rows":
                for pair in pairs:
                    gid, _, digest = pair.partition("=")
                    seen.setdefault(gid, set()).add(digest)
    return seen


def unfinished_batches(lines: list[tuple[str, int, list[str]]], pid: int) -> list[str]:
    """Group ids of `pid`'s batches begun but never trained (it was killed in the middle of the step)."""
    begun: list[str] = []
    done: set[str] = set()
    for kind, p, ids in lines:
        if p == pid:
            (begun.extend if kind == "begin" else done.update)(ids)
    return [g for g in begun if g not in done]


@dataclass
class Accounting:
    produced: int = 0
    finalized_records: int = 0
    finalized_groups: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    dead_letters: int = 0
    trained_once: int = 0
    trained_twice: list[str] = field(default_factory=list)
    never_trained: list[str] = field(default_factory=list)
    staging_left: int = 0
    train_left: int = 0
    poisoned: int = 0  # groups produced with every rollout failed (lost to the gate)
    poisoned_dead_lettered: int = 0
    poisoned_trained: list[str] = field(default_factory=list)
    # Trained groups whose rows were not those their committed record describes (a zombie's put).
    rows_overwritten: list[str] = field(default_factory=list)
    trainings: int = 0  # trainings in the journal, as the trainer counts them for its version
    trainer_version: int | None = None  # the highest version the trainer published
    problems: list[str] = field(default_factory=list)


def trainer_version_floor(trainings: int, batch_groups: int) -> int:
    """The lowest final version of a trainer that trained `trainings` groups at `batch_groups` a version.

    It publishes one version per `batch_groups` trainings, but only at the top of its next round: the
    drill may stop it between its last training and that publish, one version short.
    """
    return max(0, trainings // batch_groups - 1)


def published_version(kafka: KafkaConfig, names: TopicNames, trainer_id: str) -> int | None:
    """The highest version `trainer_id` published on the version topic (None: none)."""
    versions = []
    for r in read_topic(kafka, names.trainer_version):
        try:
            record = TrainerVersion.from_bytes(r.value)
        except SchemaError:
            continue
        if record.trainer_id == trainer_id:
            versions.append(record.version)
    return max(versions, default=None)


def account(
    kafka: KafkaConfig,
    names: TopicNames,
    store: KVStore,
    produced: dict[str, list[str]],
    journal: Path,
    events: DrillEvents,
    expected_digests: dict[str, str] | None = None,
    poisoned: set[str] = frozenset(),
    trainer_id: str | None = None,
) -> Accounting:
    """Count lost and duplicated groups, trainings per group and TQ leftovers; list every failed invariant.

    `expected_digests` (group id -> digest of the rows built from what was staged) is checked
    against what the trainer read; `trainer_id`'s records on the version topic, against the groups
    it trained.
    """
    acc = Accounting(produced=len(produced))
    records = [FinalizedGroup.from_bytes(r.value) for r in read_topic(kafka, names.finalized)]
    counts = Counter(r.group_id for r in records)
    acc.finalized_records, acc.finalized_groups = len(records), len(counts)
    letters = [DeadLetter.from_bytes(r.value) for r in read_topic(kafka, names.deadletter)]
    failed = {d.source_key.decode(errors="replace") for d in letters if d.error_kind == ALL_ROLLOUTS_FAILED}
    acc.poisoned, acc.poisoned_dead_lettered = len(poisoned), len(poisoned & failed)
    acc.lost = sorted(set(produced) - set(counts) - (poisoned & failed))
    acc.duplicated = sorted(g for g, c in counts.items() if c > 1)
    acc.unknown = sorted(set(counts) - set(produced))
    acc.dead_letters = len(letters)
    trained, _ = read_journal(journal)
    acc.trainings = sum(trained.values())
    if trainer_id is not None:
        acc.trainer_version = published_version(kafka, names, trainer_id)
    acc.trained_once = sum(1 for g in counts if trained[g] == 1)
    acc.trained_twice = sorted(g for g, c in trained.items() if c > 1)
    acc.never_trained = sorted(g for g in counts if trained[g] == 0)
    acc.poisoned_trained = sorted(g for g in poisoned if trained[g] or g in counts)
    acc.staging_left = len(store.present(STAGING, [k for keys in produced.values() for k in keys]))
    acc.train_left = len(store.present(TRAIN, [s for r in records for s in r.sample_ids]))
    if expected_digests is not None:
        read = read_digests(journal)
        acc.rows_overwritten = sorted(g for g, seen in read.items() if seen != {expected_digests.get(g)})
    acc.problems = _problems(acc, events)
    return acc


def _problems(acc: Accounting, ev: DrillEvents) -> list[str]:
    floor = trainer_version_floor(acc.trainings, ev.batch_groups)
    checks = [
        (acc.lost, f"{len(acc.lost)} group(s) lost, e.g. {acc.lost[:3]}"),
        (acc.duplicated, f"{len(acc.duplicated)} group(s) finalized more than once, e.g. {acc.duplicated[:3]}"),
        (acc.unknown, f"{len(acc.unknown)} finalized group(s) never produced, e.g. {acc.unknown[:3]}"),
        (acc.trained_twice, f"{len(acc.trained_twice)} group(s) trained twice, e.g. {acc.trained_twice[:3]}"),
        (acc.never_trained, f"{len(acc.never_trained)} finalized group(s) never trained, e.g. {acc.never_trained[:3]}"),
        (acc.staging_left, f"{acc.staging_left} staging key(s) left in TQ"),
        (acc.train_left, f"{acc.train_left} train row(s) left in TQ"),
        (
            acc.rows_overwritten,
            f"{len(acc.rows_overwritten)} group(s) trained on other rows, e.g. {acc.rows_overwritten[:3]}",
        ),
        (ev.fenced_exits, f"workers stopped as fenced (exit 78): {ev.fenced_exits[:2]}"),
        # A freeze that made no transaction time out tested nothing: the drill must not pass on it.
        (
            ev.coordinator_freeze_s > 0 and ev.timeouts_ridden_out < 1,
            f"the coordinator was frozen {ev.coordinator_freeze_s:.0f}s and no transaction timeout was ridden out",
        ),
        # With groups lost the gate gives their capacity back, or the trainer's version stalls.
        (
            ev.lost_share > 0 and (acc.trainer_version is None or acc.trainer_version < floor),
            f"the trainer's version stalled at {acc.trainer_version} (at least {floor} for {acc.trainings} "
            f"groups trained, {ev.batch_groups} a version)",
        ),
        (acc.poisoned_trained, f"groups whose rollouts all failed reached the trainer: {acc.poisoned_trained[:3]}"),
        (ev.pool_size_at_end < ev.pool_size, f"the pool ended with {ev.pool_size_at_end} of {ev.pool_size} workers"),
        (
            len(set(ev.spare_takeovers)) < min(2, ev.kills["random"]),
            f"the spare took over {sorted(set(ev.spare_takeovers))} only",
        ),
        (not ev.frozen_builder_refused, "the frozen worker put rows after it woke"),
        (sum(ev.kills.values()) < ev.kills_requested, f"only {sum(ev.kills.values())} of {ev.kills_requested} kills"),
        (ev.crash_workers_never_died, f"crash workers that never reached their point: {ev.crash_workers_never_died}"),
        (ev.producer_errors, f"producer failed: {ev.producer_errors[:2]}"),
        (ev.timed_out, "timed out before every group was trained"),
    ]
    return [text for failed, text in checks if failed]


def _gate_line(counts) -> str:
    if counts is None:
        return "none"
    return f"trainer version {counts.version}, {counts.accepted} accepted, {counts.running} running"


def figures(acc: Accounting, ev: DrillEvents) -> list[str]:
    kills = ", ".join(f"{k} {n}" for k, n in sorted(ev.kills.items())) or "none"
    rows = [
        ("groups produced", acc.produced),
        ("finalized records (read_committed)", acc.finalized_records),
        ("distinct finalized groups", acc.finalized_groups),
        ("lost", len(acc.lost)),
        ("duplicated", len(acc.duplicated)),
        ("dead letters", acc.dead_letters),
        (
            "all rollouts failed (lost to the gate)",
            f"{acc.poisoned} produced, {acc.poisoned_dead_lettered} dead-lettered",
        ),
        ("admission gate", _gate_line(ev.gate)),
        ("trainer version", f"{acc.trainer_version} (floor {trainer_version_floor(acc.trainings, ev.batch_groups)})"),
        ("trained exactly once", acc.trained_once),
        ("trained more than once", len(acc.trained_twice)),
        ("finalized but never trained", len(acc.never_trained)),
        ("TQ staging keys left", acc.staging_left),
        ("TQ train rows left", acc.train_left),
        ("groups trained on overwritten rows", len(acc.rows_overwritten)),
        ("reassembler SIGKILLs", f"{sum(ev.kills.values())} ({kills})"),
        ("other worker exits", "; ".join(ev.other_exits) or "none"),
        ("zombie", ev.zombie),
        ("frozen builder", ev.frozen_builder),
        ("coordinator", ev.coordinator),
        ("transaction timeouts ridden out", ev.timeouts_ridden_out),
        ("spare takeovers", f"{len(ev.spare_takeovers)} ({', '.join(sorted(set(ev.spare_takeovers))) or 'none'})"),
        ("workers fenced (exit 78)", len(ev.fenced_exits)),
        ("pool size at the end", f"{ev.pool_size_at_end} of {ev.pool_size}"),
        ("broker", ev.broker),
        ("trainer kills", f"{ev.trainer_kills} ({ev.trainer_killed_mid_step} group(s) in its unfinished batch)"),
        ("publish retries", ev.publish_retries),
        ("elapsed", f"{ev.elapsed_s:.0f}s"),
    ]
    width = max(len(name) for name, _ in rows)
    out = [f"  {name:<{width}}  {value}" for name, value in rows]
    out.append("invariants: " + ("all hold" if not acc.problems else "FAILED"))
    out.extend(f"  - {p}" for p in acc.problems)
    return out
