"""docker/entrypoint.sh with stand-ins for `ray`, `rlstream`, `python` and `hostname` that log their arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ENTRYPOINT = Path(__file__).resolve().parents[3] / "docker" / "entrypoint.sh"
TQ_HOST = ENTRYPOINT.with_name("tq_host.py")

pytestmark = pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")


def _run(tmp_path: Path, args: list[str], env: dict[str, str]) -> list[list[str]]:
    """Run the entry point; returns the stand-ins' calls in order, each as [program, args...]."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls"
    for prog in ("ray", "rlstream", "python"):
        stub = bin_dir / prog
        # One line per call: the program, its arguments NUL-separated, and the worker id it saw.
        stub.write_text(
            "#!/bin/sh\n"
            f'{{ printf "%s" "{prog}"; for a in "$@"; do printf "\\0%s" "$a"; done; '
            f'printf "\\0WORKER_ID=%s\\n" "${{RLSTREAM_REASSEMBLER_WORKER_ID:-}}"; }} >> "{log}"\n'
        )
        stub.chmod(0o755)
    hostname = bin_dir / "hostname"
    hostname.write_text("#!/bin/sh\necho pod-7\n")
    hostname.chmod(0o755)
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **env}
    proc = subprocess.run(["sh", str(ENTRYPOINT), *args], env=full_env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [line.split("\0") for line in log.read_text().splitlines()] if log.exists() else []


def test_a_command_runs_rlstream_with_its_arguments_and_no_ray_without_a_head(tmp_path):
    calls = _run(tmp_path, ["topics", "create", "--prefix", "a b"], {})
    assert calls == [["rlstream", "topics", "create", "--prefix", "a b", "WORKER_ID="]]


def test_with_a_head_address_it_joins_ray_offering_no_cpu_first(tmp_path):
    calls = _run(tmp_path, ["demo", "--external-reassemblers"], {"RAY_HEAD_ADDRESS": "ray-head:6379"})
    assert [c[0] for c in calls] == ["ray", "rlstream"]
    ray_args = calls[0][1:-1]
    assert ray_args[0] == "start"
    assert "--address=ray-head:6379" in ray_args
    assert "--num-cpus=0" in ray_args, "a driver's node must never host an actor or a TQ storage unit"
    assert "--head" not in ray_args
    assert calls[1][1:-1] == ["demo", "--external-reassemblers"]


@pytest.mark.parametrize(
    ("args", "env", "seen"),
    [
        (["reassemble", "--prefix", "p"], {}, "WORKER_ID=pod-7"),  # stable across restarts of one container
        (["reassemble"], {"RLSTREAM_REASSEMBLER_WORKER_ID": "w1"}, "WORKER_ID=w1"),  # the pod name, on Kubernetes
        (["demo"], {}, "WORKER_ID="),  # only the reassembler gets one
    ],
)
def test_a_reassembler_takes_the_host_name_as_worker_id_unless_given(tmp_path, args, env, seen):
    assert _run(tmp_path, args, env)[-1][-1] == seen


def test_ray_head_starts_the_head_then_hosts_transferqueue(tmp_path):
    calls = _run(tmp_path, ["ray-head", "--port=6379", "--num-cpus=4"], {})
    assert [c[0] for c in calls] == ["ray", "python"]
    ray_args = calls[0][1:-1]
    assert ray_args[:2] == ["start", "--head"] and "--block" not in ray_args
    assert ray_args[-2:] == ["--port=6379", "--num-cpus=4"]
    assert calls[1][1:-1] == [str(TQ_HOST), "--ready-file", "/tmp/rlstream-tq-ready"]


def test_ray_head_under_kuberay_runs_the_generated_command_without_block(tmp_path):
    generated = "ray start --head  --block  --dashboard-host=0.0.0.0  --num-cpus=4  --resources='{\"tq\":1}' "
    calls = _run(tmp_path, ["ray-head"], {"KUBERAY_GEN_RAY_START_CMD": generated})
    assert [c[0] for c in calls] == ["ray", "python"]
    assert calls[0][1:-1] == ["start", "--head", "--dashboard-host=0.0.0.0", "--num-cpus=4", '--resources={"tq":1}']


def test_the_ready_file_of_a_previous_run_is_removed_before_the_head_starts():
    # A restarted container keeps its /tmp; the healthcheck must not see the old run's file (static check:
    # the path is fixed, and a test should not touch /tmp/rlstream-tq-ready of a real container host).
    text = ENTRYPOINT.read_text()
    assert 'rm -f "$ready_file"' in text.split("ray start --head")[0]
    assert os.access(ENTRYPOINT, os.X_OK)
