"""A consumer-group member for test_kafka_frozen_member.py, run as its own process so the test can freeze it.

Joins, says so on stdout, then never polls: once a gap in its own clock shows it was stopped (SIGSTOP)
and woken, it watches its member id and metadata without polling, sends offsets in a transaction with
that metadata, then polls once and reports everything as one JSON line. Arguments: bootstrap servers,
topic, group. Plaintext only (the session broker's): no secret passes through here.
"""

from __future__ import annotations

import json
import struct
import sys
import time

import confluent_kafka as ck


def generation(metadata) -> int:
    raw = bytes(metadata)  # librdkafka's serialized form: b"CGMDv2:" then the generation (int32)
    if raw[:7] != b"CGMDv2:":
        raise SystemExit(f"unknown consumer-group metadata format {raw[:7]!r}")
    return struct.unpack("<i", raw[7:11])[0]


def main() -> None:
    boot, topic, group = sys.argv[1:4]
    events: list = []
    conf = {
        "bootstrap.servers": boot,
        "group.id": group,
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 1000,
        "max.poll.interval.ms": 60000,
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
    }
    c = ck.Consumer(conf)
    c.subscribe(
        [topic],
        on_assign=lambda _, ps: events.append(["assign", [p.partition for p in ps]]),
        on_revoke=lambda _, ps: events.append(["revoke", [p.partition for p in ps]]),
        on_lost=lambda _, ps: events.append(["lost", [p.partition for p in ps]]),
    )
    deadline = time.monotonic() + 60
    while not any(e[0] == "assign" and e[1] for e in events):
        if time.monotonic() > deadline:
            raise SystemExit("never assigned a partition")
        c.poll(0.2)
    producer = ck.Producer({"bootstrap.servers": boot, "transactional.id": f"frozen-{group}"})
    producer.init_transactions(30)
    joined = generation(c.consumer_group_metadata())
    print(json.dumps({"joined": joined, "member": c.memberid()}), flush=True)
    last = time.monotonic()
    while True:  # no poll from here on: wait to be frozen and woken
        time.sleep(0.1)
        now = time.monotonic()
        if now - last > 4.0:
            break
        last = now
    until = time.monotonic() + 10  # the first heartbeat after waking tells it it was removed
    while c.memberid() and time.monotonic() < until:
        time.sleep(0.1)
    metadata = c.consumer_group_metadata()
    out = {"joined": joined, "member_after": c.memberid(), "generation_after": generation(metadata)}
    out["events_before_poll"] = list(events)
    producer.begin_transaction()
    try:
        producer.send_offsets_to_transaction([ck.TopicPartition(topic, 0, 1)], metadata, 10)
        producer.commit_transaction(10)
        out["txn"] = "committed"
    except ck.KafkaException as exc:
        out["txn"] = exc.args[0].name()
        producer.abort_transaction(10)
    c.poll(1.0)
    out["events_after_poll"] = list(events)
    print(json.dumps(out), flush=True)
    c.close()


if __name__ == "__main__":
    main()
