"""A live `rlstream demo` watched the way an operator watches one: `rlstream top` in a terminal (tmux, read
back with capture-pane), and a real Prometheus (Debian's `prometheus`) scraping every endpoint of the run
and evaluating every query of the Grafana dashboard and every alert rule.

One run for both, on the session's broker and Ray: the demo (one reassembler actor, its trainer and TQ
serving metrics) beside a pool of two reassembler processes in its consumer group (`rlstream reassemble
--workers 2 --metrics-port 0`), so the pool's supervision is scraped too. Prometheus runs on a loopback
port with its own config and data directory, started and stopped here by pid.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from streams.tq import ray_address
from tests.integration.helpers import setup_topics
from tests.tools import dashboard as d

PROMETHEUS = shutil.which("prometheus")
TMUX = shutil.which("tmux")
GROUPS = 60  # at 3 groups/s: 20 s of streaming after the start, the trainer at version 2 by the end
_URL = re.compile(r"http://[\d.]+:\d+/metrics")


def _wait_for(what: str, timeout_s: float, probe):
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.5)


def _log_match(path: Path, pattern: str, proc: subprocess.Popen, timeout_s: float) -> re.Match:
    def probe():
        m = re.search(pattern, path.read_text(errors="replace"), re.M)
        if m is None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before logging {pattern!r}:\n{path.read_text()[-3000:]}")
        return m

    return _wait_for(f"{pattern!r} in {path.name}", timeout_s, probe)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen | None, timeout_s: float = 60) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class LiveRun:
    prefix: str
    bootstrap_servers: str
    demo: subprocess.Popen
    demo_log: Path
    report: Path
    endpoints: dict[str, list[str]]  # role -> /metrics URLs
    consumer_group: str
    started_at: float
    prometheus: str | None  # its base URL, None when not installed

    def demo_report(self, timeout_s: float = 300) -> dict:
        """The demo's figures once it has ended by itself (every group accounted for: exit 0)."""
        self.demo.wait(timeout=timeout_s)
        assert self.demo.returncode == 0, self.demo_log.read_text()[-3000:]
        return json.loads(self.report.read_text())


