"""The compose file parses with whichever Compose the machine has (the plugin or docker-compose)."""

import shutil
import subprocess
from pathlib import Path

import pytest

COMPOSE = Path(__file__).resolve().parents[3] / "docker" / "compose.yaml"


def _compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_file_parses_and_has_the_pipeline_services():
    cmd = _compose_command()
    if cmd is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    proc = subprocess.run(cmd + ["-f", str(COMPOSE), "config", "--services"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) >= {"kafka", "ray-head", "reassembler", "demo", "topics"}
