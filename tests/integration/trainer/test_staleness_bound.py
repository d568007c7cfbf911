"""The staleness bound holds at the version current when a group is yielded, not when it became usable.

Groups that were ready at one version and are past the policy's bound when the trainer moves on
must never be yielded: windowed evicts them, in_order never goes back to an older version.
"""

from tests.integration.helpers import wait_until
from tests.integration.trainer.staging import finalize_groups
from workers.trainer.config import ConsumerConfig
from workers.trainer.consumer import ExperienceConsumer
from workers.trainer.policies import in_order, windowed


def _all_waiting(consumer: ExperienceConsumer, total: int) -> None:
    """Read every record so each group is decided at the current version, without yielding any."""

    def read() -> bool:
        consumer.poll(0.2)
        return consumer.counts.waiting == total

    wait_until(read, timeout_s=30, what=f"{total} groups waiting")


def _drain(consumer: ExperienceConsumer) -> list[tuple[str, int]]:
    out = []
    while (batch := consumer.next_batch(4, timeout_s=1.0)) is not None:
        out += [(g.group_id, batch.version - g.group_min_wv) for g in batch.groups]
        consumer.release(batch)
    return out


def test_windowed_evicts_ready_groups_that_a_version_step_made_too_stale(kafka, tq_store, unique):
    names, finalized = finalize_groups(kafka, tq_store, f"sb-{unique}", versions=range(2), per_version=3)
    consumer = ExperienceConsumer(
        kafka, tq_store, ConsumerConfig(prefix=names.prefix, consumer_group=f"sb-{unique}"), windowed(1), version=1
    )
    try:
        _all_waiting(consumer, len(finalized))  # all usable at version 1
        consumer.set_version(2)  # v0 groups are now 2 versions behind: past the bound
        yielded = _drain(consumer)
    finally:
        consumer.close()
    assert all(staleness <= 1 for _, staleness in yielded), yielded
    assert sorted(g for g, _ in yielded) == sorted(g for g in finalized if g.startswith("v1-"))
    assert consumer.counts.evicted_stale == 3


def test_in_order_never_yields_an_older_version_after_advancing(kafka, tq_store, unique):
    names, finalized = finalize_groups(kafka, tq_store, f"sb-{unique}", versions=range(2), per_version=3)
    consumer = ExperienceConsumer(
        kafka, tq_store, ConsumerConfig(prefix=names.prefix, consumer_group=f"sb-{unique}"), in_order(2), version=0
    )
    try:
        _all_waiting(consumer, len(finalized))  # v0 groups ready, v1 held
        consumer.set_version(1)
        yielded = _drain(consumer)
    finally:
        consumer.close()
    assert yielded and all(staleness == 0 for _, staleness in yielded), yielded
    assert sorted(g for g, _ in yielded) == sorted(g for g in finalized if g.startswith("v1-"))
