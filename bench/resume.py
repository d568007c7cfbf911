"""Resume benchmark (issue 30): how long `rlstream resume` takes, and its peak memory, after a job of --groups groups.

Writes the history of a job that saw --groups prompt groups on a real broker, the way the pipeline
writes it: a `PartitionTask` per partition (the reassembler's production code) takes each group's
receipt through intake, close and prepare, and `commit_transaction` commits each step's finalized
records, state entries, tombstones and progress in one transaction; the receipts go to the receipts
topic. Event time runs at --groups-per-s, so the reassemblers remember the last hour of groups (at
most 200,000 per partition). All but the last --untrained + --open groups were trained before the
checkpoint: the checkpoint (state, resolved groups, spill from real TQ) cuts there; --untrained
finalized groups lie past the cut with their train rows in the spill, and --open groups have only
their receipts (past the reassemblers' offsets) and staged rows. Then TQ is emptied, as when the job
dies, and `rlstream resume` runs as a child process against the same broker and TQ: its wall time
and peak RSS (the child's VmHWM), beside a child that only imports what resume imports. With
--full it runs again on the checkpoint without its resolved groups, which reads the finalized topic
from its start, as every resume did before (and as one does for a checkpoint written before them).

    .venv/bin/python -m bench.resume [--groups 1000000] [--partitions 4] [--full]

At 1M groups on 2 cores: about 6-8 minutes to write the history, seconds to resume (`bench/README.md`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from confluent_kafka import Consumer, Producer, TopicPartition
from tensordict import TensorDict

from schemas.finalized import FinalizedGroup, SourceRange
from schemas.receipt import CallRecord, Receipt
from streams.admin import create_topics
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.consumer import Record, end_offsets
from streams.partitioner import partition_of
from streams.producer import TransactionalProducer
from streams.tq import STAGING, TRAIN, TQConfig, TQStore, init_tq, ray_address
from workers.reassembler.commit import commit_transaction
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.finalize import GroupOutcome
from workers.reassembler.restore import restore_partition
from workers.reassembler.task import PartitionTask
from workers.topics import TopicNames, pipeline_topics
from workers.trainer.checkpoint import STATE_VERSION, ConsumerState, PartitionMark, encode_state
from workers.trainer.checkpoint_dir import STATE_FILE, spill_binding
from workers.trainer.resolved import RESOLVED_FILE, write_resolved
from workers.trainer.spill import spill_rows

ROOT = Path(__file__).resolve().parents[1]
STEP_GROUPS = 2000
TRAINER, REASSEMBLERS, RUN = "bench-trainer", "bench-reassemblers", "bench"


class _NoStore:
    """Staging is not cleared in this bench (clear_staging off): the task never calls the store."""

    def clear(self, partition: str, keys: list[str]) -> None:  # pragma: no cover - never called
        raise AssertionError("unexpected staging clear")


def _gid(i: int) -> str:
    return f"bench-g{i:08d}"


def _receipt(i: int) -> Receipt:
    gid = _gid(i)
    call = CallRecord(f"{gid}-r0/c0", "c0", None, 0, 8, 8, 1, "d")
    return Receipt(gid + "-r0", gid, i, 0, 1, 0.5, True, 1.0, "bench", None, (call,))


def _finalized(i: int, rows: int, tokens: int, now_ms: int, topic: str, part: int, offset: int) -> FinalizedGroup:
    """The record of a group of `rows` rollouts, with the tags a real build gives each row."""
    gid = _gid(i)
    tags = tuple(
        {
            "group_id": gid,
            "prompt_idx": i,
            "row": r,
            "weight_version": 3,
            "input_lengths": tokens,
            "input_ids__row_shapes": [tokens],
            "token_mask__row_shapes": [tokens],
            "total_reward": 0.5,
        }  # fmt: skip
        for r in range(rows)
    )
    return FinalizedGroup(
        group_id=gid, prompt_idx=i, partition_id=TRAIN, sample_ids=tuple(f"{gid}_g{r}" for r in range(rows)),
        tags=tags, group_min_wv=3, group_max_wv=3, canonical_output_tokens=rows * tokens, valid_row_count=rows,
        total_row_count=rows, rejection_reasons=(None,) * rows, dropped=False, drop_reason=None,
        metrics={"fetch_ms": 1.0, "build_put_ms": 2.0, "receipts": float(rows)},
        source=SourceRange(topic, part, offset, offset), finalized_at_ms=now_ms,
    )  # fmt: skip


@dataclasses.dataclass
class _History:
    """Where the groups went: per partition, the tasks, receipt offsets, and the groups resolved."""

    names: TopicNames
    config: ReassemblerConfig
    parts: int
    tasks: list[PartitionTask]
    receipt_offsets: list[int]
    resolved: list[tuple[str, int, int]]
    finalized_count: list[int]


def _write(kafka, h: _History, producer, receipts: Producer, first: int, last: int, args, *, close: bool) -> None:
    """Groups [first, last): receipts produced; with `close`, finalized through the tasks and committed."""
    base_ms = int(time.time() * 1000) - int(args.groups / args.groups_per_s * 1000)
    t0 = time.perf_counter()
    for start in range(first, last, STEP_GROUPS):
        stop = min(last, start + STEP_GROUPS)
        now_ms = base_ms + int(stop * 1000 / args.groups_per_s)
        by_part: dict[int, list[tuple[int, Receipt]]] = {}
        for i in range(start, stop):
            part = partition_of(_gid(i).encode(), h.parts)
            r = _receipt(i)
            receipts.produce(h.names.receipts, r.to_bytes(), _gid(i).encode(), partition=part)
            by_part.setdefault(part, []).append((i, r))
            receipts.poll(0)
        if not close:
            continue
        commits = []
        for part, items in by_part.items():
            task = h.tasks[part]
            for _, r in items:
                task.intake(
                    Record(
                        h.names.receipts, part, h.receipt_offsets[part], r.group_id.encode(), r.to_bytes(), (), now_ms
                    ),
                    now_ms,
                )
                h.receipt_offsets[part] += 1
            ready = task.ready(task.clock(now_ms, caught_up=True, paused=False), 10**9)
            outcomes = []
            for g in ready:
                i = int(g.group_id.rsplit("g", 1)[1])
                record = _finalized(i, args.rows, args.tokens, now_ms, h.names.receipts, part, g.first_offset)
                outcomes.append(GroupOutcome(g, record, None, None, ()))
                h.resolved.append((g.group_id, part, h.finalized_count[part]))
                h.finalized_count[part] += 1
            commits.append(dataclasses.replace(task.prepare(outcomes, now_ms), commit_offset=None))
        writes = commit_transaction(
            producer, commits, topics=h.names, receipts_topic=h.names.receipts, consumer_group_metadata=None
        )
        for c in commits:
            h.tasks[c.partition].post_commit(c, writes.get(c.partition))
        if stop % 100_000 < STEP_GROUPS or stop == last:
            print(
                f"  groups {stop:,} written ({(stop - first) / (time.perf_counter() - t0):,.0f} groups/s)", flush=True
            )
    receipts.flush(60)


def _put_rows(store: TQStore, first: int, last: int, rows: int, tokens: int) -> None:
    """The train rows of groups [first, last), as a reassembler puts them."""
    for start in range(first, last, 64):
        gids = [_gid(i) for i in range(start, min(last, start + 64))]
        n = len(gids) * rows
        fields = TensorDict(
            {
                "input_ids": torch.randint(1, 32_000, (n, tokens), dtype=torch.int64),
                "token_mask": torch.ones(n, tokens, dtype=torch.bool),
                "generation_logprobs": torch.zeros(n, tokens, dtype=torch.float32),
                "total_reward": torch.full((n,), 0.5),
                "sample_mask": torch.ones(n),
            },
            batch_size=[n],
        )
        keys = [f"{g}_g{r}" for g in gids for r in range(rows)]
        store.put(TRAIN, keys, fields, [{"group_id": k.rsplit("_g", 1)[0]} for k in keys])


def _stage_open(store: TQStore, first: int, last: int) -> None:
    gids = [_gid(i) for i in range(first, last)]
    keys = [f"{g}-r0/c0" for g in gids]
    fields = TensorDict({"token_ids": torch.arange(8).repeat(len(keys), 1)}, batch_size=[len(keys)])
    store.put(STAGING, keys, fields, [{"group_id": g, "rollout_id": f"{g}-r0"} for g in gids])


def _commit_offsets(kafka: KafkaConfig, group: str, topic: str) -> None:
    c = Consumer(kafka.consumer(group))
    try:
        ends = end_offsets(kafka, topic)
        c.commit(offsets=[TopicPartition(topic, p, high) for p, (_, high) in ends.items()], asynchronous=False)
    finally:
        c.close()


def _checkpoint(
    directory: Path, kafka: KafkaConfig, h: _History, marks: dict[int, int], store: TQStore, seen: int
) -> None:
    state = encode_state(
        ConsumerState(
            STATE_VERSION, h.names.finalized, TRAINER, 3, 1, {p: PartitionMark(o, []) for p, o in marks.items()}, RUN
        )
    )
    (directory / STATE_FILE).write_text(json.dumps(state, sort_keys=True))
    binding = spill_binding(state)
    t0 = time.perf_counter()
    write_resolved(directory, binding, h.resolved[-seen:])
    summary = spill_rows(store, directory, binding=binding, partitions=(STAGING, TRAIN))
    print(
        f"checkpoint: {len(h.resolved[-seen:]):,} resolved groups and a spill of {sum(summary.rows.values()):,} rows"
        f" ({summary.bytes / 1e6:.0f} MB) written in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )


def _hwm(pid: int) -> int | None:
    """The peak resident set of `pid` since its exec (VmHWM), in bytes; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _child(argv: list[str]) -> tuple[float, int, str]:
    """Run `argv` as a child; its wall time, peak RSS (bytes) and output.

    The peak is the child's own VmHWM, read until it exits: the ru_maxrss wait4 reports for a child
    counts the parent's memory at the fork (Linux records the old image's high-water mark at exec).
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as out_file:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out_file, stderr=subprocess.STDOUT, text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _hwm(proc.pid) or 0)
            time.sleep(0.02)
        seconds = time.perf_counter() - t0
        out_file.seek(0)
        out = out_file.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {proc.returncode}:\n{out[-3000:]}")
    return seconds, peak, out


def _resume(kafka: KafkaConfig, names: TopicNames, checkpoint: Path) -> tuple[float, int, str]:
    argv = [sys.executable, "-m", "workers.cli.main", "resume", "--bootstrap-servers", kafka.bootstrap_servers]
    argv += ["--prefix", names.prefix, "--trainer-consumer-group", TRAINER, "--consumer-group", REASSEMBLERS]
    argv += ["--checkpoint", str(checkpoint), "--ray-address", ray_address()]
    return _child(argv)


def _figure(out: str, pattern: str) -> str:
    m = re.search(pattern, out)
    return m.group(1) if m else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--groups-per-s", type=float, default=50.0, help="event time: groups per second of it")
    parser.add_argument("--untrained", type=int, default=2000, help="finalized groups past the checkpoint's cut")
    parser.add_argument("--open", type=int, default=500, help="groups with receipts only, past the reassemblers")
    parser.add_argument("--rows", type=int, default=8, help="rollouts (train rows) per group")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per train row")
    parser.add_argument("--seen", type=int, default=1_000_000, help="resolved groups the checkpoint keeps")
    parser.add_argument("--full", action="store_true", help="also resume reading the finalized topic from its start")
    args = parser.parse_args()
    names = TopicNames("bench-resume")
    config = ReassemblerConfig(prefix=names.prefix, worker_id="bench", clear_staging=False, consumer_group=REASSEMBLERS)
    trained_end = args.groups - args.untrained - args.open
    with tempfile.TemporaryDirectory() as tmp, LocalBroker(BrokerConfig(data_dir=Path(tmp) / "kafka")) as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap_servers)
        session = init_tq(TQConfig())
        try:
            # No compaction during the run: resume must be bounded without the log cleaner's help.
            create_topics(kafka, pipeline_topics(names, args.partitions, config={"segment.ms": str(7 * 86_400_000)}))
            print(
                f"writing the history of {args.groups:,} groups to {names.prefix}.* at {broker.bootstrap_servers}",
                flush=True,
            )
            h = _History(
                names, config, args.partitions,
                [PartitionTask.resume(restore_partition(p, []), _NoStore(), config) for p in range(args.partitions)],
                [0] * args.partitions, [], [0] * args.partitions,
            )  # fmt: skip
            producer = TransactionalProducer(kafka, f"{REASSEMBLERS}.bench")
            receipts = Producer(kafka.producer(**{"linger.ms": 50, "batch.size": 1_000_000}))
            t0 = time.perf_counter()
            _write(kafka, h, producer, receipts, 0, trained_end, args, close=True)
            marks = {p: high for p, (_, high) in end_offsets(kafka, names.finalized).items()}
            trained = list(h.resolved)
            _write(kafka, h, producer, receipts, trained_end, trained_end + args.untrained, args, close=True)
            _commit_offsets(kafka, REASSEMBLERS, names.receipts)
            _write(kafka, h, producer, receipts, trained_end + args.untrained, args.groups, args, close=False)
            print(f"history written in {time.perf_counter() - t0:.0f} s", flush=True)
            sizes = {
                t: sum(h for _, h in end_offsets(kafka, t).values())
                for t in (names.finalized, names.state, names.receipts)
            }
            store = TQStore()
            _put_rows(store, trained_end, trained_end + args.untrained, args.rows, args.tokens)
            _stage_open(store, trained_end + args.untrained, args.groups)
            checkpoint = Path(tmp) / "checkpoint"
            checkpoint.mkdir()
            h.resolved = trained
            _checkpoint(checkpoint, kafka, h, marks, store, args.seen)
            for partition in (TRAIN, STAGING):  # the job dies: TQ comes back empty
                store.clear(partition, list(store.list(partition)))

            base_s, base_rss, _ = _child(
                [sys.executable, "-c", "import workers.cli.ops, workers.trainer.resume, streams.tq, ray, torch"]
            )
            seconds, rss, out = _resume(kafka, names, checkpoint)
            read = _figure(out, r"read from the checkpoint.s cut: (\d+)")
            states = _figure(out, r"restore points: (\d+)")
            restored = _figure(out, r"finalized groups restored \((\d+) train rows")
            staged = _figure(out, r"\((\d+) staged rows back")
            print(
                f"resume of {args.groups:,} groups ({sizes[names.finalized]:,} finalized, {sizes[names.state]:,} state,"
                f" {sizes[names.receipts]:,} receipts offsets): {seconds:.1f} s, peak RSS {rss / 2**20:,.0f} MiB"
                f" (imports alone: {base_s:.1f} s, {base_rss / 2**20:,.0f} MiB); read {read} finalized and {states}"
                f" state records, put back {restored} train rows and {staged} staged rows",
                flush=True,
            )
            print("  " + next((x for x in out.splitlines() if x.startswith("took:")), "took: ?"), flush=True)
            if "unaccounted for: 0" not in out:
                print(out)
                raise SystemExit("resume left groups unaccounted for")
            if args.full:
                (checkpoint / RESOLVED_FILE).unlink()
                for partition in (TRAIN, STAGING):
                    store.clear(partition, list(store.list(partition)))
                full_s, full_rss, out = _resume(kafka, names, checkpoint)
                print("  " + next((x for x in out.splitlines() if x.startswith("took:")), "took: ?"), flush=True)
                print(
                    f"resume reading the finalized topic from its start: {full_s:.1f} s, peak RSS"
                    f" {full_rss / 2**20:,.0f} MiB ({full_s / seconds:.1f}x the time of the resume from the cut)",
                    flush=True,
                )
        finally:
            session.close()


if __name__ == "__main__":
    main()
