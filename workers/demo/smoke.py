"""A one-minute check that a machine can run rlstream: broker and TQ up, one message and one tensor batch round-trip."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tensordict import TensorDict

from schemas.errors import InvalidArgument
from streams.admin import TopicSpec, create_topics
from streams.broker import BrokerConfig, LocalBroker
from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.producer import AckedProducer, Outgoing
from streams.tq import STAGING, TQConfig, TQStore, init_tq
from workers.demo.errors import SmokeFailed


@dataclass(frozen=True)
class SmokeResult:
    bootstrap_servers: str
    message_bytes: int
    tensor_rows: int
    seconds: float


def run_smoke(
    bootstrap_servers: str | None = None,
    *,
    client_settings: Mapping[str, str] | None = None,
    log: Callable[[str], None] | None = None,
) -> SmokeResult:
    """Start (or use) a broker and TQ, round-trip a receipt-sized message and a jagged tensor batch, stop.

    `client_settings` (SASL, TLS, ...) are for a given cluster; the broker smoke starts is plaintext.
    `log` receives the status lines (default: the `rlstream.smoke` logger).
    """
    if client_settings and bootstrap_servers is None:
        raise InvalidArgument("client settings need a cluster to use them: the broker smoke starts is plaintext")
    log = log if log is not None else logging.getLogger("rlstream.smoke").info
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlstream-smoke-") as tmp:
        broker = None
        if bootstrap_servers is None:
            broker = LocalBroker(BrokerConfig(data_dir=Path(tmp)), log=log).start()
            bootstrap_servers = broker.bootstrap_servers
        log(f"broker: bootstrap.servers={bootstrap_servers}")
        session = init_tq(TQConfig())
        try:
            kafka = KafkaConfig(bootstrap_servers, dict(client_settings or {}))
            topic = f"smoke.{uuid.uuid4().hex[:8]}"
            create_topics(kafka, [TopicSpec(topic, 1)])
            payload = os.urandom(600)
            AckedProducer(kafka).send([Outgoing(topic, b"group-0", payload)])
            got = [r.value for r in read_topic(kafka, topic)]
            if got != [payload]:
                raise SmokeFailed(f"Kafka round trip on {topic} returned {len(got)} record(s), not the one sent")
            log(f"kafka: {len(payload)}-byte message round-tripped through {topic}")

            rows = [torch.arange(n, dtype=torch.int64) for n in (5, 17, 3)]
            store = TQStore()
            keys = [f"smoke-{uuid.uuid4().hex[:8]}/{i}" for i in range(len(rows))]
            store.put(
                STAGING,
                keys,
                TensorDict(
                    {"token_ids": torch.nested.nested_tensor(rows, layout=torch.jagged)}, batch_size=[len(rows)]
                ),
                [{"row": i} for i in range(len(rows))],
            )
            back = store.get(STAGING, keys)["token_ids"].unbind()
            if not all(torch.equal(a, b) for a, b in zip(rows, back)):
                raise SmokeFailed("TQ round trip returned different tensors")
            store.clear(STAGING, keys)
            log(f"tq: {len(rows)} jagged rows round-tripped through partition {STAGING!r}")
        finally:
            session.close()
            if broker is not None:
                broker.stop()
                log("broker stopped")
    return SmokeResult(bootstrap_servers, len(payload), len(rows), time.monotonic() - t0)


if __name__ == "__main__":
    from workers.telemetry.logs import configure_logging

    configure_logging()
    res = run_smoke()
    print(f"ok in {res.seconds:.1f}s", file=sys.stderr)
