"""The real rlstream components a run starts, each as the main actor of one simulated process.

Each body builds the component exactly as a deployment would, except that its Kafka clients come
from the model (`SimKafka` of its process), its TQ from the model (`TQStore(tq=...)` over the
process's own client) and its clock and threads from its `SimRuntime`:

- `reassembler`: a `ReassemblerWorker` under worker id `w<i>`, run until the process ends;
- `trainer`: an `ExperienceConsumer` with checkpoints (`save_into_checkpoint`, `checkpoint_durable`)
  and a `VersionPublisher`, training what it selects: its "model" is the list of groups trained with
  the digest of every row it read, kept in each checkpoint as the weights would be, so a restart rolls
  it back with the checkpoint;
- `rollout`: an `AdmissionGate`, a `RolloutPublisher` and a `RegenerateFeed`: prompts are published
  as the gate allows, hand-backs generated again under the id they name;
- `resume`: `workers.trainer.resume.resume` after a whole-job kill, before the others start again.

What a component's user code would keep on disk (the rollout worker's record of what it published,
the trainer's checkpoints) lives in `World.facts` and the run's checkpoint directory.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from streams.config import KafkaConfig
from streams.errors import DeliveryError, MissingKeysError, TQTimeout
from streams.producer import AckedProducer, Outgoing
from streams.tq import TQStore
from tests.tools.explore.workload import GARBAGE, build, group_id, rows_digest
from tests.tools.sim.kafka import SimKafka
from workers.reassembler.clients import KafkaClients
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.rollout.gate import AdmissionGate
from workers.rollout.publisher import RolloutPublisher
from workers.rollout.regenerate_feed import RegenerateFeed
from workers.topics import TopicNames
from workers.trainer.checkpoint_dir import load_state, save_into_checkpoint
from workers.trainer.clients import KafkaTrainerClients
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first, weight_fifo
from workers.trainer.version_topic import VersionPublisher

if TYPE_CHECKING:
    from tests.tools.explore.runtime import SimRuntime
    from tests.tools.explore.sched import Proc
    from tests.tools.explore.world import World

PREFIX = "x"
NAMES = TopicNames(PREFIX)
KAFKA = KafkaConfig("sim:9092")
REASSEMBLERS = f"reassemblers.{PREFIX}"
TRAINER_GROUP = f"trainer.{PREFIX}"
ROLLOUT_GROUP = f"rollouts.{PREFIX}"
TRAINER_ID = "trainer"
LATEST = "LATEST"


def reassembler_config(i: int, static: bool, transaction_timeout_s: float = 10.0) -> ReassemblerConfig:
    """A reassembler's settings, within their bounds, scaled so a run's virtual minutes stay few."""
    return ReassemblerConfig(
        prefix=PREFIX,
        worker_id=f"w{i}",
        consumer_group=REASSEMBLERS,
        poll_timeout_s=0.5,
        group_timeout_s=10.0,
        closed_retention_s=600.0,
        # Above the longest delay a plan puts between a rollout's staging and its receipts (a hold of
        # 120 s, a broker down 70 s, a freeze of 40 s), as the default hour is above any outage DESIGN
        # expects: a receipt later than this finds its rows swept (a bounded age, DESIGN "Staging sweeper").
        staging_sweep_age_s=150.0,
        staging_sweep_interval_s=10.0,
        session_timeout_ms=6000,
        max_poll_interval_ms=30_000,
        transaction_timeout_ms=int(transaction_timeout_s * 1000),
        static_membership=static,
    )


def trainer_config(checkpointed: bool = True) -> ConsumerConfig:
    return ConsumerConfig(
        prefix=PREFIX,
        consumer_group=TRAINER_GROUP,
        checkpointed=checkpointed,
        session_timeout_ms=6000,
        max_poll_interval_ms=60_000,
    )


def reassembler(i: int):
    def body(world: World, proc: Proc, rt: SimRuntime) -> None:
        api = SimKafka(world.cluster, proc.name)
        store = TQStore(tq=world.tq.module(proc.name))
        config = reassembler_config(i, world.workload.static_membership, world.workload.transaction_timeout_s)
        worker = ReassemblerWorker(KAFKA, store, config, clients=KafkaClients(KAFKA, api=api, runtime=rt), runtime=rt)
        world.note(f"{proc.name} started")
        worker.run(lambda: False)

    return body


@dataclass
class Model:
    """What the trainer has trained, as its weights would hold it: (group id, row digests) in order."""

    trained: list[tuple[str, dict[int, str]]] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)  # groups the policy dropped as too stale
    saved: int = 0  # how many of the trained the latest checkpoint holds

    @property
    def version_steps(self) -> int:
        return len(self.trained)


def latest(root: Path) -> Path | None:
    try:
        return root / (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None


def _checkpoint(world: World, consumer: ExperienceConsumer, store, model: Model) -> None:
    root = world.root
    world.checkpoints += 1
    name = f"ckpt-{world.checkpoints:05d}"
    tmp, final = root / f"{name}.tmp", root / name
    tmp.mkdir(parents=True)
    (tmp / "model.json").write_text(json.dumps({"trained": model.trained, "evicted": model.evicted}))
    state, _ = save_into_checkpoint(tmp, consumer, store)
    os.replace(tmp, final)
    (root / f"{LATEST}.tmp").write_text(name)
    os.replace(root / f"{LATEST}.tmp", root / LATEST)
    model.saved = len(model.trained)
    world.note(f"trainer checkpoint {name}: {model.saved} group(s) trained")
    consumer.checkpoint_durable(state)
    for old in sorted(p for p in root.glob("ckpt-*") if p.suffix != ".tmp")[:-2]:
        shutil.rmtree(old, ignore_errors=True)


def trainer(world: World, proc: Proc, rt: SimRuntime) -> None:
    api = SimKafka(world.cluster, proc.name)
    store = TQStore(tq=world.tq.module(proc.name))
    clients = KafkaTrainerClients(KAFKA, api=api, runtime=rt)
    batch = world.workload.batch_groups
    checkpointed = world.workload.checkpointed
    # Without checkpoints an ack is for good (its commit follows): the model survives the process.
    model = world.model if not checkpointed and world.model is not None else Model()
    policy = weight_fifo(2) if world.workload.policy == "weight_fifo" else ready_first()
    evicted = model.evicted  # the list the model holds, filled by the consumer's callback

    def on_evict(group, version: int) -> None:
        evicted.append(group.group_id)
        world.note(f"trainer evicted {group.group_id} (weight {group.group_min_wv}) at version {version}")

    consumer = ExperienceConsumer(
        KAFKA, store, trainer_config(checkpointed), policy, clients=clients, runtime=rt, on_evict=on_evict
    )
    ckpt = latest(world.root) if checkpointed else None
    if ckpt is not None:
        saved = json.loads((ckpt / "model.json").read_text())
        model.trained = [(g, {int(k): v for k, v in d.items()}) for g, d in saved["trained"]]
        evicted.extend(saved["evicted"])
        model.saved = len(model.trained)
        consumer.load_state_dict(load_state(ckpt))
        resolved = world.facts.resolved_originals
        if resolved:
            consumer.remember_resolved(resolved)
    world.model = model
    named = world.named_consumed()  # what the standing commit says was consumed, as this trainer starts
    world.note(f"{proc.name} started from {ckpt.name if ckpt else 'nothing'}: {len(model.trained)} group(s) trained")
    publisher = VersionPublisher(
        KAFKA,
        NAMES.trainer_version,
        trainer_id=TRAINER_ID,
        consumer_group=TRAINER_GROUP,
        batch_groups=batch,
        clients=clients,
        runtime=rt,
    )
    steps, saved_at = 0, rt.monotonic()
    while True:
        version = len(model.trained) // batch
        publisher.publish(version, lost_groups=consumer.counts.lost)
        world.facts.version = max(world.facts.version, version)
        meta = consumer.select(version, 1, batch, timeout_s=2.0)
        if meta is None:
            # Idle: a checkpoint now and then, so that the rows of what was resolved since leave TQ.
            if checkpointed and (model.saved < len(model.trained) or rt.monotonic() - saved_at >= 10.0):
                _checkpoint(world, consumer, store, model)
                saved_at = rt.monotonic()
            continue
        try:
            rows = consumer.materialize(meta)
        except MissingKeysError:
            continue
        rt.sleep(world.workload.train_s)  # the step itself
        ids, lengths = rows["input_ids"], rows["input_lengths"]
        at = 0
        for g, position in zip(meta.groups, meta.positions, strict=True):
            if not checkpointed and position in named:
                world.facts.retrained_named.append(f"{g.group_id} at {position}")
            digests = {}
            for i, reason in enumerate(g.rejection_reasons):
                if reason is None:
                    digests[i] = rows_digest(ids[at + i, : int(lengths[at + i])])
            model.trained.append((g.group_id, digests))
            world.facts.trained_at.setdefault(g.group_id, world.sched.elapsed)
            at += len(g.sample_ids)
        world.note(f"trainer trained {', '.join(g.group_id for g in meta.groups)} at version {version}")
        consumer.ack(meta)
        steps += 1
        if not checkpointed:
            model.saved = len(model.trained)
        elif steps % world.workload.checkpoint_every == 0:
            _checkpoint(world, consumer, store, model)
            saved_at = rt.monotonic()


def rollout(world: World, proc: Proc, rt: SimRuntime) -> None:
    api = SimKafka(world.cluster, proc.name)
    store = TQStore(tq=world.tq.module(proc.name))
    facts, w = world.facts, world.workload
    publisher = RolloutPublisher(KAFKA, store, NAMES.receipts, api=api, runtime=rt)
    raw = AckedProducer(KAFKA, api=api)
    gate = AdmissionGate(
        KAFKA, NAMES, max_staleness=w.max_staleness, trainer_id=TRAINER_ID, poll_s=0.5, api=api, runtime=rt
    )
    feed = RegenerateFeed(KAFKA, NAMES, ROLLOUT_GROUP, generated=set(facts.published), api=api)
    world.note(f"{proc.name} started at prompt {facts.cursor}")

    def publish(gid: str) -> None:
        version = gate.version or 0
        rt.sleep(w.generate_s)  # generating it
        p = build(w, gid, version)
        while True:
            try:
                publisher.publish(list(p.rollouts))
                if p.garbage:
                    raw.send([Outgoing(NAMES.receipts, gid.encode(), GARBAGE) for _ in range(p.garbage)])
                break
            except (DeliveryError, TQTimeout) as exc:
                # The publisher's contract: publish the same rollouts again (a receipt that lands twice is
                # refused by the reassembler as a duplicate).
                world.note(f"rollout publish of {gid} failed ({type(exc).__name__}); publishing it again")
                rt.sleep(1.0)
        facts.published[gid] = p
        world.note(f"rollout published {gid} ({p.kind})")

    while True:
        backs = feed.take(4, 0.0)
        for back in backs:
            gid = back.regenerate.new_group_id
            if gid not in facts.published:
                publish(gid)
            feed.done(back)
        if facts.cursor < w.prompts and gate.capacity() >= 1:
            gate.on_started()
            gid = group_id(facts.cursor)
            publish(gid)
            # A group whose every receipt is refused never opens, so no gate can learn it is lost
            # (docs/DESIGN.md, "Admission control": what the gate cannot see): not counted as accepted.
            gate.on_finished(facts.published[gid].kind != "poison")
            facts.cursor += 1
            continue
        if not backs:
            rt.sleep(0.5)


def resume_job(world: World, proc: Proc, rt: SimRuntime) -> None:
    from workers.trainer.resume import resume

    store = TQStore(tq=world.tq.module(proc.name))
    # As the GRPO example runs it: the dead job's reassembler ids named (their transactions aborted, not
    # waited out) and the rollout workers' feed settled; its progress lines go into the run's events.
    report = resume(
        KAFKA,
        store,
        trainer_config(),
        latest(world.root),
        reassembler_consumer_group=REASSEMBLERS,
        rollout_consumer_group=ROLLOUT_GROUP,
        reassembler_worker_ids=[f"w{i}" for i in range(world.workload.reassemblers)],
        say=world.note,
        force=world.workload.resume_force,
        api=SimKafka(world.cluster, proc.name),
        runtime=rt,
    )
    world.facts.resume_reports.append(report)
    world.facts.resolved_originals = list(report.resolved_originals)
    world.note("resume: " + "; ".join(report.lines()[1:]))
