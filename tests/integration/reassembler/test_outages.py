"""Kafka outages the worker must ride out without ending its process: its receipts topic missing at
start, and its only broker SIGKILLed for more than a minute while a step is in flight."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest

from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.pids import pid_alive, reap
from tests.integration.helpers import dead_letters, drive, finalized_records, publish_groups, setup_topics
from workers.reassembler.config import ReassemblerConfig
from workers.reassembler.worker import ReassemblerWorker
from workers.telemetry.sensors import ReassemblerStats
from workers.topics import TopicNames

WORKER_LOG = "rlstream.reassembler"
# Longer than a producer's init timeout (60 s), so a producer made at the kill fails once and is retried.
OUTAGE_S = 70.0


def _worker(kafka, tq_store, names, stats, worker_id="w0", **kw) -> ReassemblerWorker:
    config = ReassemblerConfig(
        prefix=names.prefix, worker_id=worker_id, consumer_group=f"reassemblers.{names.prefix}", **kw
    )
    return ReassemblerWorker(kafka, tq_store, config, sensor=stats)


def _finalized_ids(kafka, names) -> list[str]:
    return [r.group_id for r in finalized_records(kafka, names)]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == WORKER_LOG and r.levelno == logging.WARNING]


def test_a_worker_started_before_its_receipts_topic_exists_waits_for_it_and_finalizes_exactly_once(
    kafka, tq_store, unique, caplog
):
    caplog.set_level(logging.WARNING, logger=WORKER_LOG)
    names = TopicNames(f"late-{unique}")  # no topics yet (the broker never auto-creates them)
    stats = ReassemblerStats()
    worker = _worker(kafka, tq_store, names, stats)
    try:
        # The missing topic surfaces as a consumer error on poll: logged, never raised.
        drive([worker], lambda: any("consumer error" in w for w in _warnings(caplog)), timeout_s=60, check_every_s=0.2)
        for _ in range(50):  # more polls into the missing topic: still no exception, no new line
            worker.step()
        # One line for the error however often it repeats (a line per error kind a minute).
        missing = [w for w in _warnings(caplog) if "consumer error" in w and names.receipts in w]
        assert len(missing) == 1, _warnings(caplog)
        assert missing[0].startswith("w0: ") and "Unknown topic or partition" in missing[0], missing[0]

        setup_topics(kafka, names.prefix, partitions=2)
        created_at = time.monotonic()
        groups = publish_groups(kafka, tq_store, names, 12)
        drive([worker], lambda: len(_finalized_ids(kafka, names)) >= len(groups), timeout_s=240)
        logging.getLogger(__name__).info("finalized %.1fs after the topics were created", time.monotonic() - created_at)
    finally:
        worker.close()
    # A fresh read_committed read: every group once, none twice, none unknown.
    assert sorted(_finalized_ids(kafka, names)) == sorted(groups)
    assert dead_letters(kafka, names) == []
    assert stats.finalized == len(groups)


class _Stepper(threading.Thread):
    """Makes a worker (which may block: its producer needs the broker), then steps it until told to stop.

    Times every step and keeps what the construction or a step raised, if anything.
    """

    def __init__(self, name: str, make: Callable[[], ReassemblerWorker]):
        super().__init__(name=name, daemon=True)
        self._make = make
        self.worker: ReassemblerWorker | None = None
        self.made_in_s: float | None = None
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self.steps: list[tuple[float, float]] = []  # (start, seconds), monotonic

    def run(self) -> None:
        try:
            t0 = time.monotonic()
            self.worker = self._make()
            self.made_in_s = time.monotonic() - t0
            while not self.halt.is_set():
                t0 = time.monotonic()
                self.worker.step()
                self.steps.append((t0, time.monotonic() - t0))
        except BaseException as exc:  # the test asserts there was none
            self.error = exc

    def check(self, when: str) -> None:
        assert self.error is None, f"{self.name}: raised {when}: {self.error!r}"
        assert self.is_alive(), f"{self.name}: stopped {when}"

    def stop(self) -> None:
        """Let the current step end and close the worker; one stuck against a dead broker is left behind."""
        self.halt.set()
        self.join(timeout=60)
        if self.worker is not None and not self.is_alive():
            self.worker.close()

    def longest_step(self) -> float:
        return max((s for _, s in self.steps), default=0.0)


def _sigkill(broker: LocalBroker) -> None:
    pid = broker.handle.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"broker pid {pid} survived SIGKILL"
        reap(pid)
        time.sleep(0.05)


@pytest.fixture
def private_broker(tmp_path):
    """A broker of this test alone (it gets killed), restartable on the same data directory."""
    data_dir = tmp_path / "kafka"
    brokers = [LocalBroker(BrokerConfig(data_dir=data_dir)).start()]
    try:
        yield data_dir, brokers
    finally:
        for b in brokers:
            b.stop()


# Over two minutes by its nature (the outage must outlast the client's own 60 s timeouts): run by
# `make drills`, not `make test`; the suite keeps the unit tests of the retry and the topic wait.
@pytest.mark.drill
def test_workers_ride_out_a_broker_down_for_over_a_minute_mid_step_and_at_start_and_finalize_exactly_once(
    private_broker, tq_store, unique, caplog
):
    """w0 has a step in flight when the only broker is SIGKILLed: its transaction fails, its recovery
    waits out the outage. w1 is started during the outage (a supervisor restarting a worker): creating
    its producer fails after a minute and is retried. Neither ever raises; every group finalizes once."""
    caplog.set_level(logging.WARNING, logger=WORKER_LOG)
    data_dir, brokers = private_broker
    kafka = KafkaConfig(brokers[0].bootstrap_servers)
    names = setup_topics(kafka, f"outage-{unique}", partitions=2)
    stats0, stats1 = ReassemblerStats(), ReassemblerStats()
    # Small polls, so the second batch is still being read (groups open, receipts prefetched) when
    # the broker dies: the next step's transaction fails and its recovery meets the outage.
    settings = dict(session_timeout_ms=6000, transaction_timeout_ms=10_000, max_poll_records=5)
    w0 = _worker(kafka, tq_store, names, stats0, worker_id="w0", **settings)
    stepper0 = _Stepper("w0", lambda: w0)
    stepper1 = _Stepper("w1", lambda: _worker(kafka, tq_store, names, stats1, worker_id="w1", **settings))
    try:
        groups = publish_groups(kafka, tq_store, names, 10, prefix="first-")
        drive([w0], lambda: len(_finalized_ids(kafka, names)) >= 10, timeout_s=120)
        assert stats0.aborts == 0 and stats0.retries == 0

        groups.update(publish_groups(kafka, tq_store, names, 10, prefix="inflight-"))
        read_before = stats0.receipts
        deadline = time.monotonic() + 60
        while stats0.receipts == read_before:
            assert time.monotonic() < deadline, "w0 read none of the second batch"
            w0.step()
        assert stats0.receipts - read_before < 80, "w0 read the whole second batch before the kill"

        _sigkill(brokers[0])
        killed_at = time.monotonic()
        stepper0.start()
        stepper1.start()
        while time.monotonic() - killed_at < OUTAGE_S:
            stepper0.check("during the outage")
            stepper1.check("during the outage")
            time.sleep(0.5)
        outage = dict(
            w0_aborts=stats0.aborts, w0_retries=stats0.retries, w1_retries=stats1.retries, warnings=_warnings(caplog)
        )

        brokers.append(LocalBroker(BrokerConfig(data_dir=data_dir)).start())
        restarted_at = time.monotonic()
        assert brokers[-1].bootstrap_servers == kafka.bootstrap_servers  # same port: the workers' address holds
        groups.update(publish_groups(kafka, tq_store, names, 10, prefix="after-"))
        deadline = time.monotonic() + 150
        while len(set(_finalized_ids(kafka, names))) < len(groups):
            stepper0.check("after the restart")
            stepper1.check("after the restart")
            assert time.monotonic() < deadline, (
                f"only {len(set(_finalized_ids(kafka, names)))} of {len(groups)} groups finalized "
                f"{time.monotonic() - restarted_at:.0f}s after the restart; worker warnings: {_warnings(caplog)}"
            )
            time.sleep(1.0)
        caught_up_s = time.monotonic() - restarted_at
    finally:
        # A stepper closes its worker; w0 is closed here if the test failed before stepping it in a thread.
        for s in (stepper0, stepper1):
            if s.ident is not None:
                s.stop()
        if stepper0.ident is None:
            w0.close()
    for s in (stepper0, stepper1):
        assert not s.is_alive(), f"{s.name}: its last step did not return"
        assert s.error is None, f"{s.name}: raised {s.error!r}"

    # A fresh read_committed read of the finalized topic: every group of every batch once.
    seen = _finalized_ids(kafka, names)
    duplicates = [g for g, n in Counter(seen).items() if n > 1]
    assert duplicates == [], duplicates
    assert sorted(seen) == sorted(groups)
    assert dead_letters(kafka, names) == []

    # What the outage did: w0's in-flight transaction failed and was aborted (its recovery then waited
    # for the broker inside the client's own timeouts); w1's first producer timed out and was retried.
    warnings = outage["warnings"]
    assert outage["w0_aborts"] >= 1, outage
    assert any(w.startswith("w0: transaction failed (") for w in warnings), warnings
    assert outage["w1_retries"] >= 1, outage
    assert any(w.startswith("w1: producer failed (") and "; retrying in 1s" in w for w in warnings), warnings
    # Only committed steps count: between them the two workers finalized each group once.
    assert stats0.finalized + stats1.finalized == len(groups), (stats0.snapshot(), stats1.snapshot())
    logging.getLogger(__name__).info(
        "outage report: w0 aborts=%d retries=%d, longest step %.1fs; w1 made in %.1fs, retries=%d; "
        "restarted %.1fs after the kill, caught up %.1fs after the restart; worker warnings:\n  %s",
        stats0.aborts,
        stats0.retries,
        stepper0.longest_step(),
        stepper1.made_in_s or -1,
        stats1.retries,
        restarted_at - killed_at,
        caught_up_s,
        "\n  ".join(_warnings(caplog)),
    )
