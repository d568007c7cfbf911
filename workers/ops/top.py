"""`rlstream top`: a run's figures, read from the cluster and the metrics endpoints, redrawn every second.

`TopSource.snapshot()` gathers one `Snapshot` (`workers.ops.top_view`): committed versus end offsets
per partition of the reassemblers on the receipts topic and of the trainer on the finalized topic
(one admin client for the whole session), the latest record of each trainer on the version topic
(one consumer assigned to it, joining no group), and every metrics endpoint given (scraped at once).
Nothing it reads can stop it: a broker or endpoint that does not answer becomes that figure's
reason on the screen. `run_top` redraws until Ctrl-C or SIGTERM and restores the terminal.
"""

from __future__ import annotations

import math
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TextIO

from confluent_kafka import OFFSET_BEGINNING, Consumer, ConsumerGroupTopicPartitions, IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from schemas.errors import SchemaError
from schemas.trainer_version import TrainerVersion
from streams.config import KafkaConfig
from workers.ops.scrape import Figures, metrics_url, scrape_all
from workers.ops.top_view import Endpoint, Metrics, PartitionLag, Snapshot, TrainerState, render
from workers.topics import TopicNames

# Every Kafka request of one refresh gives up after this long, so a dead broker slows the screen, never stops it.
REQUEST_TIMEOUT_S = 2.0
METADATA_EVERY_S = 10.0


def _short(exc: BaseException) -> str:
    text = str(exc.args[0] if getattr(exc, "args", None) else exc)
    return text.splitlines()[0][:160] if text else type(exc).__name__


def metrics_of(figures: Figures) -> Metrics:
    """The figures `rlstream top` shows, out of what the endpoints report (see workers/telemetry/prometheus.py)."""
    buckets = figures.by("rlstream_trainer_staleness_versions_bucket", "le")
    return Metrics(
        receipts_consumed=figures.total("rlstream_receipts_consumed_total"),
        groups_finalized=figures.total("rlstream_groups_finalized_total"),
        groups_trained=figures.total("rlstream_trainer_yielded_groups_total"),
        evicted=figures.total("rlstream_trainer_evicted_groups_total"),
        dead_letters=figures.by("rlstream_dead_letters_total", "reason"),
        trainer_undecodable=figures.total("rlstream_trainer_undecodable_records_total"),
        trainer_missing_rows=figures.total("rlstream_trainer_missing_rows_total"),
        staleness=None if buckets is None else {float(le): n for le, n in buckets.items()},
        trainer_version=figures.largest("rlstream_trainer_version"),
        tq_rows=figures.by("tq_partition_samples_total", "partition_id", combine=max),
        open_groups=figures.total("rlstream_open_groups"),
        paused=figures.total("rlstream_fetch_paused"),
        aborts=figures.total("rlstream_transaction_aborts_total"),
        fences=figures.total("rlstream_reassembler_fenced_total"),
        pool_restarts=figures.total("rlstream_pool_worker_restarts_total"),
        pool_fenced_exits=figures.total("rlstream_pool_worker_exits_total", how="fenced"),
    )


