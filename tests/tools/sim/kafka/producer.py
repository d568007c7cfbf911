"""confluent-kafka's `Producer`: idempotent, or transactional with librdkafka's state machine.

Records wait in a local queue until a send (`linger.ms` after a produce, or a flush, poll or commit);
each partition's batch is one request (a transactional one first adds new partitions to the
transaction). Delivery reports are served by `poll` and `flush`; a record not delivered within
`message.timeout.ms` is reported `_MSG_TIMED_OUT` (a request still in flight may land later all the
same). A fatal error (fenced) is raised once by the next `poll` or `flush`, and by every
transactional call after it; an abortable one (offsets refused, a delivery failed) by every call
but `abort_transaction`. A transactional call that runs out of time raises a retriable `_TIMED_OUT`
and goes on in the background; calling it again resumes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from tests.tools.sim.env import Request
from tests.tools.sim.kafka import errors
from tests.tools.sim.kafka.group import GroupRefused
from tests.tools.sim.kafka.messages import GroupMetadata, Message, choose_partition, cluster_metadata
from tests.tools.sim.kafka.txn import Fenced

if TYPE_CHECKING:
    from tests.tools.sim.kafka.cluster import KafkaCluster

INIT, READY, IN_TXN, ABORTABLE, FATAL = "Init", "Ready", "InTransaction", "AbortableError", "FatalError"


@dataclass
class _Record:
    topic: str
    partition: int
    key: bytes | None
    value: bytes | None
    headers: list | None
    timestamp_ms: int
    on_delivery: Callable | None
    deadline: float
    done: bool = False


def _timeout(seconds: float | None) -> float:
    return math.inf if seconds is None or seconds < 0 else seconds


class Producer:
    def __init__(self, conf: dict[str, Any], *, cluster: KafkaCluster, process: str):
        self._cluster, self._env = cluster, cluster.env
        self._process = process
        self.name = conf.get("client.id") or cluster.client_name("producer")
        self._tid: str | None = conf.get("transactional.id")
        self._txn_timeout_ms = int(conf.get("transaction.timeout.ms", 60000))
        self._linger_s = float(conf.get("linger.ms", 5)) / 1000
        self._msg_timeout_s = float(conf.get("message.timeout.ms", conf.get("delivery.timeout.ms", 300000))) / 1000
        self._max_queued = int(conf.get("queue.buffering.max.messages", 100000))
        self._partitioner = str(conf.get("partitioner", "consistent_random"))
        self._on_delivery = conf.get("on_delivery")
        self._queue: list[_Record] = []
        self._in_flight: list[_Record] = []
        self._reports: list[tuple[Callable, KafkaError | None, Message]] = []
        self._send_scheduled = False
        self._frozen = False
        self._state = INIT if self._tid else READY
        self._pid: int | None = None if self._tid else cluster.next_producer_id()
        self._epoch = 0
        self._fatal: KafkaError | None = None
        self._fatal_unraised = False
        self._abortable: KafkaError | None = None
        self._txn_partitions: set[tuple[str, int]] = set()
        # Whether this transaction sent offsets: with no partition and no offsets, its end sends nothing.
        self._txn_offsets = False
        self._txn_failed = 0
        self._op: tuple[str, Request] | None = None
        cluster.process(process).clients.append(self)

    # ----- producing -------------------------------------------------------------------------------

    def produce(self, topic: str, value=None, key=None, partition: int = -1, on_delivery=None, timestamp: int = 0,
                headers=None, **kwargs) -> None:  # fmt: skip
        callback = on_delivery or kwargs.get("callback") or self._on_delivery
        self._env.point("kafka.producer.produce.begin", client=self.name, topic=topic)
        if self._tid is not None:
            if self._state == FATAL:
                errors.raise_(self._fatal)
            if self._state != IN_TXN:
                errors.raise_(errors.produce_state())
        if len(self._queue) + len(self._in_flight) >= self._max_queued:
            raise BufferError("Local: Queue full")
        if isinstance(value, str):
            value = value.encode()
        if isinstance(key, str):
            key = key.encode()
        with self._cluster.lock:
            t = self._cluster.topics.get(topic)
            if partition is None or partition < 0:
                partition = choose_partition(self._partitioner, key, len(t.logs), self._env.rng) if t else 0
        now = self._env.now()
        rec = _Record(topic, partition, key, value, list(headers) if headers else None,
                      timestamp or int(now * 1000), callback, now + self._msg_timeout_s)  # fmt: skip
        self._queue.append(rec)
        self._env.call_at(rec.deadline, lambda: self._expire(rec))
        if not self._send_scheduled:
            self._send_scheduled = True
            self._env.call_at(now + self._linger_s, self._linger_done)
        self._env.point("kafka.producer.produce.end", client=self.name, topic=topic, partition=partition)

    def _linger_done(self) -> None:
        self._send_scheduled = False
        self._send()

    def _send(self) -> None:
        """Send what is queued, one request per partition (after adding new partitions to the transaction)."""
        if self._frozen or not self._queue or self._state == FATAL or not self._cluster.broker_up:
            return  # no connection: records stay queued (and time out there) until the broker is back
        batches: dict[tuple[str, int], list[_Record]] = {}
        for rec in self._queue:
            if self._cluster.has_partition(rec.topic, rec.partition):
                batches.setdefault((rec.topic, rec.partition), []).append(rec)
        if not batches:
            return  # unknown topics: the records wait for their delivery timeout
        sent = {id(r) for b in batches.values() for r in b}
        self._queue = [r for r in self._queue if id(r) not in sent]
        for batch in batches.values():
            self._in_flight.extend(batch)
        new = set(batches) - self._txn_partitions if self._tid is not None else set()
        if new:
            self._txn_partitions |= new
            tid, pid, epoch = self._tid, self._pid, self._epoch
            add = self._request(
                "kafka.broker.add_partitions_to_txn",
                lambda: self._cluster.txn.add_partitions(tid, pid, epoch, new),
                partitions=sorted(new),
            )
            add.on_landed(lambda r: self._added(r, batches))
            self._cluster.send(add)
        else:
            for tp, batch in batches.items():
                self._produce_request(tp, batch)

    def _added(self, request: Request, batches: dict[tuple[str, int], list[_Record]]) -> None:
        if isinstance(request.error, Fenced):
            self._fail_fatal(errors.fenced("Failed to add partitions to transaction"))
            for batch in batches.values():
                self._report_all(batch, errors.delivery_fenced())
            return
        for tp, batch in batches.items():
            self._produce_request(tp, batch)

    def _produce_request(self, tp: tuple[str, int], batch: list[_Record]) -> None:
        tid, pid, epoch = self._tid, self._pid, self._epoch

        def append() -> list[int]:
            with self._cluster.lock:
                if tid is not None:
                    self._cluster.txn.check(tid, pid, epoch)
                log = self._cluster.log(*tp)
                return [log.append(r.key, r.value, r.headers, r.timestamp_ms, pid, tid is not None) for r in batch]

        request = self._request("kafka.broker.produce", append, topic=tp[0], partition=tp[1], records=len(batch))
        request.on_landed(lambda r: self._produced(r, tp, batch))
        self._cluster.send(request)

    def _produced(self, request: Request, tp: tuple[str, int], batch: list[_Record]) -> None:
        if isinstance(request.error, Fenced):
            self._fail_fatal(errors.produce_fenced(*tp))
            self._report_all(batch, errors.delivery_fenced())
            return
        for rec, offset in zip(batch, request.result):
            self._report(rec, None, offset)

    def _report(self, rec: _Record, err: KafkaError | None, offset: int = -1001) -> None:
        if rec in self._in_flight:
            self._in_flight.remove(rec)
        if rec.done:
            return  # reported already (timed out): the record landed all the same
        rec.done = True
        if err is not None and self._tid is not None and self._state == IN_TXN:
            self._txn_failed += 1
        if rec.on_delivery is not None:
            msg = Message(rec.topic, rec.partition, offset if err is None else -1001, rec.key, rec.value,
                          rec.headers, rec.timestamp_ms)  # fmt: skip
            self._reports.append((rec.on_delivery, err, msg))

    def _report_all(self, batch: list[_Record], err: KafkaError) -> None:
        for rec in batch:
            self._report(rec, err)

    def _expire(self, rec: _Record) -> None:
        if rec.done:
            return
        if rec in self._queue:
            self._queue.remove(rec)
        self._report(rec, errors.msg_timed_out())

    def _request(self, name: str, apply: Callable[[], Any], **details: Any) -> Request:
        return Request(name, apply, client=self.name, process=self._process, **details)

    def _fail_fatal(self, err: KafkaError) -> None:
        if self._state != FATAL:
            self._state, self._fatal, self._fatal_unraised = FATAL, err, True

    # ----- serving reports ---------------------------------------------------------------------------

    def _serve(self) -> int:
        if self._fatal_unraised:
            self._fatal_unraised = False
            raise KafkaException(self._fatal)
        reports, self._reports = self._reports, []
        for cb, err, msg in reports:
            cb(err, msg)
        return len(reports)

    def poll(self, timeout: float | None = None) -> int:
        self._env.point("kafka.producer.poll.begin", client=self.name)
        self._send()
        if not self._reports and not self._fatal_unraised:
            self._env.wait_until(
                lambda: bool(self._reports) or self._fatal_unraised, self._env.now() + _timeout(timeout)
            )
        served = self._serve()
        self._env.point("kafka.producer.poll.end", client=self.name)
        return served

    def flush(self, timeout: float | None = None) -> int:
        self._env.point("kafka.producer.flush.begin", client=self.name)
        self._send()
        self._env.wait_until(lambda: self._outstanding() == 0, self._env.now() + _timeout(timeout))
        self._serve()
        self._env.point("kafka.producer.flush.end", client=self.name)
        return self._outstanding()

    def _outstanding(self) -> int:
        if self._queue and not self._frozen:
            self._send()
        return len(self._queue) + len(self._in_flight)

    def __len__(self) -> int:
        return self._outstanding() + len(self._reports)

    def list_topics(self, topic: str | None = None, timeout: float = -1):
        return cluster_metadata(self._cluster, topic, timeout)

    # ----- transactions ------------------------------------------------------------------------------

    def _check(self, allowed: tuple[str, ...], resume: str | None = None) -> None:
        if self._tid is None:
            errors.raise_(errors.error(KafkaError._NOT_CONFIGURED, "The Transactional API requires transactional.id"))
        if self._state == FATAL:
            errors.raise_(self._fatal)
        if self._op is not None and self._op[0] == resume:
            return
        if self._state == ABORTABLE and resume != "abort":
            errors.raise_(self._abortable)
        if self._state not in allowed:
            errors.raise_(errors.bad_state(self._state))

    def _await(self, name: str, request: Request, timeout: float | None) -> Any:
        """Wait for the op's request; on timeout it stays the op in progress, resumed by the next call."""
        self._op = (name, request)
        if not request.landed:
            self._env.wait_until(lambda: request.landed, self._env.now() + _timeout(timeout))
        if not request.landed:
            errors.raise_(errors.txn_timed_out())
        self._op = None
        return request

    def _resume(self, name: str) -> Request | None:
        return self._op[1] if self._op is not None and self._op[0] == name else None

    def init_transactions(self, timeout: float | None = None) -> None:
        self._env.point("kafka.producer.init_transactions.begin", client=self.name)
        self._check((INIT,), resume="init")
        request = self._resume("init")
        if request is None:
            tid, ms = self._tid, self._txn_timeout_ms
            request = self._request("kafka.broker.init_producer_id", lambda: self._cluster.txn.init_producer(tid, ms))
            self._cluster.send(request)
        self._await("init", request, timeout)
        self._pid, self._epoch = request.reply()
        self._state = READY
        self._env.point("kafka.producer.init_transactions.end", client=self.name)

    def begin_transaction(self) -> None:
        self._env.point("kafka.producer.begin_transaction.begin", client=self.name)
        self._check((READY,))
        self._state, self._txn_partitions, self._txn_offsets, self._txn_failed = IN_TXN, set(), False, 0
        self._env.point("kafka.producer.begin_transaction.end", client=self.name)

    def send_offsets_to_transaction(self, positions: list[TopicPartition], group_metadata: GroupMetadata,
                                    timeout: float | None = None) -> None:  # fmt: skip
        self._env.point("kafka.producer.send_offsets_to_transaction.begin", client=self.name)
        self._check((IN_TXN,), resume="send_offsets")
        request = self._resume("send_offsets")
        if request is None:
            tid, pid, epoch, md = self._tid, self._pid, self._epoch, group_metadata
            offsets = [((tp.topic, tp.partition), tp.offset, tp.metadata) for tp in positions]

            def apply() -> None:
                with self._cluster.lock:
                    self._cluster.txn.add_offsets(tid, pid, epoch, md.group_id)
                    self._cluster.groups.txn_commit(md.group_id, pid, md, offsets)

            request = self._request("kafka.broker.txn_offset_commit", apply, group=md.group_id)
            self._txn_offsets = True
            self._cluster.send(request)
        self._await("send_offsets", request, timeout)
        if isinstance(request.error, Fenced):
            self._fail_fatal(errors.fenced("Failed to add offsets to transaction"))
            self._fatal_unraised = False
            errors.raise_(self._fatal)
        if isinstance(request.error, GroupRefused):
            self._state = ABORTABLE
            self._abortable = errors.offset_commit_refused(request.error.code, errors.GROUP_TEXT[request.error.code])
            errors.raise_(self._abortable)
        request.reply()
        self._env.point("kafka.producer.send_offsets_to_transaction.end", client=self.name)

    def commit_transaction(self, timeout: float | None = None) -> None:
        self._env.point("kafka.producer.commit_transaction.begin", client=self.name)
        self._end(True, timeout)
        self._env.point("kafka.producer.commit_transaction.end", client=self.name)

    def abort_transaction(self, timeout: float | None = None) -> None:
        self._env.point("kafka.producer.abort_transaction.begin", client=self.name)
        self._end(False, timeout)
        self._env.point("kafka.producer.abort_transaction.end", client=self.name)

    def _end(self, commit: bool, timeout: float | None) -> None:
        name = "commit" if commit else "abort"
        self._check((IN_TXN,) if commit else (IN_TXN, ABORTABLE), resume=name)
        deadline = self._env.now() + _timeout(timeout)
        request = self._resume(name)
        if request is None:
            if commit:
                self._send()
                self._env.wait_until(lambda: self._outstanding() == 0 or self._state == FATAL, deadline)
                if self._state == FATAL:
                    self._fatal_unraised = False
                    errors.raise_(self._fatal)
                if self._outstanding():
                    errors.raise_(errors.txn_timed_out())
                if self._txn_failed:
                    self._state = ABORTABLE
                    self._abortable = errors.error(
                        KafkaError._INCONSISTENT, f"{self._txn_failed} message(s) failed delivery", abortable=True
                    )
                    errors.raise_(self._abortable)
            else:
                for rec in list(self._queue):
                    self._queue.remove(rec)
                    self._report(rec, errors.purged())
                self._env.wait_until(lambda: not self._in_flight, deadline)
            if not self._txn_partitions and not self._txn_offsets:
                # Nothing registered with the coordinator: the transaction ends here, no request sent.
                self._state, self._abortable = READY, None
                return
            tid, pid, epoch = self._tid, self._pid, self._epoch
            request = self._request("kafka.broker.end_txn", lambda: self._cluster.txn.end(tid, pid, epoch, commit))
            self._cluster.send(request)
        self._await(name, request, max(0.0, deadline - self._env.now()))
        if isinstance(request.error, Fenced):
            self._fail_fatal(errors.fenced("Failed to end transaction"))
            self._fatal_unraised = False
            errors.raise_(self._fatal)
        request.reply()
        self._state, self._abortable, self._txn_partitions = READY, None, set()

    # ----- the process ---------------------------------------------------------------------------------

    def _sim_frozen(self) -> None:
        self._frozen = True

    def _sim_thawed(self) -> None:
        self._frozen = False
        self._send()

    def _sim_broker_up(self) -> None:
        self._send()
