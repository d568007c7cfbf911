"""The trainer's fetch path against a raw TQ get of the same rows, for `python -m bench.dataplane --only fetch`.

Each round puts `groups` groups' packed training rows into a TQ partition of their own as a
reassembler does (sample ids `{group_id}_g{i}`, the rows and tags `build_group` makes, several
groups per put) and publishes their finalized records; once the trainer's `ExperienceConsumer`
has read them all (not timed), every batch of `groups_per_call` groups is fetched three ways, in
an order that rotates from batch to batch so that none always goes first:

  raw      `transfer_queue.kv_batch_get` of the batch's rows (packed, as in rlstream's train
           partition): TQ's own get, nothing of rlstream;
  store    `TQStore.get` of the same rows, unpacked (a store of its own, the interface the workers use);
  trainer  `ExperienceConsumer.select` + `materialize` (padded), which must hand out exactly those
           groups; `ack` follows, not timed.

The ratio trainer / raw is per round (same rows, same minute), then its median over rounds.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.dataplane.cycles import make_payload
from schemas.finalized import FinalizedGroup
from schemas.payload import unpack_payload
from schemas.rowpack import PACKED_FIELD, unpack_rows
from streams.admin import create_topics
from streams.config import KafkaConfig
from streams.producer import AckedProducer, Outgoing
from streams.tq import STAGING, TRAIN, TQStore
from workers.topics import TopicNames, pipeline_topics
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import ready_first

# A partition of its own, so these rows never meet the end-to-end run's or the bounds'.
FETCH_PARTITION = "dp_fetch"
WAYS = ("raw", "store", "trainer")


@dataclass
class FetchRound:
    """One round: `groups` groups fetched each way; seconds summed over its calls."""

    groups: int
    groups_per_call: int
    seconds: dict[str, float] = field(default_factory=dict)  # way -> seconds in its calls
    trainer_parts: dict[str, float] = field(default_factory=dict)  # select, materialize

    def groups_per_s(self, way: str) -> float:
        return self.groups / self.seconds[way]

    @property
    def ratio(self) -> float:
        """The trainer's fetch path over the raw TQ get: throughput of the same rows."""
        return self.seconds["raw"] / self.seconds["trainer"]


def _record(group_id: str, prompt_idx: int, sample_ids: list[str], tags: list[dict]) -> FinalizedGroup:
    n = len(sample_ids)
    return FinalizedGroup(
        group_id=group_id,
        prompt_idx=prompt_idx,
        partition_id=FETCH_PARTITION,
        sample_ids=tuple(sample_ids),
        tags=tuple(tags),
        group_min_wv=1,
        group_max_wv=1,
        canonical_output_tokens=0,
        valid_row_count=n,
        total_row_count=n,
        rejection_reasons=(None,) * n,
        dropped=False,
        drop_reason=None,
        metrics={},
        source=None,
        finalized_at_ms=int(time.time() * 1000),
    )


