"""`rlstream demo`: the whole pipeline on one machine, with an accounting of every group at the end.

`run_demo` starts (or attaches to) a Kafka broker and Ray with TQ, creates the topics, starts a Ray
pool of reassembler actors, the synthetic producers (`workers.demo.producers`) and the trainer loop
(`workers.demo.trainer_loop`), and stops everything it started, also on Ctrl-C or SIGTERM. The
demo passes only if every produced group is consumed, evicted as stale, or dead-lettered, exactly
once (`workers.demo.report`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping

from streams.admin import create_topics
from streams.config import KafkaConfig
from streams.tq import STAGING, TRAIN, TQConfig, init_tq
from workers.actors.kafka_secrets import NO_FILES, KafkaFiles, check_on_nodes, for_actors
from workers.demo.config import DemoConfig
from workers.demo.local import start_local_broker, stop_all
from workers.demo.producers import SharedState, start_producers
from workers.demo.report import DemoReport, summary_table, write_json
from workers.demo.trainer_loop import TrainerLoop
from workers.telemetry.logs import configure_logging
from workers.telemetry.sensors import TrainerSensor
from workers.topics import TopicNames, pipeline_topics

# The CLI's demo verb imports these from here.
__all__ = ["DemoConfig", "DemoReport", "run_demo", "summary_table", "write_json"]

_log = logging.getLogger("rlstream.demo")


class _Reassemblers:
    """The demo's Ray pool of reassembler actors, one consumer group, each running the worker loop."""

    def __init__(self, kafka: KafkaConfig, names: TopicNames, cfg: DemoConfig, tq: TQConfig, files: KafkaFiles):
        import ray

        from workers.actors.reassembler import DataPlaneConfig, create_rollout_reassembler_actors, start_worker
        from workers.reassembler.config import ReassemblerConfig, default_actor_config

        self._ray = ray
        self.group = f"reassemblers.{names.prefix}"
        self.actors = create_rollout_reassembler_actors(
            DataPlaneConfig(tq=tq, nemo_gym=cfg.nemo_gym),
            default_actor_config(),
            num_workers=cfg.reassemblers,
            node_resource=cfg.placement_resource,
            # Actor i on PORT+1+i: the trainer takes PORT itself.
            metrics_port=None if cfg.metrics_port is None else (cfg.metrics_port + 1 if cfg.metrics_port else 0),
        )
        self.nodes = ray.get([actor.node_id.remote() for actor in self.actors])
        self.cluster_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        # Every actor finds the Kafka secrets on its node before any loop starts: one line if one does not.
        node = for_actors(kafka, files)
        check_on_nodes("reassembler actors", self.actors, [actor.check_kafka.remote(node) for actor in self.actors])
        self.runs = [
            start_worker(
                actor,
                kafka,
                ReassemblerConfig(
                    prefix=names.prefix,
                    worker_id=f"actor-{i}",
                    consumer_group=self.group,
                    group_timeout_s=cfg.group_timeout_s,
                ),
                files,
            )
            for i, actor in enumerate(self.actors)
        ]

    def failure(self) -> str | None:
        """Why a worker loop already ended (they run until stopped), or None while all run."""
        done, _ = self._ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            try:
                self._ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor's error, reported as the demo's problem
                return f"a reassembler actor failed: {type(exc).__name__}: {str(exc).strip()[-500:]}"
            return "a reassembler actor stopped before the demo asked it to"
        return None

    def stop(self) -> list[dict]:
        """Stop every worker loop and the actors; returns each actor's totals and the node it started on."""
        for actor in self.actors:
            actor.stop_worker.remote()
        try:
            totals = self._ray.get(self.runs, timeout=60)
            return [{**t, "node_id": node} for t, node in zip(totals, self.nodes)]
        finally:
            for actor in self.actors:
                self._ray.kill(actor)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_on_sigterm() -> None:
    # After Ray's init, which installs its own SIGTERM handler: a terminated demo must still stop
    # the broker, Ray and the actors it started, exactly as on Ctrl-C.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _start_kafka(
    cfg: DemoConfig, client_settings: Mapping[str, str], cleanups: list, log: Callable[[str], None]
) -> KafkaConfig:
    bootstrap = cfg.bootstrap_servers or start_local_broker(cleanups, log, name="demo")
    log(f"broker: bootstrap.servers={bootstrap}")
    return KafkaConfig(bootstrap, dict(client_settings))


