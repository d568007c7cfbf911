"""The chaos drill's trainer, a child process the drill can SIGKILL: an `ExperienceConsumer` loop with a journal.

It appends one line per batch to the journal before its "training step" (`begin PID GROUP...`,
then `rows PID GROUP=DIGEST...`: a digest of the token ids of each group's rows as it read them, so
the audit can tell rows a zombie overwrote from the ones the committed record describes) and
one when the step is over, before `release` (`trained PID GROUP...`), each flushed at once, so the
drill can kill it in the middle of a step and count afterwards how often each group was trained. A
trainer killed mid-step never finished that step: its successor must train those groups (their rows
are still in TQ). One killed inside `release`, after its rows were cleared but before its offsets
were committed (a broker outage stretches that window), did train them: its successor drops them.
SIGTERM stops it gracefully.

    python -m tests.tools.chaos.trainer --bootstrap-servers B --prefix P --ray-address A --journal FILE
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import threading
from pathlib import Path

import torch

from streams.config import KafkaConfig
from streams.tq import TQConfig, TQStore, init_tq
from workers.topics import TopicNames
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first
from workers.trainer.version_topic import VersionPublisher

# What the producer's admission gate follows (procs.TRAINER_ID).
TRAINER_ID = "chaos-trainer"


def _trained_so_far(journal_path: str) -> int:
    """Groups every trainer of this drill trained, from the shared journal: a restarted trainer
    resumes its version where its predecessor left it (the version never goes back)."""
    try:
        lines = Path(journal_path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return 0
    return sum(len(line.split()) - 2 for line in lines if line.startswith("trained "))


def trainer_group(prefix: str) -> str:
    return f"trainer.{prefix}"


def _line(journal, kind: str, group_ids) -> None:
    journal.write(f"{kind} {os.getpid()} {' '.join(group_ids)}\n")
    journal.flush()


def rows_digest(rows: list[torch.Tensor]) -> str:
    """blake2b of a group's rows of token ids, in order (int64 little-endian, each row's length first)."""
    h = hashlib.blake2b(digest_size=8)
    for row in rows:
        ids = row.to(torch.int64).contiguous().numpy().astype("<i8")
        h.update(len(ids).to_bytes(4, "little"))
        h.update(ids.tobytes())
    return h.hexdigest()


def _group_digests(batch) -> list[str]:
    ids, lengths = batch.tensors["input_ids"], batch.tensors["input_lengths"]
    out, row = [], 0
    for g in batch.groups:
        rows = [ids[row + i, : int(lengths[row + i])] for i in range(len(g.sample_ids))]
        out.append(f"{g.group_id}={rows_digest(rows)}")
        row += len(g.sample_ids)
    return out


def run(args: argparse.Namespace) -> None:
    stop = threading.Event()
    session = init_tq(TQConfig(address=args.ray_address))
    # After Ray's init, which installs its own SIGTERM handler.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    kafka = KafkaConfig(args.bootstrap_servers)
    consumer = ExperienceConsumer(
        kafka,
        TQStore(),
        ConsumerConfig(prefix=args.prefix, consumer_group=trainer_group(args.prefix)),
        ready_first(),
    )
    # One version per `batch_groups` groups trained, published with the groups this trainer lost
    # (evicted, rows missing): the producer's admission gate follows both.
    versions = VersionPublisher(
        kafka,
        TopicNames(args.prefix).trainer_version,
        trainer_id=TRAINER_ID,
        consumer_group=trainer_group(args.prefix),
        batch_groups=args.batch_groups,
    )
    trained = _trained_so_far(args.journal)
    try:
        with open(args.journal, "a", encoding="utf-8") as journal:
            while not stop.is_set():
                versions.publish(trained // args.batch_groups, lost_groups=consumer.counts.lost)
                batch = consumer.next_batch(args.batch_groups, timeout_s=0.5)
                if batch is None:
                    continue
                ids = [g.group_id for g in batch.groups]
                _line(journal, "begin", ids)
                _line(journal, "rows", _group_digests(batch))
                stop.wait(args.train_step_s)  # the "training step"
                _line(journal, "trained", ids)
                consumer.release(batch)
                trained += len(ids)
    finally:
        versions.close()
        consumer.close()
        session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--ray-address", required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--train-step-s", type=float, default=0.2)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
