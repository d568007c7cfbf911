"""The trainer's version and loss count as published for admission gates: what a gate reads never goes down,
and a trainer loop that publishes every round cannot crash on a rebalance."""

from __future__ import annotations

from schemas.trainer_version import TrainerVersion
from streams.config import KafkaConfig
from streams.errors import DeliveryError
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


class Unacknowledged(SentRecords):
    """An acked producer whose first `fails` sends are not acknowledged in time (a broker down or slow)."""

    def __init__(self, fails: int) -> None:
        super().__init__()
        self.fails = fails

    def send(self, records, *, timeout_s: float = 30.0):
        if self.fails:
            self.fails -= 1
            raise DeliveryError(f"1 record(s) not acknowledged within {timeout_s:.0f}s")
        return super().send(records, timeout_s=timeout_s)


def test_a_version_the_broker_does_not_acknowledge_in_time_is_sent_again_by_the_next_call_not_raised():
    # Found by the explorer: every trainer loop rlstream ships (the verl sampler, the GRPO example, the
    # demo) calls publish each round, and a DeliveryError out of it ended the trainer whenever the
    # version topic's produce went 30 s without an acknowledgement (a broker down while it trained).
    sent = Unacknowledged(fails=2)
    pub = VersionPublisher(
        KafkaConfig("localhost:1"),
        "t.version",
        trainer_id="t",
        consumer_group="cg",
        batch_groups=4,
        clients=SendsTo(sent),
    )
    assert not pub.publish(3, lost_groups=1)
    assert pub.last_published is None
    assert not pub.publish(3, lost_groups=1)
    assert pub.publish(3, lost_groups=1), "sent again once the broker answers"
    assert pub.last_published == 3
    assert not pub.publish(3, lost_groups=1)
    assert [(r.version, r.lost_groups) for r in sent.sent] == [(3, 1)]
