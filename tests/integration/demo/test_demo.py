"""`rlstream demo` run from the test suite with a small configuration, against the session's broker and Ray."""

import json
import re
import subprocess
import sys

from streams.tq import ray_address


def test_demo_exits_zero_and_its_json_accounts_for_every_group(broker, tq_session, tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers.cli.main",
            "demo",
            "--bootstrap-servers",
            broker.bootstrap_servers,
            "--ray-address",
            ray_address(),
            "--groups",
            "24",
            "--producers",
            "2",
            "--reassemblers",
            "1",
            "--timeout",
            "240",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # librdkafka's own lines go through Python logging; none reaches the screen raw ("%4|...|GETPID|...").
    assert not re.search(r"^%\d\|", proc.stderr, re.M), proc.stderr[-3000:]
    assert "every group accounted for once   yes" in proc.stdout
    report = json.loads(out.read_text())
    assert report["groups_produced"] == 24
    assert (
        report["groups_consumed"] + report["groups_evicted_stale"] + report["groups_dead_lettered"]
        == report["groups_produced"]
    )
    assert report["groups_dead_lettered"] == 1 and report["poison_receipts_dead_lettered"] == 1
    assert report["accounted"] is True and report["problems"] == []
    assert report["latency_p50_ms"] > 0 and report["groups_per_s"] > 0