def _prometheus_config(run_dir: Path, endpoints: dict[str, list[str]], prefix: str) -> Path:
    def targets(urls):
        return [{"targets": [urllib.parse.urlsplit(u).netloc for u in urls]}]

    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(d.ALERTS)],
        "scrape_configs": [
            {"job_name": "rlstream-reassembler", "static_configs": targets(endpoints["reassemblers"])},
            {"job_name": "rlstream-pool", "static_configs": targets(endpoints["pool"])},
            {"job_name": "rlstream-trainer", "static_configs": targets(endpoints["trainer"])},
            # The operator labels the TQ of this run's Ray with its prefix (see docs/CLUSTER.md).
            {"job_name": "transferqueue",
             "static_configs": [{**targets(endpoints["tq"])[0], "labels": {"prefix": prefix}}]},
        ],
    }  # fmt: skip
    path = run_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def live_run(kafka, tq_session, tmp_path_factory):
    if PROMETHEUS is None and TMUX is None:
        pytest.skip("neither prometheus nor tmux is installed")
    run_dir = tmp_path_factory.mktemp("live-run")
    prefix = f"live-{uuid.uuid4().hex[:8]}"
    group = f"reassemblers.{prefix}"
    setup_topics(kafka, prefix)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "workers.cli.main"]
    common = ["--bootstrap-servers", kafka.bootstrap_servers, "--prefix", prefix, "--ray-address", ray_address()]
    pool_log, demo_log = run_dir / "pool.log", run_dir / "demo.log"
    procs: list[subprocess.Popen] = []
    prometheus = None
    try:
        with open(pool_log, "wb") as out:
            pool = subprocess.Popen(
                [*cli, "reassemble", *common, "--consumer-group", group, "--group-timeout-s", "10", "--workers", "2",
                 "--no-spare", "--worker-id", "pool", "--metrics-port", "0"],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        procs.append(pool)
        with open(demo_log, "wb") as out:
            demo = subprocess.Popen(
                [*cli, "demo", *common, "--groups", str(GROUPS), "--produce-rate-groups-s", "3", "--reassemblers", "1",
                 "--metrics-port", "0", "--timeout", "240", "--json", str(run_dir / "demo.json")],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        procs.append(demo)
        pool_urls = lambda: re.findall(r"metrics: http://0\.0\.0\.0:(\d+)/metrics(.*)", pool_log.read_text())  # noqa: E731
        _wait_for("the pool's three endpoints", 180, lambda: len(pool_urls()) == 3 and pool.poll() is None)
        served = [(f"http://127.0.0.1:{port}/metrics", rest) for port, rest in pool_urls()]
        line = _log_match(demo_log, r"^metrics: trainer (.*)$", demo, 240).group(1)
        trainer, actors, tq = line.split(", reassemblers ")[0], line.split(", reassemblers ")[1].split(", TQ ")[0], line
        endpoints = {
            "reassemblers": [u for u, rest in served if "pool" not in rest] + _URL.findall(actors),
            "pool": [u for u, rest in served if "pool" in rest],
            "trainer": [trainer],
            "tq": _URL.findall(tq.split(", TQ ")[1]),
        }
        assert [len(endpoints[k]) for k in ("reassemblers", "pool", "trainer", "tq")] == [3, 1, 1, 1], endpoints
        started = time.time()
        if PROMETHEUS is not None:
            port = _free_port()
            config = _prometheus_config(run_dir, endpoints, prefix)
            with open(run_dir / "prometheus.log", "wb") as out:
                prometheus = subprocess.Popen(
                    [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={run_dir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            _wait_for("Prometheus ready", 60, lambda: _get(f"{url}/-/ready", ok_only=True))
        _log_match(demo_log, r"^producers: ", demo, 120)
        yield LiveRun(
            prefix, kafka.bootstrap_servers, demo, demo_log, run_dir / "demo.json", endpoints, group, started,
            None if prometheus is None else url,
        )  # fmt: skip
    finally:
        for p in reversed(procs):
            _stop(p, timeout_s=120)
        _stop(prometheus)


def _get(url: str, *, ok_only: bool = False):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read()
    except OSError:
        return None if ok_only else {}
    return True if ok_only else json.loads(body)


# --- rlstream top in a terminal -----------------------------------------------------------------


class Tmux:
    """A tmux server of this test's own (its socket name), its one session running `command`."""

    def __init__(self, run_dir: Path, command: list[str], *, width: int = 150, height: int = 60):
        self.socket = f"rlstream-test-{uuid.uuid4().hex[:8]}"
        conf = run_dir / "tmux.conf"
        conf.write_text("set -g remain-on-exit on\nset -g history-limit 100\n")  # the exit status stays readable
        self._tmux("-f", str(conf), "new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height),
                   "exec " + shlex.join(command))  # fmt: skip
        self.server_pid = int(self._tmux("display-message", "-p", "-t", "top", "#{pid}").strip())

    def _tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "top")

    def pane(self, fmt: str) -> str:
        return self._tmux("display-message", "-p", "-t", "top", fmt).strip()

    def exit_status(self) -> str | None:
        """'exit N, signal' or 'exit , signal S' once the pane's process has ended; None while it runs.

        tmux marks the pane dead when its terminal closes and fills in the status once it reaps the
        process, which under load it was seen not to do for over 60 s: the process a zombie, its exit
        long done. Until tmux has it, the zombie's own exit code (/proc/PID/stat, wait(2)'s encoding) says.
        """
        status = self.pane("exit #{pane_dead_status}, signal #{pane_dead_signal}")
        if status != "exit , signal":
            return status
        pid = self.pane("#{pane_pid}")
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None  # reaped between the two questions: tmux has its status on the next one
        if fields[0] != "Z":
            return None
        code = int(fields[49])
        return f"exit {os.WEXITSTATUS(code)}, signal" if os.WIFEXITED(code) else f"exit , signal {os.WTERMSIG(code)}"

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    def stop(self) -> None:
        try:
            os.kill(self.server_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _shows_the_run(screen: str, run: LiveRun) -> bool:
    version = re.search(r"^trainer +version (\d+) +\(trainer\." + re.escape(run.prefix), screen, re.M)
    receipts = re.findall(
        rf"^ +{re.escape(run.prefix)}\.rollout\.receipts +{re.escape(run.consumer_group)} +\d", screen, re.M
    )
    finalized = re.findall(rf"^ +{re.escape(run.prefix)}\.experience\.finalized +trainer\.", screen, re.M)
    return bool(
        version and int(version.group(1)) >= 1
        and len(receipts) == 4 and len(finalized) == 4
        and re.search(r"groups finalized \d+\.\d/s", screen)
        and re.search(r"│█+ +\d+ \(\d+%\)", screen)
        and "metrics endpoints: 6 of 6 up" in screen
        and re.search(r"TQ rows held rlstream\.staging \d+, rlstream\.train \d+", screen)
    )  # fmt: skip


@pytest.mark.skipif(TMUX is None, reason="needs tmux (Debian's tmux package; .ci/run installs it)")
def test_top_shows_the_live_run_then_its_endpoints_down_and_quits_on_ctrl_c(live_run, tmp_path):
    urls = [u for role in ("reassemblers", "pool", "trainer", "tq") for u in live_run.endpoints[role]]
    command = [sys.executable, "-m", "workers.cli.main", "top", "--bootstrap-servers", live_run.bootstrap_servers,
               "--prefix", live_run.prefix, "--consumer-group", live_run.consumer_group]  # fmt: skip
    for u in urls:
        command += ["--metrics", u]
    term = Tmux(tmp_path, command)
    try:

        def shown() -> str | None:
            screen = term.screen()
            return screen if _shows_the_run(screen, live_run) else None

        try:
            screen = _wait_for("the live run on rlstream top's screen", 120, shown)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; its screen:\n{term.screen()}") from None
        assert live_run.demo.poll() is None, "the demo was still running: a live view, not a leftover"
        (tmp_path / "screen.txt").write_text(screen)
        # The demo ends by itself: its trainer's and its actor's endpoints go, top shows them down and goes on.
        live_run.demo_report()
        trainer = live_run.endpoints["trainer"][0]

        def down() -> str | None:
            screen = term.screen()
            return screen if f"{trainer}  DOWN: " in screen and "metrics endpoints: 4 of 6 up" in screen else None

        screen = _wait_for("the demo's endpoints shown down", 30, down)
        assert re.search(r"^throughput +receipts in [\d.]+/s", screen, re.M), "Kafka's figures still shown"
        clock = re.search(r"· (\d\d:\d\d:\d\d) ·", screen).group(1)
        _wait_for("a redraw", 10, lambda: re.search(r"· (\d\d:\d\d:\d\d) ·", term.screen()).group(1) != clock)
        term.keys("C-c")
        # The pane's process is top itself (exec'd by tmux's shell): its own exit status, not a shell's.
        try:  # a frozen view (the handler deadlock fixed in run_top) never exits
            status = _wait_for("top to exit on Ctrl-C", 60, term.exit_status)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; its screen:\n{term.screen()}") from None
        assert status == "exit 0, signal", status + "\n" + term.screen()
        assert "Traceback" not in term.screen()
    finally:
        term.stop()


# --- a real Prometheus ------------------------------------------------------------------------


def _query_range(run: LiveRun, expr: str, start: float, end: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1"})
    answer = _get(f"{run.prometheus}/api/v1/query_range?{params}")
    assert answer.get("status") == "success", (expr, answer)
    return answer["data"]["result"]


def _has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Prometheus (Debian's prometheus package; .ci/run installs it)")
def test_prometheus_scrapes_the_run_and_every_dashboard_query_and_alert_rule_evaluates_with_data(live_run):
    run = live_run
    report = run.demo_report()  # the run ends by itself; everything it did is in Prometheus by then
    end = time.time()
    # Every endpoint of the run was scraped while it ran (the demo's are gone now).
    (up,) = _query_range(run, f"min(max_over_time(up[{int(end - run.started_at) + 5}s]))", end, end)
    assert float(up["values"][-1][1]) == 1
    assert len(_query_range(run, "up", run.started_at, end)) == 6
    range_ = f"{int(end - run.started_at) + 60}s"
    empty = {}
    for q in d.queries():
        expr = d.concrete(q.expr, prefix=run.prefix, rate_interval="10s", range_=range_)
        if not _has_data(_query_range(run, expr, run.started_at, end)):
            empty[f"{q.panel} {q.ref}"] = expr
    assert not empty, f"dashboard queries without data: {json.dumps(empty, indent=1)}"

    # The prefix variable lists this run, and its figures are the demo's own.
    match = urllib.parse.quote('{__name__=~"rlstream_.+"}')
    assert run.prefix in _get(f"{run.prometheus}/api/v1/label/prefix/values?match[]={match}")["data"]

    def final(metric: str) -> float:
        (series,) = _query_range(run, f'sum(max_over_time({metric}{{prefix="{run.prefix}"}}[10m]))', end, end)
        return float(series["values"][-1][1])

    assert final("rlstream_trainer_version") == report["final_weight_version"] >= 1
    assert final("rlstream_trainer_yielded_groups_total") == report["groups_consumed"]
    assert final("rlstream_trainer_evicted_groups_total") == report["groups_evicted_stale"]
    assert final("rlstream_pool_workers_running") == 2

    # Every alert rule loaded and evaluated without error on the live series; none fired on a healthy run.
    rules = [r for g in _get(f"{run.prometheus}/api/v1/rules")["data"]["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for r in d.alert_rules()}
    assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
    firing = [a for a in _get(f"{run.prometheus}/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"]
    assert not [a for a in firing if a["labels"].get("prefix") == run.prefix], firing
