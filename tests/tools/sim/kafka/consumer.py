"""confluent-kafka's `Consumer`: subscribe or assign, consume, positions, offsets, watermarks, metadata.

Fetching reads the partition logs directly (prefetched, as it were: while the broker is down a
consumer still returns what the log held; librdkafka's prefetch is bounded, the model's is not):
a read_committed consumer up to the last stable offset,
a read_uncommitted one up to the high watermark, its position moving past markers and aborted
records (so `position()` passes them though no record is returned). A partition assigned without
an offset starts from the group's committed offset (waiting, read_committed, while a transaction
holds offsets for it), else by `auto.offset.reset`; an offset outside the log is reset the same
way. `position()` is the offset after the last record returned, -1001 before any (and after a
seek). Paused partitions stay paused across unassign and assign, as librdkafka keeps them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaError, TopicPartition

from tests.tools.sim.env import Request
from tests.tools.sim.kafka import errors
from tests.tools.sim.kafka.assignors import TP
from tests.tools.sim.kafka.group import GroupRefused, Unstable
from tests.tools.sim.kafka.membership import Membership
from tests.tools.sim.kafka.messages import (
    ClusterMetadata,
    GroupMetadata,
    Message,
    cluster_metadata,
    error_event,
    topic_partition,
)

if TYPE_CHECKING:
    from tests.tools.sim.kafka.cluster import KafkaCluster

OFFSET_INVALID, OFFSET_STORED = -1001, -1000
# librdkafka's socket.timeout.ms: how long a request waits for its answer before it is given up.
SOCKET_TIMEOUT_S = 60.0
# Settings whose behaviour is not modelled, with librdkafka's default: the model refuses them on.
_UNMODELLED = {"enable.auto.commit": True, "enable.partition.eof": False}


def _deadline(env, timeout: float | None) -> float:
    return math.inf if timeout is None or timeout < 0 else env.now() + timeout


@dataclass
class _Fetch:
    # The next offset to fetch; OFFSET_INVALID/OFFSET_STORED: from the committed offset, else the reset policy.
    offset: int
    app_offset: int = OFFSET_INVALID


class Consumer:
    def __init__(self, conf: dict[str, Any], *, cluster: KafkaCluster, process: str):
        for key, default in _UNMODELLED.items():
            if str(conf.get(key, default)).lower() == "true":
                raise NotImplementedError(f"the Kafka model does not model {key}=true; set it false")
        self._cluster, self._env, self._process = cluster, cluster.env, process
        self._conf = dict(conf)
        self.group_id: str = conf.get("group.id", "")
        self.name = conf.get("client.id") or cluster.client_name("consumer")
        self._read_committed = conf.get("isolation.level", "read_committed") == "read_committed"
        self._reset = str(conf.get("auto.offset.reset", "latest"))
        self._assignment: dict[TP, _Fetch] = {}
        self._paused: set[TP] = set()
        self._watermarks: dict[TP, tuple[int, int]] = {}
        self._membership: Membership | None = None
        self._callbacks: dict[str, Any] = {}
        self._closed = False
        self._frozen = False
        self._assigned_in_callback = False
        cluster.process(process).clients.append(self)

    # ----- group membership ----------------------------------------------------------------------------

    def subscribe(self, topics: list[str], on_assign=None, on_revoke=None, on_lost=None) -> None:
        self._live()
        self._callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}
        self._membership = Membership(self, topics, self._conf)
        for topic in topics:
            if topic not in self._cluster.topics:
                self._membership.events.append(("error", errors.unknown_topic(topic), topic, 0))
        self._membership.join()

    def memberid(self) -> str | None:
        m = self._membership
        member = None if m is None else m.member or m.gone
        return member.member_id if member is not None else None

    def consumer_group_metadata(self) -> GroupMetadata:
        m = self._membership
        instance = self._conf.get("group.instance.id")  # as librdkafka: the configured one, member or not
        if m is None:
            return GroupMetadata(self.group_id, -1, "", instance)
        if m.member is not None:
            return GroupMetadata(self.group_id, m.generation, m.member.member_id, m.instance_id)
        if m.gone is not None:  # removed, not told yet
            return GroupMetadata(self.group_id, m.gone.generation, m.gone.member_id, instance)
        return GroupMetadata(self.group_id, m.last_generation, "", instance)

    def _serve_events(self) -> list[Message]:
        """Run the rebalance callbacks due; return the error events, as messages."""
        m = self._membership
        out: list[Message] = []
        while m is not None and m.events:
            event = m.events.popleft()
            kind = event[0]
            if kind == "error":
                out.append(error_event(event[1], *event[2:]))
            elif kind == "fenced":
                self._assignment.clear()
                out.append(error_event(errors.static_fenced()))
            elif kind == "revoke_all":
                self._rebalance("revoke", set(self._assignment), incremental=False)
                m.revoked_all()
            elif kind == "sync":
                _, _, added, revoke = event
                if m.cooperative:
                    if revoke:
                        self._rebalance("revoke", revoke, incremental=True)
                        m.revoked(revoke)
                    self._rebalance("assign", added, incremental=True)
                else:
                    self._rebalance("assign", added, incremental=False)
            elif kind == "lost":
                held = set(self._assignment)
                if held:
                    self._rebalance(
                        "lost" if self._callbacks.get("lost") else "revoke", held, incremental=m.cooperative
                    )
            elif kind == "rejoin":
                m.join()
        return out

    def _rebalance(self, kind: str, tps: set[TP], *, incremental: bool) -> None:
        """A rebalance callback, then what librdkafka does if the callback did not (un)assign itself."""
        cb = self._callbacks.get(kind)
        parts = [TopicPartition(t, p) for t, p in sorted(tps)]
        self._assigned_in_callback = False
        if cb is not None:
            cb(self, parts)
        if self._assigned_in_callback:
            return
        if kind == "assign":
            self.incremental_assign(parts) if incremental else self.assign(parts)
        elif incremental:
            self.incremental_unassign(parts)
        else:
            self.unassign()

    def unsubscribe(self) -> None:
        self._live()
        if self._membership is not None:
            if self._assignment:
                self._rebalance("revoke", set(self._assignment), incremental=self._membership.cooperative)
            self._membership.leave()
            self._membership = None

    def close(self) -> None:
        if self._closed:
            return
        m = self._membership
        if m is not None and not m.dead:
            if self._assignment:
                self._rebalance("revoke", set(self._assignment), incremental=m.cooperative)
            if m.member is not None and m.instance_id is None:
                m.leave()
            elif m.member is not None:
                member_id = m.member.member_id
                with self._cluster.lock:
                    self._cluster.groups.silent(
                        self.group_id, member_id
                    )  # a static member stays until its session ends
        self._closed = True

    # ----- assignment ------------------------------------------------------------------------------------

    def assign(self, partitions: list[TopicPartition]) -> None:
        self._live()
        self._assigned_in_callback = True
        self._assignment = {(tp.topic, tp.partition): _Fetch(tp.offset) for tp in partitions}

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        self._live()
        self._assigned_in_callback = True
        for tp in partitions:
            self._assignment[(tp.topic, tp.partition)] = _Fetch(tp.offset)

    def incremental_unassign(self, partitions: list[TopicPartition]) -> None:
        self._live()
        self._assigned_in_callback = True
        for tp in partitions:
            self._assignment.pop((tp.topic, tp.partition), None)

    def unassign(self) -> None:
        self._live()
        self._assigned_in_callback = True
        self._assignment = {}

    def assignment(self) -> list[TopicPartition]:
        self._live()
        return [TopicPartition(t, p, OFFSET_STORED) for t, p in sorted(self._assignment)]

    def pause(self, partitions: list[TopicPartition]) -> None:
        self._paused |= {(tp.topic, tp.partition) for tp in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self._paused -= {(tp.topic, tp.partition) for tp in partitions}

    def seek(self, partition: TopicPartition) -> None:
        self._live()
        tp = (partition.topic, partition.partition)
        if tp not in self._assignment:
            errors.raise_(
                errors.error(KafkaError._STATE, f"Failed to seek to offset {partition.offset}: Local: Erroneous state")
            )
        self._assignment[tp] = _Fetch(partition.offset)

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        self._live()
        out = []
        for tp in partitions:
            f = self._assignment.get((tp.topic, tp.partition))
            out.append(TopicPartition(tp.topic, tp.partition, f.app_offset if f is not None else OFFSET_INVALID))
        return out

    # ----- consuming --------------------------------------------------------------------------------------

    def consume(self, num_messages: int = 1, timeout: float | None = -1) -> list[Message]:
        self._live()
        self._env.point("kafka.consumer.consume.begin", client=self.name)
        deadline = _deadline(self._env, timeout)
        if self._membership is not None:
            self._membership.polled()
        while True:
            out = self._serve_events()
            out += self._fetch(num_messages - len(out))
            if out or self._env.now() >= deadline:
                break
            self._env.wait_until(self._has_work, deadline)
        self._env.point("kafka.consumer.consume.end", client=self.name, records=len(out))
        return out

    def poll(self, timeout: float | None = None) -> Message | None:
        got = self.consume(1, -1 if timeout is None else timeout)
        return got[0] if got else None

    def _has_work(self) -> bool:
        if self._membership is not None and self._membership.events:
            return True
        with self._cluster.lock:
            for tp in self._fetchable():
                start = self._start(tp)
                if start is not None and self._cluster.log(*tp).read(start, self._read_committed, 1)[0]:
                    return True
        return False

    def _fetchable(self) -> list[TP]:
        return [tp for tp in self._assignment if tp not in self._paused and self._cluster.has_partition(*tp)]

    def _start(self, tp: TP) -> int | None:
        """Where the next fetch of `tp` starts (resolved and kept); None while it cannot be known yet."""
        f = self._assignment[tp]
        log = self._cluster.log(*tp)
        offset = f.offset
        if offset in (OFFSET_INVALID, OFFSET_STORED):
            if not self._cluster.broker_up:
                return None  # the committed offset cannot be fetched
            try:
                offset = self._cluster.groups.fetch(self.group_id, [tp], self._read_committed)[tp][0]
            except Unstable:
                return None
            if offset < 0:
                offset = self._reset_offset(log)
        elif offset == OFFSET_BEGINNING:
            offset = log.log_start
        elif offset == OFFSET_END:
            offset = log.high(self._read_committed)
        if offset < log.log_start or offset > log.end_offset:
            offset = self._reset_offset(log)
        f.offset = offset
        return offset

    def _reset_offset(self, log) -> int:
        if self._reset in ("earliest", "smallest", "beginning"):
            return log.log_start
        return log.high(self._read_committed)

    def _fetch(self, n: int) -> list[Message]:
        # While the broker is down the log cannot change: what is read is what was prefetched.
        if n <= 0:
            return []
        out: list[Message] = []
        with self._cluster.lock:
            for tp in sorted(self._fetchable()):
                if len(out) >= n:
                    break
                start = self._start(tp)
                if start is None:
                    continue
                log = self._cluster.log(*tp)
                entries, position = log.read(start, self._read_committed, n - len(out))
                f = self._assignment[tp]
                f.offset = position
                self._watermarks[tp] = (log.log_start, log.end_offset)
                for e in entries:
                    out.append(Message(tp[0], tp[1], e.offset, e.key, e.value, e.headers, e.timestamp_ms))
                if entries or position > start:
                    f.app_offset = position
        return out

    # ----- offsets ---------------------------------------------------------------------------------------

    def committed(self, partitions: list[TopicPartition], timeout: float | None = -1) -> list[TopicPartition]:
        self._live()
        self._env.point("kafka.consumer.committed.begin", client=self.name)
        tps = [(tp.topic, tp.partition) for tp in partitions]
        deadline = _deadline(self._env, timeout)

        def stable() -> bool:
            if not self._cluster.broker_up:
                return False
            return not (self._read_committed and self._cluster.groups.has_pending(self.group_id, tps))

        if not self._env.wait_until(stable, deadline):
            errors.raise_(errors.committed_timed_out())
        with self._cluster.lock:
            found = self._cluster.groups.fetch(self.group_id, tps, require_stable=False)
        self._env.point("kafka.consumer.committed.end", client=self.name)
        return [topic_partition(t, p, *found[(t, p)]) for t, p in tps]

    def commit(self, message: Message | None = None, offsets: list[TopicPartition] | None = None,
               asynchronous: bool = True) -> list[TopicPartition] | None:  # fmt: skip
        self._live()
        self._env.point("kafka.consumer.commit.begin", client=self.name)
        if offsets is None and message is not None:
            offsets = [TopicPartition(message.topic(), message.partition(), message.offset() + 1)]
        if offsets is None:
            offsets = [TopicPartition(t, p, f.app_offset) for (t, p), f in sorted(self._assignment.items())
                       if f.app_offset >= 0]  # fmt: skip
        m = self._membership
        md = self.consumer_group_metadata()
        coordinator_wait = m.session_timeout_ms / 1000 if m is not None else 6.0
        if not self._env.wait_until(lambda: self._cluster.broker_up, self._env.now() + coordinator_wait):
            if asynchronous:
                return None
            errors.raise_(errors.wait_coordinator())
        entries = [((tp.topic, tp.partition), tp.offset, tp.metadata) for tp in offsets]

        def apply() -> None:
            with self._cluster.lock:
                self._cluster.groups.commit(self.group_id, md.member_id, md.generation, md.instance_id, entries)

        request = Request("kafka.broker.offset_commit", apply, client=self.name, process=self._process,
                          group=self.group_id)  # fmt: skip
        self._cluster.send(request)
        if asynchronous:
            return None  # it lands when it lands; its errors go to an on_commit callback, not modelled
        if not self._env.wait_until(lambda: request.landed, self._env.now() + SOCKET_TIMEOUT_S):
            # librdkafka gives up on the request; the broker may still apply it.
            errors.raise_(errors.error(KafkaError._TIMED_OUT, "Commit failed: Local: Timed out"))
        if isinstance(request.error, GroupRefused):
            errors.raise_(errors.commit_refused(request.error.code))
        request.reply()
        self._env.point("kafka.consumer.commit.end", client=self.name)
        return [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets]

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:  # fmt: skip
        self._live()
        tp = (partition.topic, partition.partition)
        if cached:
            return self._watermarks.get(tp, (OFFSET_INVALID, OFFSET_INVALID))
        if not self._cluster.broker_up or not self._cluster.has_partition(*tp):
            errors.raise_(errors.unknown_partition("Failed to get watermark offsets"))
        with self._cluster.lock:
            log = self._cluster.log(*tp)
            return log.log_start, log.high(self._read_committed)

    def offsets_for_times(self, partitions: list[TopicPartition], timeout: float | None = None) -> list[TopicPartition]:
        self._live()
        with self._cluster.lock:
            return [
                TopicPartition(
                    tp.topic, tp.partition, self._cluster.log(tp.topic, tp.partition).offset_for_time(tp.offset)
                )
                for tp in partitions
            ]

    def list_topics(self, topic: str | None = None, timeout: float | None = -1) -> ClusterMetadata:
        self._live()
        return cluster_metadata(self._cluster, topic, timeout)

    # ----- the process -----------------------------------------------------------------------------------

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError("Consumer closed")

    def _sim_frozen(self) -> None:
        self._frozen = True
        if self._membership is not None:
            self._membership.frozen()

    def _sim_thawed(self) -> None:
        self._frozen = False
        if self._membership is not None and not self._closed:
            self._membership.thawed()