class FetchBench:
    """Topics, a trainer consumer and a template of `groups_per_call` groups; `run_round` measures one round."""

    def __init__(self, kafka: KafkaConfig, groups_per_call: int = 8, partitions: int = 4):
        import transfer_queue as tq

        self._tq, self.k = tq, groups_per_call
        self.names = TopicNames(f"dpf-{uuid.uuid4().hex[:6]}")
        create_topics(kafka, pipeline_topics(self.names, partitions))
        self._producer = AckedProducer(kafka)
        self._template = make_payload(groups_per_call)  # rows of k groups, one put's worth
        self._rows_per_group = self._template.train.batch_size[0] // groups_per_call
        # Packed as rlstream's own train partition is; the "store" way's own store, never the consumer's.
        self._store = TQStore(packed=(STAGING, TRAIN, FETCH_PARTITION))
        config = ConsumerConfig(
            prefix=self.names.prefix, consumer_group=f"dpf-trainer-{self.names.prefix}", train_partition=FETCH_PARTITION
        )
        store = TQStore(packed=(STAGING, TRAIN, FETCH_PARTITION))
        self.consumer = ExperienceConsumer(kafka, store, config, ready_first(), version=1)
        self.pad = dict(config.pad_value_dict)
        self._rounds = 0

    def _publish(self, groups: int) -> None:
        """`groups` groups' rows put `k` groups a call (as a reassembler's commit step), then their records."""
        self._rounds += 1
        t, per = self._template, self._rows_per_group
        records = []
        for start in range(0, groups, self.k):
            ids, tags = [], []
            for g in range(self.k):
                gid = f"f{self._rounds}-{uuid.uuid4().hex[:8]}-{start + g:04d}"
                ids += [f"{gid}_g{i}" for i in range(per)]
                group_tags = [dict(x, group_id=gid) for x in t.train_tags[g * per : (g + 1) * per]]
                tags += group_tags
                records.append(_record(gid, start + g, ids[-per:], group_tags))
            self._store.put(FETCH_PARTITION, ids, t.train, tags)
        self._producer.send([Outgoing(self.names.finalized, r.group_id.encode(), r.to_bytes()) for r in records])
        self._wait_ready(groups)

    def _wait_ready(self, groups: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.consumer.ready_groups()) < groups:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(self.consumer.ready_groups())} of {groups} groups read in {timeout_s:.0f}s")
            self.consumer.poll(0.2)

    def warm_up(self) -> None:
        """A round untimed (consumer group join, connections), checking that every way returns the same rows."""
        self._publish(self.k)
        keys = [s for g in self.consumer.ready_groups()[: self.k] for s in g.sample_ids]
        raw = self._tq.kv_batch_get(keys, FETCH_PARTITION)
        meta = self.consumer.select(1, self.k, self.k, timeout_s=60.0)
        if meta is None or list(meta.sample_ids) != keys:
            raise RuntimeError("select did not hand out the groups read first")
        got = self.consumer.materialize(meta)
        rows = unpack_rows(FETCH_PARTITION, keys, raw.get(PACKED_FIELD)).fields
        want = unpack_payload(rows, meta.tags, pad_value_dict=self.pad)
        for name, tensor in want.items():
            if not torch.equal(got[name], tensor):
                raise RuntimeError(f"the trainer's {name!r} differs from the raw get's")
        self.consumer.ack(meta)

    def run_round(self, groups: int) -> FetchRound:
        """`groups` groups (a multiple of `groups_per_call`) fetched each way, batch by batch."""
        self._publish(groups)
        result = FetchRound(groups, self.k, dict.fromkeys(WAYS, 0.0), {"select": 0.0, "materialize": 0.0})
        for j in range(groups // self.k):
            self._fetch_batch(result, j)
        return result

    def _fetch_batch(self, result: FetchRound, j: int) -> None:
        keys = [s for g in self.consumer.ready_groups()[: self.k] for s in g.sample_ids]
        handed = []
        ways: dict[str, Callable[[], object]] = {
            "raw": lambda: self._tq.kv_batch_get(keys, FETCH_PARTITION),
            "store": lambda: self._store.get(FETCH_PARTITION, keys),
            "trainer": lambda: handed.append(self._trainer_fetch(result)),
        }
        for way in WAYS[j % 3 :] + WAYS[: j % 3]:
            t0 = time.perf_counter()
            ways[way]()
            result.seconds[way] += time.perf_counter() - t0
        if list(handed[0].sample_ids) != keys:
            raise RuntimeError("select handed out other groups than the raw get fetched")
        self.consumer.ack(handed[0])

    def _trainer_fetch(self, result: FetchRound):
        t0 = time.perf_counter()
        meta = self.consumer.select(1, self.k, self.k, timeout_s=60.0)
        if meta is None:
            raise RuntimeError("select found no batch although the groups were read")
        t1 = time.perf_counter()
        self.consumer.materialize(meta)
        result.trainer_parts["select"] += t1 - t0
        result.trainer_parts["materialize"] += time.perf_counter() - t1
        return meta

    def close(self) -> None:
        self.consumer.close()
        self._producer.close()


def print_round(r: FetchRound) -> None:
    rates = ", ".join(f"{w} {r.groups_per_s(w):.1f}" for w in WAYS)
    print(f"  fetch: groups/s {rates}; trainer/raw {r.ratio:.2f}", flush=True)


def print_summary(rounds: list[FetchRound]) -> None:
    """Rates per way (median over rounds), ms per call, and the trainer/raw ratio per round and its median."""
    if not rounds:
        return
    k = rounds[0].groups_per_call
    calls = [r.groups / k for r in rounds]
    print(f"\ntrainer fetch path vs raw TQ get, same rows, {k} groups per call (median over rounds):")
    print(f"  {'':<34} {'groups/s':>9} {'spread':>13} {'ms/call':>9}")
    names = {
        "raw": "raw TQ get (kv_batch_get)",
        "store": "TQStore.get",
        "trainer": "trainer select + materialize",
    }
    for way in WAYS:
        rates = [r.groups_per_s(way) for r in rounds]
        med = statistics.median(rates)
        print(f"  {names[way]:<34} {med:>9.1f} {min(rates):>6.1f}-{max(rates):<6.1f} {1000 * k / med:>9.1f}")
    for part in ("select", "materialize"):
        ms = statistics.median(1000 * r.trainer_parts[part] / c for r, c in zip(rounds, calls))
        print(f"    of which {part:<25} {'':>9} {'':>13} {ms:>9.1f}")
    ratios = [r.ratio for r in rounds]
    per_round = ", ".join(f"{x:.2f}" for x in ratios)
    print(f"trainer-fetch/raw-TQ-get (8 per call): {statistics.median(ratios):.2f}  (per round: {per_round})")
