"""`rlstream demo --nemo-gym`: the demo's producers capture with NeMo Gym's own code and publish NeMo Gym
receipts, and the accounting stays exact (against the session's broker and Ray)."""

import json
import subprocess
import sys

import pytest

from streams.config import KafkaConfig
from streams.consumer import read_topic
from streams.tq import ray_address
from workers.topics import TopicNames, sniff_kind

pytest.importorskip("nemo_gym.token_id_capture.staging", reason="nemo-gym 0.7.0 is not installed")


def test_demo_with_nemo_gym_receipts_accounts_for_every_group(broker, tq_session, tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "workers.cli.main", "demo", "--nemo-gym",
         "--bootstrap-servers", broker.bootstrap_servers, "--ray-address", ray_address(),
         "--groups", "12", "--producers", "2", "--reassemblers", "1", "--timeout", "240", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "captured by NeMo Gym (NeMo Gym receipts)" in proc.stderr + proc.stdout
    assert "every group accounted for once   yes" in proc.stdout
    report = json.loads(out.read_text())
    assert report["groups_produced"] == 12
    assert (
        report["groups_consumed"] + report["groups_evicted_stale"] + report["groups_dead_lettered"]
        == report["groups_produced"]
    )
    # Producer 0's group whose rollouts all fail (poisoned NeMo Gym receipts) and its poison record.
    assert report["groups_dead_lettered"] == 1 and report["poison_receipts_dead_lettered"] == 1
    assert report["accounted"] is True and report["problems"] == []
    kinds = [
        sniff_kind(r.value)
        for r in read_topic(KafkaConfig(broker.bootstrap_servers), TopicNames(report["prefix"]).receipts)
    ]
    assert kinds.count("gym_receipt") == 12 * 8 and set(kinds) <= {"gym_receipt", None}
