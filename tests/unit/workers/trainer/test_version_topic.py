"""The trainer's version and loss count as published for admission gates: what a gate reads never goes down,
and a trainer loop that publishes every round cannot crash on a rebalance."""

from __future__ import annotations

from schemas.trainer_version import TrainerVersion
from streams.config import KafkaConfig
from workers.trainer.version_topic import VersionPublisher


class SentRecords:
    """An acked producer that keeps what it was asked to send."""

    def __init__(self) -> None:
        self.sent: list[TrainerVersion] = []

    def send(self, records, *, timeout_s: float = 30.0):
        self.sent.extend(TrainerVersion.from_bytes(r.value) for r in records)
        return [(0, len(self.sent) - 1)]

    def close(self, timeout_s: float = 10.0) -> None:
        pass


class SendsTo:
    """Trainer clients whose acked producer is `sent`."""

    def __init__(self, sent: SentRecords) -> None:
        self.sent = sent

    def acked_producer(self) -> SentRecords:
        return self.sent


def publisher() -> tuple[VersionPublisher, SentRecords]:
    sent = SentRecords()
    kafka = KafkaConfig("localhost:1")
    pub = VersionPublisher(
        kafka, "t.version", trainer_id="t", consumer_group="cg", batch_groups=4, clients=SendsTo(sent)
    )
    return pub, sent


def test_a_loss_count_given_back_on_a_rebalance_neither_crashes_the_trainer_nor_lowers_what_gates_read():
    pub, sent = publisher()
    assert pub.publish(3, lost_groups=2)
    # A partition was revoked with a missing-rows letter unacknowledged: the consumer gives that loss
    # back (its record is read and counted again by whoever reads the partition next).
    assert not pub.publish(3, lost_groups=1), "nothing new to tell the gates"
    assert pub.publish(4, lost_groups=1)
    # Read again here and counted again: the count is back where it was, not one past it.
    assert not pub.publish(4, lost_groups=2)
    assert pub.publish(4, lost_groups=3)
    assert [(r.version, r.lost_groups) for r in sent.sent] == [(3, 2), (4, 2), (4, 3)]
    assert len({r.run for r in sent.sent}) == 1
