"""The transaction coordinator: transactional ids, producer epochs, transactions, their markers and timeouts.

Kafka's rules as the model keeps them: `init_transactions` under a transactional id bumps its epoch,
aborting its open transaction first, so the older producer is fenced; a transaction starts on the
coordinator with its first partition or consumer group added (a `begin_transaction` alone starts
nothing); one open for longer than its `transaction.timeout.ms` is aborted by the coordinator at
its next cleanup pass (every `transaction.abort.timed.out.transaction.cleanup.interval.ms`), which
bumps the epoch too; ending it writes a marker to every partition it wrote and commits (or drops)
the consumer offsets it sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.tools.sim.kafka.cluster import KafkaCluster

EMPTY, ONGOING, COMPLETE_COMMIT, COMPLETE_ABORT = "Empty", "Ongoing", "CompleteCommit", "CompleteAbort"


class Fenced(Exception):
    """A request under an epoch older than its transactional id's current one."""


@dataclass
class TxnState:
    transactional_id: str
    producer_id: int
    epoch: int
    timeout_ms: int
    status: str = EMPTY
    partitions: set[tuple[str, int]] = field(default_factory=set)
    groups: set[str] = field(default_factory=set)
    started_at: float | None = None
    # Bumped on every start, so a timeout scheduled for an earlier transaction does nothing.
    serial: int = 0


class TxnCoordinator:
    def __init__(self, cluster: KafkaCluster):
        self.cluster = cluster
        self.txns: dict[str, TxnState] = {}

    def init_producer(self, transactional_id: str, timeout_ms: int) -> tuple[int, int]:
        state = self.txns.get(transactional_id)
        if state is None:
            state = self.txns[transactional_id] = TxnState(transactional_id, self.cluster.next_producer_id(), -1, 0)
        elif state.status == ONGOING:
            self._complete(state, commit=False)
        state.epoch += 1
        state.timeout_ms = timeout_ms
        state.status = EMPTY
        return state.producer_id, state.epoch

    def check(self, transactional_id: str, producer_id: int, epoch: int) -> TxnState:
        state = self.txns.get(transactional_id)
        if state is None or state.producer_id != producer_id or state.epoch != epoch:
            raise Fenced(transactional_id)
        return state

    def add_partitions(self, transactional_id: str, producer_id: int, epoch: int, tps: set[tuple[str, int]]) -> None:
        state = self.check(transactional_id, producer_id, epoch)
        self._start(state)
        state.partitions |= tps

    def add_offsets(self, transactional_id: str, producer_id: int, epoch: int, group: str) -> None:
        state = self.check(transactional_id, producer_id, epoch)
        self._start(state)
        state.groups.add(group)

    def end(self, transactional_id: str, producer_id: int, epoch: int, commit: bool) -> None:
        state = self.check(transactional_id, producer_id, epoch)
        if state.status == ONGOING:
            self._complete(state, commit)

    def is_open(self, transactional_id: str) -> bool:
        state = self.txns.get(transactional_id)
        return state is not None and state.status == ONGOING

    def _start(self, state: TxnState) -> None:
        if state.status == ONGOING:
            return
        state.status = ONGOING
        state.partitions, state.groups = set(), set()
        state.started_at = self.cluster.env.now()
        state.serial += 1
        serial = state.serial
        self.cluster.env.call_at(
            self._cleanup_after(state.started_at + state.timeout_ms / 1000), lambda: self._timed_out(state, serial)
        )

    def _cleanup_after(self, t: float) -> float:
        """The first cleanup pass strictly after `t` (passes run every interval since the broker started)."""
        every = self.cluster.config.txn_cleanup_interval_ms / 1000
        start = self.cluster.started_at
        return start + every * (math.floor((t - start) / every) + 1)

    def _timed_out(self, state: TxnState, serial: int) -> None:
        with self.cluster.lock:
            if state.serial != serial or state.status != ONGOING or not self.cluster.broker_up:
                if state.serial == serial and state.status == ONGOING:
                    # The coordinator is down: its first pass after coming back aborts it.
                    self.cluster.after_up(lambda: self._timed_out(state, serial))
                return
            self._complete(state, commit=False)
            state.epoch += 1  # the producer that let it time out is fenced

    def _complete(self, state: TxnState, commit: bool) -> None:
        now_ms = self.cluster.now_ms()
        for topic, partition in sorted(state.partitions):
            self.cluster.log(topic, partition).end_run(state.producer_id, commit, now_ms)
        for group in sorted(state.groups):
            self.cluster.groups.end_txn(group, state.producer_id, commit)
        state.status = COMPLETE_COMMIT if commit else COMPLETE_ABORT
        state.partitions, state.groups = set(), set()
