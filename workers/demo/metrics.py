"""The demo's Prometheus endpoints (`rlstream demo --metrics-port P`): the trainer's in this process, each
reassembler actor's in its own, and TQ's own exporter in its controller; all logged with a ready
`rlstream top` command line, and kept in the report."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence

from workers.topics import TopicNames


def trainer_metrics(port: int, prefix: str) -> tuple[object, str]:
    """The trainer's sensor and its `/metrics` URL, served from this process on `port` (0: a free one)."""
    import ray

    from workers.telemetry.prometheus import PrometheusTrainerSensor, start_metrics_server

    bound = start_metrics_server(port)
    return PrometheusTrainerSensor(prefix=prefix), _url(f"{ray.util.get_node_ip_address()}:{bound}")


def tq_metrics(port: int) -> str:
    """TQ's exporter, started in its controller unless it runs already (then wherever it runs)."""
    from streams.tq import start_tq_metrics

    return _url(start_tq_metrics(port))


def actor_metrics(actors: Sequence[object]) -> list[str]:
    import ray

    return [_url(e) for e in ray.get([a.metrics_endpoint.remote() for a in actors]) if e]


def announce(
    endpoints: dict[str, object],
    *,
    bootstrap_servers: str,
    names: TopicNames,
    consumer_group: str | None,
    log: Callable[[str], None],
) -> None:
    """Log every endpoint, and the `rlstream top` command that watches this run."""
    urls = [endpoints["trainer"], *endpoints.get("reassemblers", []), endpoints["tq"]]
    reassemblers = ", ".join(endpoints.get("reassemblers", [])) or "none (external)"
    log(f"metrics: trainer {endpoints['trainer']}, reassemblers {reassemblers}, TQ {endpoints['tq']}")
    args = ["rlstream", "top", "--bootstrap-servers", bootstrap_servers, "--prefix", names.prefix]
    if consumer_group:
        args += ["--consumer-group", consumer_group]
    for url in urls:
        args += ["--metrics", str(url)]
    log(f"watch it: {shlex.join(args)}")


def _url(host_port: str) -> str:
    return f"http://{host_port}/metrics"
