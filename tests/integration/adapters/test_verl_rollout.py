"""The verl agent-loop worker's publish, against the real broker and TQ: a group always closes.

The worker itself derives from verl's (tests/verl runs it inside verl); its publish is plain rlstream.
"""

from __future__ import annotations

from schemas.receipt import Receipt
from streams.consumer import read_topic
from streams.tq import STAGING
from tests.integration.helpers import setup_topics
from tests.unit.workers.adapters.verl_outputs import agent_output
from workers.adapters.verl_rollout import publish_group
from workers.adapters.verl_sessions import failed_group, group_rollouts
from workers.rollout.publisher import RolloutPublisher

OUTPUT = agent_output(step=0)
WHERE = {"prompt_idx": 0, "environment": "verl"}


class PutFails:
    """The real TQ store, except that staging fails (TQ unreachable from this rollout worker)."""

    def __init__(self, store):
        self._store = store

    def put(self, partition, keys, fields, tags):
        raise ConnectionError("TQ unreachable (the test)")

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_group_that_cannot_be_staged_is_published_as_failed_receipts_so_the_reassembler_closes_it(
    kafka, tq_store, unique
):
    names = setup_topics(kafka, f"vr-{unique}", partitions=1)
    publisher = RolloutPublisher(kafka, PutFails(tq_store), names.receipts)
    uid = f"u-{unique}"
    try:
        staged = group_rollouts(uid, 2, [OUTPUT, OUTPUT], **WHERE)
        reached = publish_group(publisher, staged, failed_group(uid, 2, reason="not published", **WHERE))
    finally:
        publisher.close()
    assert reached is False, "verl must dispatch another prompt: this group never reaches the trainer"
    receipts = [Receipt.from_bytes(r.value) for r in read_topic(kafka, names.receipts)]
    assert sorted((r.rollout_index, r.failure_reason, r.manifest) for r in receipts) == [
        (0, "not published", ()),
        (1, "not published", ()),
    ]
    assert not tq_store.present(STAGING, [f"{uid}-s0/c0", f"{uid}-s1/c0"])


def test_a_published_group_with_a_usable_rollout_reaches_the_trainer(kafka, tq_store, unique):
    names = setup_topics(kafka, f"vr-{unique}", partitions=1)
    publisher = RolloutPublisher(kafka, tq_store, names.receipts)
    uid = f"u-{unique}"
    try:
        staged = group_rollouts(uid, 2, [OUTPUT, RuntimeError("session died")], **WHERE)
        assert publish_group(publisher, staged, failed_group(uid, 2, reason="unused", **WHERE)) is True
        everything_failed = failed_group(f"{uid}-b", 2, reason="server down", **WHERE)
        assert publish_group(publisher, everything_failed, everything_failed) is False
    finally:
        publisher.close()
        tq_store.clear(STAGING, [f"{uid}-s0/c0"])
    assert len(list(read_topic(kafka, names.receipts))) == 4