def _start_pipeline(
    kafka: KafkaConfig, names: TopicNames, cfg: DemoConfig, report: DemoReport, cleanups: list, log, files: KafkaFiles
) -> _Reassemblers | None:
    tq = TQConfig(address=cfg.ray_address, storage_node_resource=cfg.placement_resource)
    log(f"starting Ray and TransferQueue (partitions {STAGING!r} and {TRAIN!r}) ...")
    session = init_tq(tq)
    cleanups.append(session.close)
    _stop_on_sigterm()
    create_topics(kafka, pipeline_topics(names, cfg.partitions))
    topics = ", ".join((names.receipts, names.finalized, names.deadletter, names.state))
    log(f"topics: {topics} ({cfg.partitions} partitions)")
    if cfg.external_reassemblers:
        return None
    # Actors attach to the Ray instance this process runs on, started or not.
    pool = _Reassemblers(kafka, names, cfg, TQConfig(address=cfg.ray_address or "auto"), files)

    def stop() -> None:
        report.reassemblers = pool.stop()

    cleanups.append(stop)
    log(
        f"reassemblers: {cfg.reassemblers} Ray actors on {len(set(pool.nodes))} of {pool.cluster_nodes} Ray node(s), "
        f"in consumer group {pool.group}"
    )
    return pool


def _serve_metrics(
    cfg: DemoConfig, names: TopicNames, pool: _Reassemblers | None, report: DemoReport, log
) -> TrainerSensor | None:
    """With `metrics_port`: the trainer's sensor, served here; every endpoint logged and kept in the report."""
    if cfg.metrics_port is None:
        return None
    from workers.demo import metrics

    port = cfg.metrics_port
    sensor, trainer_url = metrics.trainer_metrics(port, names.prefix)
    report.metrics_endpoints = {
        "trainer": trainer_url,
        "reassemblers": metrics.actor_metrics(pool.actors) if pool is not None else [],
        "tq": metrics.tq_metrics(port + 1 + cfg.reassemblers if port else 0),
    }
    metrics.announce(
        report.metrics_endpoints,
        bootstrap_servers=report.bootstrap_servers,
        names=names,
        consumer_group=pool.group if pool is not None else None,
        log=log,
    )
    return sensor


def run_demo(
    cfg: DemoConfig,
    *,
    log: Callable[[str], None] | None = None,
    client_settings: Mapping[str, str] | None = None,
    kafka_files: KafkaFiles = NO_FILES,
) -> DemoReport:
    """Run the pipeline end to end and account for every group; stops everything it started.

    `log` receives the demo's status lines (default: the `rlstream.demo` logger); `client_settings`
    are extra librdkafka settings (SASL, TLS) for an existing cluster. Its reassembler actors read
    the secret ones on their node, from `kafka_files` or the environment (`kafka_secrets`).
    """
    if not logging.getLogger("rlstream").handlers:
        # Run as a program without the CLI: librdkafka's lines still need our format and levels.
        configure_logging()
    log = log if log is not None else _log.info
    report = DemoReport(prefix=cfg.prefix or f"demo-{uuid.uuid4().hex[:8]}")
    names = TopicNames(report.prefix)
    cleanups: list[Callable[[], None]] = []
    stop = threading.Event()
    t_start = time.monotonic()
    try:
        if cfg.nemo_gym:
            from workers.actors.reassembler import check_nemo_gym

            check_nemo_gym()  # before anything starts: one line if NeMo Gym is missing
        kafka = _start_kafka(cfg, client_settings or {}, cleanups, log)
        report.bootstrap_servers = kafka.bootstrap_servers
        pool = _start_pipeline(kafka, names, cfg, report, cleanups, log, kafka_files)
        sensor = _serve_metrics(cfg, names, pool, report, log)
        shared = SharedState()
        trainer = TrainerLoop(kafka, names, cfg, shared, log, sensor=sensor)
        t_stream = time.monotonic()
        producers = start_producers(kafka, names, cfg, shared, stop)
        log(
            f"producers: {cfg.producers} x {cfg.groups // cfg.producers} groups of {cfg.shape.group_size} "
            f"rollouts{' captured by NeMo Gym (NeMo Gym receipts)' if cfg.nemo_gym else ''}; "
            f"trainer: {cfg.policy} policy, staleness bound {cfg.max_staleness}"
        )
        trainer.run(producers, pool.failure if pool is not None else lambda: None)
        stop.set()
        for t in producers:
            t.join(timeout=30)
        trainer.fill(report, time.monotonic() - t_stream)
        report.problems.extend(shared.errors)
    except KeyboardInterrupt:
        report.problems.append("interrupted")
        raise
    finally:
        stop.set()
        stop_all(cleanups, log)
        report.elapsed_s = round(time.monotonic() - t_start, 2)
    # Only a run that got this far filled in the accounting: any failure before it raised.
    report.accounted = not report.problems
    return report
