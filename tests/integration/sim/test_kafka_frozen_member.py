"""A real consumer frozen past its session and woken, before it polls: what the Kafka model claims of it.

The model's side is `tests/unit/tools/sim/test_kafka_model.py`'s `..._keeps_its_generation_...`: the
member id reset once a heartbeat is refused, the generation kept (so the coordinator refuses its
offsets with UNKNOWN_MEMBER_ID, not takes them as a standalone commit), and no new membership
before the application has served the loss. The explorer's seed 154 came from a model that gave
such a member generation -1 instead.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import confluent_kafka as ck
import pytest

from streams.admin import TopicSpec, create_topics

CHILD = Path(__file__).with_name("frozen_member_child.py")


def _line(child: subprocess.Popen, timeout_s: float) -> dict:
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(child.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not got or not got[0]:
        raise AssertionError(f"the member said nothing within {timeout_s:.0f} s (exit {child.poll()})")
    return json.loads(got[0])


def test_a_frozen_member_keeps_its_generation_loses_its_id_and_is_refused_before_it_polls(kafka):
    if kafka.client_settings:
        pytest.skip("the child member speaks plaintext only")
    u = uuid.uuid4().hex[:8]
    topic, group = f"frozen-{u}", f"frozen-{u}"
    create_topics(kafka, [TopicSpec(topic, 2, {})])
    child = subprocess.Popen(
        [sys.executable, str(CHILD), kafka.bootstrap_servers, topic, group], stdout=subprocess.PIPE, text=True
    )
    successor = ck.Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group,
                             "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000})  # fmt: skip
    stop = threading.Event()
    pump = threading.Thread(target=lambda: [successor.poll(0.2) for _ in iter(stop.is_set, True)])
    try:
        joined = _line(child, 90)
        assert joined["joined"] >= 0 and joined["member"]
        child.send_signal(signal.SIGSTOP)
        held: set[int] = set()
        successor.subscribe([topic], on_assign=lambda _, ps: held.update(p.partition for p in ps))
        deadline = time.monotonic() + 60
        while held != {0, 1}:  # past the frozen member's session: the successor holds everything
            assert time.monotonic() < deadline, f"the successor holds only {sorted(held)}"
            successor.poll(0.2)
        child.send_signal(signal.SIGCONT)
        pump.start()  # the successor keeps its membership while the member wakes
        seen = _line(child, 60)
    finally:
        stop.set()
        if pump.is_alive():
            pump.join(10)
        child.send_signal(signal.SIGCONT)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
        successor.close()
    assert seen["member_after"] is None, "the refused heartbeat resets the member id"
    assert seen["generation_after"] == seen["joined"], "the generation is kept"
    assert seen["txn"] == "UNKNOWN_MEMBER_ID"
    assert not any(e[0] in ("lost", "revoke") for e in seen["events_before_poll"])
    assert any(e[0] in ("lost", "revoke") for e in seen["events_after_poll"]), "the poll serves the loss"