class TopSource:
    """One run's figures: Kafka offsets and the version topic of `names`, and the metrics `endpoints`."""

    def __init__(
        self,
        kafka: KafkaConfig,
        names: TopicNames,
        *,
        consumer_group: str,
        trainer_consumer_group: str | None,
        endpoints: Sequence[str] = (),
        scrape_timeout_s: float = 0.8,
    ) -> None:
        self.kafka, self.names = kafka, names
        self.consumer_group = consumer_group
        self.trainer_consumer_group = trainer_consumer_group  # None: the one the version topic names
        self.endpoints = [metrics_url(e) for e in endpoints]
        self.scrape_timeout_s = scrape_timeout_s
        self._admin = AdminClient(kafka.admin())
        self._versions = Consumer(kafka.consumer(f"rlstream-top-{uuid.uuid4().hex[:12]}", read_committed=True))
        self._version_assigned = False
        self._trainers: dict[str, TrainerState] = {}
        self._partitions: dict[str, list[int]] = {}
        self._metadata_at = -math.inf

    def _refresh_metadata(self) -> None:
        if time.monotonic() - self._metadata_at < METADATA_EVERY_S and self._partitions:
            return
        md = self._admin.list_topics(timeout=REQUEST_TIMEOUT_S).topics
        self._admin.poll(0)
        topics = (self.names.receipts, self.names.finalized, self.names.trainer_version)
        self._partitions = {t: sorted(md[t].partitions) for t in topics if t in md and md[t].error is None}
        self._metadata_at = time.monotonic()

    def _ends(self, topics: Sequence[str]) -> dict[str, dict[int, int]]:
        want = {TopicPartition(t, p): OffsetSpec.latest() for t in topics for p in self._partitions.get(t, ())}
        if not want:
            return {}
        futures = self._admin.list_offsets(
            want, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=REQUEST_TIMEOUT_S
        )
        ends: dict[str, dict[int, int]] = {}
        for tp, future in futures.items():
            ends.setdefault(tp.topic, {})[tp.partition] = future.result(timeout=REQUEST_TIMEOUT_S + 1).offset
        return ends

    def _committed(self, group: str, topic: str) -> dict[int, int]:
        request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in self._partitions[topic]])
        futures = self._admin.list_consumer_group_offsets([request], request_timeout=REQUEST_TIMEOUT_S)
        result = futures[group].result(timeout=REQUEST_TIMEOUT_S + 1)
        return {tp.partition: tp.offset for tp in result.topic_partitions if tp.error is None}

    def _read_versions(self) -> None:
        """New records of the version topic; the first time, all of it up to its end (it is compacted: small)."""
        topic = self.names.trainer_version
        behind: dict[int, int] = {}
        if not self._version_assigned:
            if topic not in self._partitions:
                return
            behind = {p: end for p, end in self._ends([topic]).get(topic, {}).items() if end > 0}
            self._versions.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in self._partitions[topic]])
            self._version_assigned = True
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while True:
            for msg in self._versions.consume(1000, timeout=0.05):
                if msg.error() is not None:
                    continue
                if msg.offset() + 1 >= behind.get(msg.partition(), 0):
                    behind.pop(msg.partition(), None)
                self._apply_version(msg.value())
            if not behind or time.monotonic() > deadline:
                return

    def _apply_version(self, value: bytes | None) -> None:
        try:
            v = TrainerVersion.from_bytes(value or b"")
        except SchemaError:
            return
        self._trainers[v.trainer_id] = TrainerState(
            v.trainer_id, v.consumer_group, v.version, v.batch_groups, v.lost_groups, v.time_ms
        )

    def _kafka(self) -> dict:
        """Offsets, lags and trainers; raises a Kafka error for the snapshot to show."""
        self._refresh_metadata()
        self._read_versions()
        receipts, finalized = self.names.receipts, self.names.finalized
        ends = self._ends([receipts, finalized])
        lags, errors = [], []
        trainer_group = self.trainer_consumer_group or next(
            (t.consumer_group for t in sorted(self._trainers.values(), key=lambda t: -t.time_ms)), None
        )
        for group, topic in ((self.consumer_group, receipts), (trainer_group, finalized)):
            if topic not in ends:
                errors.append(f"topic {topic} not found")
                continue
            if group is None:
                errors.append(f"no trainer on {self.names.trainer_version} yet: pass --trainer-consumer-group")
                continue
            try:
                committed = self._committed(group, topic)
            except Exception as exc:  # noqa: BLE001 - one group unreadable: show why, keep the rest
                errors.append(f"consumer group {group}: {_short(exc)}")
                continue
            for p, end in sorted(ends[topic].items()):
                c = committed.get(p, -1)
                lags.append(PartitionLag(group, topic, p, c if c >= 0 else None, end, max(0, end - max(c, 0))))
        return {
            "receipts_end": sum(ends[receipts].values()) if receipts in ends else None,
            "lags": tuple(lags),
            "lag_errors": tuple(errors),
        }

    def snapshot(self) -> Snapshot:
        scrapes = scrape_all(self.endpoints, timeout_s=self.scrape_timeout_s)
        try:
            kafka, kafka_error = self._kafka(), None
        except Exception as exc:  # noqa: BLE001 - a broker away is a figure to show, not a reason to stop
            kafka, kafka_error = {}, _short(exc)
        return Snapshot(
            at=time.time(),
            prefix=self.names.prefix,
            bootstrap_servers=self.kafka.bootstrap_servers,
            kafka_error=kafka_error,
            trainers=tuple(sorted(self._trainers.values(), key=lambda t: t.trainer_id)),
            endpoints=tuple(Endpoint(s.url, s.error) for s in scrapes),
            metrics=metrics_of(Figures(scrapes, self.names.prefix)),
            **kafka,
        )

    def close(self) -> None:
        try:
            self._versions.close()
        except RuntimeError:
            pass  # closed already


HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def run_top(
    source: TopSource,
    out: TextIO,
    *,
    interval_s: float = 1.0,
    once: bool = False,
    stop: threading.Event | None = None,
) -> int:
    """Redraw `source`'s figures on `out` every `interval_s` until Ctrl-C, SIGTERM or `stop`; with `once`,
    print one screen as plain lines and return. Returns 0: quitting is how it ends.

    Ctrl-C marks a flag rather than raising: a KeyboardInterrupt raised inside a librdkafka callback (its
    log lines reach Python from within a blocking call) would be swallowed there, and the view with it.
    The handler takes no lock: setting `stop` from it deadlocked when the signal landed while this thread
    held the event's own lock inside `stop.wait` (the view froze and never exited, seen under load).
    """
    stop = stop or threading.Event()
    interrupted: list[int] = []
    handled = {}
    if not once and threading.current_thread() is threading.main_thread():
        handled = {sig: signal.signal(sig, lambda *_: interrupted.append(1)) for sig in (signal.SIGINT, signal.SIGTERM)}

    def stopping() -> bool:
        return bool(interrupted) or stop.is_set()

    prev = None
    try:
        if not once:
            out.write(HIDE_CURSOR + HOME + CLEAR_BELOW)
        while not stopping():
            started = time.monotonic()
            snap = source.snapshot()
            lines = render(snap, prev, interval_s=interval_s)
            if once:
                out.write("\n".join(lines) + "\n")
                out.flush()
                return 0
            out.write(HOME + "".join(line + CLEAR_LINE + "\n" for line in lines) + CLEAR_BELOW)
            out.flush()
            prev = snap
            until = started + interval_s
            while not stopping() and time.monotonic() < until:
                time.sleep(min(0.05, max(0.0, until - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        for sig, previous in handled.items():
            signal.signal(sig, previous)
        if not once:
            out.write(SHOW_CURSOR + "\n")
            out.flush()
        source.close()
    return 0
