"""Helpers shared by the worker integration tests: topic setup, publishing synthetic groups, reading outputs."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from schemas.deadletter import DeadLetter
from schemas.finalized import FinalizedGroup
from streams.admin import create_topics
from streams.consumer import read_topic
from workers.rollout.publisher import RolloutPublisher, StagedRollout
from workers.rollout.synthetic import SyntheticShape, make_group
from workers.topics import TopicNames, pipeline_topics

SMALL = SyntheticShape(group_size=8, calls=(1, 3), prompt_len=(4, 12), answer_len=(2, 16), observation_len=(1, 6))


def setup_topics(kafka, prefix: str, partitions: int = 4) -> TopicNames:
    names = TopicNames(prefix)
    create_topics(kafka, pipeline_topics(names, partitions))
    return names


def publish_groups(
    kafka,
    store,
    names: TopicNames,
    n_groups: int,
    *,
    shape: SyntheticShape = SMALL,
    seed: int = 0,
    weight_version: int = 1,
    prefix: str = "g",
    batch: int = 200,
) -> dict[str, list[StagedRollout]]:
    """Publish n_groups groups with their receipts shuffled across groups; returns group_id -> rollouts."""
    groups = {
        f"{prefix}{i:04d}": make_group(f"{prefix}{i:04d}", i, weight_version, shape=shape, seed=seed)
        for i in range(n_groups)
    }
    rollouts = [r for g in groups.values() for r in g]
    random.Random(seed).shuffle(rollouts)
    pub = RolloutPublisher(kafka, store, names.receipts)
    for i in range(0, len(rollouts), batch):
        pub.publish(rollouts[i : i + batch])
    pub.close()
    return groups


def finalized_records(kafka, names: TopicNames) -> list[FinalizedGroup]:
    return [FinalizedGroup.from_bytes(r.value) for r in read_topic(kafka, names.finalized)]


def dead_letters(kafka, names: TopicNames) -> list[DeadLetter]:
    return [DeadLetter.from_bytes(r.value) for r in read_topic(kafka, names.deadletter)]


def drive(workers, until: Callable[[], bool], timeout_s: float, check_every_s: float = 1.0) -> None:
    """Step in-process workers round-robin until `until()` holds."""
    deadline = time.monotonic() + timeout_s
    last_check = 0.0
    while True:
        for w in workers:
            w.step()
        if time.monotonic() - last_check >= check_every_s:
            last_check = time.monotonic()
            if until():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s:.0f}s")


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Call `condition` until it holds; TimeoutError naming `what` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")


def stale_clear(partition: str, keys: list[str], *, looked_up_in: str = "rlstream.stale-lookup") -> None:
    """What a clear whose lookup went stale does to `keys`' rows, on the real TQ: TQ's own clear steps
    (`async_clear_samples`: mark, storage clear, release) by the keys' global indexes, sent for keys
    of another partition that held those indexes when it looked them up (then they were cleared by
    their next owner and the indexes handed to these rows). Storage deletes by index; the controller,
    named another partition, keeps `keys` mapped and ready. tests/integration/streams/test_tq.py
    drives the whole interleaving on real TQ."""
    import transfer_queue as tq
    from transfer_queue.metadata import BatchMeta

    client = tq.get_client()
    meta = client.kv_retrieve_meta(keys=keys, partition_id=partition)
    assert meta.size == len(keys), f"not every key is in TQ partition {partition!r}"
    stale = BatchMeta(global_indexes=meta.global_indexes, partition_ids=[looked_up_in] * meta.size)
    client._run_coroutine(client.async_clear_samples(stale))
