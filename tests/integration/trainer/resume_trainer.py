"""A trainer process the resume test can kill: it trains through a checkpointed `ExperienceConsumer`.

`first`: trains `--before` batches, saves a checkpoint (its "model", the group ids it trained, and
the consumer's state_dict) and declares it durable; trains `--mid` batches and saves a second
checkpoint over the first, but dies before declaring it durable; so it trains `--after` more
batches, then SIGKILLs itself. `resume`: restores from the checkpoint file and trains until `--total`
groups are in its model.
Each trained batch is journaled, so the test knows what the killed run trained after its checkpoint.

    python -m tests.integration.trainer.resume_trainer first|resume --bootstrap-servers B --prefix P ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from streams.config import KafkaConfig
from streams.tq import TQConfig, TQStore, init_tq
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first

VERSION = 10


def train_one(consumer: ExperienceConsumer, model: list[str], journal, kind: str) -> bool:
    meta = consumer.select(VERSION, 1, 2, timeout_s=5.0)
    if meta is None:
        return False
    rows = consumer.materialize(meta, fields=["input_ids"])
    assert rows.batch_size[0] == len(meta.sample_ids)
    ids = [g.group_id for g in meta.groups]
    model += ids  # the "optimizer step": the model now holds these groups
    journal.write(json.dumps({"kind": kind, "groups": ids}) + "\n")
    journal.flush()
    consumer.ack(meta)
    return True


def save(checkpoint: Path, model: list[str], consumer: ExperienceConsumer) -> dict:
    state = consumer.state_dict()
    tmp = checkpoint.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": model, "consumer": state}))
    os.replace(tmp, checkpoint)
    return state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["first", "resume"])
    for flag in ("--bootstrap-servers", "--prefix", "--consumer-group", "--ray-address", "--checkpoint", "--journal"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--before", type=int, default=2)
    ap.add_argument("--mid", type=int, default=1)
    ap.add_argument("--after", type=int, default=2)
    ap.add_argument("--total", type=int, default=0)
    args = ap.parse_args()
    init_tq(TQConfig(address=args.ray_address))
    config = ConsumerConfig(prefix=args.prefix, consumer_group=args.consumer_group, checkpointed=True)
    consumer = ExperienceConsumer(KafkaConfig(args.bootstrap_servers), TQStore(), config, ready_first())
    checkpoint = Path(args.checkpoint)
    with open(args.journal, "a", encoding="utf-8") as journal:
        if args.phase == "first":
            model: list[str] = []
            for _ in range(args.before):
                assert train_one(consumer, model, journal, "before")
            consumer.checkpoint_durable(save(checkpoint, model, consumer))
            for _ in range(args.mid):
                assert train_one(consumer, model, journal, "mid")
            save(checkpoint, model, consumer)  # ... and no checkpoint_durable: the crash comes first
            for _ in range(args.after):
                assert train_one(consumer, model, journal, "after")
            os.kill(os.getpid(), signal.SIGKILL)
        saved = json.loads(checkpoint.read_text())
        consumer.load_state_dict(saved["consumer"])
        model = saved["model"]
        deadline = time.monotonic() + 120
        while len(model) < args.total and time.monotonic() < deadline:
            train_one(consumer, model, journal, "resumed")
        consumer.checkpoint_durable(consumer.state_dict())  # the final checkpoint
    consumer.close()
    print(json.dumps({"model": model}))


if __name__ == "__main__":
    main()
