"""What the trainer must have on the broker before it commits past a record: its dead letters and hand-backs.

A record the trainer cannot train (undecodable, rows gone) resolves only once the record that says
so, a `DeadLetter` on `trainer.deadletter` or a `Regenerate` on `rollout.regenerate`, is
acknowledged; until then the record's offset holds the commit back. Notices are sent without
blocking the trainer: each poll queues new ones and serves delivery reports; one the broker does not
take within `DELIVERY_TIMEOUT_MS` (the topic is missing, say) is logged and sent again, while the
records behind it keep flowing. A trainer that dies between the acknowledgement and the commit sends
the notice again: notices are at least once (a reader dedupes by source position, a regeneration by
its derived group id).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from workers.trainer.clients import TrainerClients

# How long the broker has to acknowledge a notice before it is logged and sent again.
DELIVERY_TIMEOUT_MS = 30_000

log = logging.getLogger("rlstream.trainer")


@dataclass(frozen=True)
class Notice:
    """One record to send about the finalized record at `source` (a dead letter, or a hand-back)."""

    topic: str
    key: bytes | None
    value: bytes
    kind: str  # the letter's error kind, or HANDED_BACK
    source: str  # topic[partition]@offset, for the log


class Outbox:
    """Notices waiting for acknowledgement, by source partition and offset; `flush` sends and collects them."""

    def __init__(self, clients: TrainerClients, worker_id: str):
        self.worker_id = worker_id
        self._clients = clients
        self._producer = None
        self._waiting: dict[int, dict[int, Notice]] = {}
        self._in_flight: set[tuple[int, int]] = set()
        self._acked: list[tuple[int, int]] = []

    def add(self, partition: int, offset: int, notice: Notice) -> None:
        self._waiting.setdefault(partition, {})[offset] = notice

    def offsets(self, partition: int) -> list[int]:
        return list(self._waiting.get(partition, ()))

    def drop(self, partition: int) -> list[Notice]:
        """The partition was revoked: its records are read again by its next owner, notices and all.
        Returns the notices dropped."""
        return list(self._waiting.pop(partition, {}).values())

    def flush(self, timeout_s: float = 0.0) -> list[tuple[int, int]]:
        """Send the notices not in flight, serve delivery reports (waiting up to timeout_s for all);
        returns the (partition, offset) of the records whose notices were acknowledged."""
        if not self._waiting and not self._in_flight:
            return []
        if self._producer is None:
            self._producer = self._clients.producer({"message.timeout.ms": DELIVERY_TIMEOUT_MS})
        for part, by_offset in self._waiting.items():
            for offset, notice in by_offset.items():
                if (part, offset) not in self._in_flight:
                    self._send(part, offset, notice)
        if timeout_s > 0:
            self._producer.flush(timeout_s)
        else:
            self._producer.poll(0)
        acked, self._acked = self._acked, []
        return acked

    def _send(self, part: int, offset: int, notice: Notice) -> None:
        def report(err, _msg) -> None:
            self._in_flight.discard((part, offset))
            if self._waiting.get(part, {}).get(offset) is not notice:
                return  # its partition was revoked meanwhile
            if err is not None:
                log.error(
                    "%s of %s not acknowledged by %s, sending again: %s",
                    notice.kind,
                    notice.source,
                    notice.topic,
                    err.str(),
                )
                return
            del self._waiting[part][offset]
            self._acked.append((part, offset))

        try:
            self._producer.produce(notice.topic, key=notice.key, value=notice.value, on_delivery=report)
        except BufferError:
            return  # the local queue is full: sent by a later flush
        self._in_flight.add((part, offset))

    def close(self, timeout_s: float = 5.0) -> None:
        if self._producer is not None:
            self._producer.flush(timeout_s)
