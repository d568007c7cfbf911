"""The rollout worker's side of a hand-back: prompt groups to generate again, read from `rollout.regenerate`.

A reassembler (staging rows gone) or the trainer (train rows gone) hands a group back with a
`Regenerate` naming its prompt. A rollout worker takes it from a `RegenerateFeed`, generates the
prompt again under `new_group_id`, publishes it, and only then calls `done`: the feed commits a
partition's offset past a hand-back once it and every one taken before it there are done, so a
worker that dies mid-way leaves them to the next (at least once). A hand-back delivered twice is
generated under the same derived id: the feed skips one it generated already or was told was (a
restarted worker passes the group ids with receipts on Kafka), since a second copy would stage under
the first one's keys.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from confluent_kafka import KafkaException, TopicPartition

from schemas.errors import SchemaError
from schemas.regenerate import Regenerate
from streams.config import KafkaConfig
from streams.kafka_api import REAL_KAFKA, KafkaApi
from workers.topics import TopicNames

log = logging.getLogger("rlstream.rollout")

# Derived group ids generated already, to skip a hand-back delivered twice (oldest forgotten first).
MAX_REMEMBERED = 100_000


@dataclass(frozen=True)
class HandBack:
    """One hand-back taken from the feed, with where it lies (for `done`)."""

    regenerate: Regenerate
    partition: int
    offset: int


class RegenerateFeed:
    """Hand-backs for one consumer group of rollout workers; `take` them, `done` once republished.

    Its consumer comes from `api` (confluent-kafka by default, the explorer's model of Kafka).
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        names: TopicNames,
        consumer_group: str,
        *,
        generated: Iterable[str] = (),
        api: KafkaApi = REAL_KAFKA,
    ):
        self.topic = names.regenerate
        self._consumer = api.Consumer(kafka.consumer(consumer_group))
        self._consumer.subscribe([self.topic], on_revoke=self._on_revoke, on_lost=self._on_revoke)
        # Per partition: offsets taken and not yet committed past, in order, and which are done.
        self._taken: dict[int, list[int]] = {}
        self._done: set[tuple[int, int]] = set()
        # What this worker generated, and what the caller knows was (receipts already on Kafka before a
        # restart): a hand-back delivered again must not stage a second copy under the same keys.
        self._generated: OrderedDict[str, None] = OrderedDict((g, None) for g in generated)

    def _on_revoke(self, consumer, partitions) -> None:
        # Its hand-backs not done are read again by the partition's next owner.
        for tp in partitions:
            for offset in self._taken.pop(tp.partition, []):
                self._done.discard((tp.partition, offset))

    def take(self, max_n: int = 1, timeout_s: float = 0.0) -> list[HandBack]:
        """Up to `max_n` hand-backs to generate (none within `timeout_s`: an empty list)."""
        out: list[HandBack] = []
        for m in self._consumer.consume(max_n, timeout_s):
            if m.error() is not None:
                if m.error().fatal():
                    raise KafkaException(m.error())
                log.debug("regenerate feed: %s", m.error().str())
                continue
            part, offset = m.partition(), m.offset()
            self._taken.setdefault(part, []).append(offset)
            try:
                back = Regenerate.from_bytes(m.value())
            except SchemaError as exc:
                log.error("undecodable hand-back at %s[%d]@%d skipped: %s", self.topic, part, offset, exc)
                self._settle(part, offset)
                continue
            if back.new_group_id in self._generated:
                self._settle(part, offset)  # delivered twice: generated already
                continue
            out.append(HandBack(back, part, offset))
        return out

    def done(self, back: HandBack) -> None:
        """`back` was generated again and published: its offset may be committed past."""
        self._generated[back.regenerate.new_group_id] = None
        while len(self._generated) > MAX_REMEMBERED:
            self._generated.popitem(last=False)
        self._settle(back.partition, back.offset)

    def _settle(self, part: int, offset: int) -> None:
        taken = self._taken.get(part)
        if not taken or offset not in taken:
            return  # revoked meanwhile: its next owner reads it again
        self._done.add((part, offset))
        upto = None
        while taken and (part, taken[0]) in self._done:
            upto = taken.pop(0)
            self._done.discard((part, upto))
        if upto is not None:
            try:
                self._consumer.commit(offsets=[TopicPartition(self.topic, part, upto + 1)], asynchronous=False)
            except KafkaException as exc:
                # Read again after a rebalance: generated twice at worst, under the same derived id.
                log.warning("regenerate feed: commit past %s[%d]@%d failed: %s", self.topic, part, upto, exc)

    def close(self) -> None:
        self._consumer.close()
