"""Prometheus and Grafana beside the compose pipeline, checked without a Docker daemon: the dashboard's
queries name only metrics the code exports and every rlstream metric has a panel, each filters by the
run's prefix, the panels are well formed and say where their figures come from, the compose services
mount what the provisioning files expect, and Prometheus scrapes the ports the rlstream commands serve.
Where promtool exists (Debian's `prometheus` package; .ci/run installs it): the scrape config is valid
and every dashboard query parses as PromQL.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.tools import dashboard as d
from tests.unit.docker.cli_args import parse_rlstream

DOCKER = d.ROOT / "docker"
COMPOSE = [DOCKER / "compose.yaml", DOCKER / "compose.3brokers.yaml"]
GRAFANA = DOCKER / "grafana"


@pytest.fixture(scope="module")
def dash() -> dict:
    return d.load_dashboard()


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    return d.exported_metrics()


def _used_in(texts) -> set[str]:
    return {name for t in texts for name in d.metric_names(t)}


# --- the queries against the code ---------------------------------------------------------------


def test_every_query_and_alert_names_only_metrics_the_code_exports(dash, exported):
    exprs = [q.expr for q in d.queries(dash)] + [r["expr"] for r in d.alert_rules()]
    unknown = sorted(_used_in(exprs) - set(exported))
    assert not unknown, f"not exported by workers/telemetry/prometheus.py or TQ: {unknown}"


def test_every_rlstream_metric_has_a_panel(dash, exported):
    used = _used_in(q.expr for q in d.queries(dash))
    families = {fam for name, fam in exported.items() if name.startswith("rlstream_")}
    shown = {exported[n] for n in used if n in exported}
    assert families - shown == set(), "an rlstream metric no panel shows"
    assert "tq_partition_samples_total" in used, "what TQ holds"


def test_every_rlstream_selector_filters_by_the_prefix_variable(dash):
    for q in d.queries(dash):
        for name, matchers in d.rlstream_selectors(q.expr):
            assert 'prefix=~"$prefix"' in matchers, f"{q.panel} {q.ref}: {name}{matchers}"
    tq = [q for q in d.queries(dash) if "tq_partition_samples_total" in q.expr]
    # TQ's series carry a prefix only when the scrape config labels the target; unlabelled ones always show.
    assert tq and all('prefix=~"$prefix|"' in q.expr for q in tq)


def test_the_prefix_variable_lists_the_runs_and_all_of_them_matches_a_run_without_prefix(dash):
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "prefix"]
    assert var["type"] == "query" and var["includeAll"] and var["multi"]
    assert var["allValue"] == ".*", "matches an absent prefix label too (a run without a prefix)"
    assert var["query"]["query"] == 'label_values({__name__=~"rlstream_.+"}, prefix)'
    assert var["datasource"]["uid"] == _datasource()["uid"]


def test_queries_use_only_known_variables(dash):
    for q in d.queries(dash):
        found = set(re.findall(r"\$\w+", q.expr))
        assert found <= set(d.VARIABLES), f"{q.panel} {q.ref}: {found - set(d.VARIABLES)}"
        assert "$" not in d.concrete(q.expr, prefix="run1"), q.expr


def test_the_checks_catch_a_misspelt_metric_and_a_missing_prefix_filter(dash, exported):
    broken = {**dash, "panels": [*dash["panels"]]}
    first = next(i for i, p in enumerate(broken["panels"]) if p.get("targets"))
    panel = {**broken["panels"][first]}
    panel["targets"] = [{**panel["targets"][0], "expr": "sum(rate(rlstream_receipts_consumd_total[5m]))"}]
    broken["panels"][first] = panel
    with pytest.raises(AssertionError):
        test_every_query_and_alert_names_only_metrics_the_code_exports(broken, exported)
    with pytest.raises(AssertionError):
        test_every_rlstream_selector_filters_by_the_prefix_variable(broken)


# --- the panels ---------------------------------------------------------------------------------


def test_panels_are_well_formed_and_do_not_overlap(dash):
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
    for p in d.panels(dash):
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert p["datasource"]["uid"] == _datasource()["uid"], p["title"]
        assert all(t["datasource"]["uid"] == _datasource()["uid"] for t in p["targets"]), p["title"]
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36


def test_every_panel_says_where_its_figures_come_from(dash):
    for p in d.panels(dash):
        named = _used_in(t["expr"] for t in p["targets"]) - {"up"}
        missing = {n for n in named if n.removesuffix("_bucket") not in p["description"]}
        assert not missing, f"{p['title']}: its description does not name {missing}"


def test_a_panel_for_every_question_of_the_operator(dash):
    titles = {p["title"] for p in d.panels(dash)}
    for question in (
        "Throughput",
        "Consumer lag per partition",
        "Staleness of trained groups",
        "Evictions",
        "Dead letters by reason",
        "Trainer weight version",
        "TQ rows held per partition",
        "Workers fenced or restarted",
    ):
        assert question in titles


# --- compose and provisioning -------------------------------------------------------------------


def _datasource() -> dict:
    (ds,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    return ds


def _mounts(svc: dict, compose: Path) -> dict[str, Path]:
    """Container path -> host path of a service's read-only bind mounts."""
    out = {}
    for v in svc["volumes"]:
        host, container, mode = v.split(":")
        assert mode == "ro", v
        out[container] = (compose.parent / host).resolve()
    return out


@pytest.mark.parametrize("compose", COMPOSE, ids=lambda p: p.name)
def test_prometheus_and_grafana_mount_what_their_provisioning_expects(compose):
    services = yaml.safe_load(compose.read_text())["services"]
    prom, graf = services["prometheus"], services["grafana"]
    mounts = _mounts(prom, compose)
    config = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    folder = Path(config).parent.as_posix()
    assert mounts[folder] == DOCKER / "prometheus" and (mounts[folder] / Path(config).name).is_file()
    listen = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--web.listen-address="))
    assert _datasource()["url"] == f"http://prometheus{listen}", "Grafana's datasource is this service"
    assert "127.0.0.1:9090:9090" in prom["ports"] and "127.0.0.1:3000:3000" in graf["ports"], "loopback only"
    gm = _mounts(graf, compose)
    assert gm["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "rlstream.yml").read_text())["providers"]
    assert gm[provider["options"]["path"]] == GRAFANA / "dashboards"
    home = graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (gm[str(Path(home).parent)] / Path(home).name) == d.DASHBOARD


def _scrape_ports(job: dict) -> set[tuple[str, int]]:
    out = {(name, sd["port"]) for sd in job.get("dns_sd_configs", []) for name in sd["names"]}
    for static in job.get("static_configs", []):
        out |= {(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in static["targets"]}
    return out


@pytest.mark.parametrize("compose", COMPOSE, ids=lambda p: p.name)
def test_prometheus_scrapes_the_ports_the_rlstream_commands_serve(compose):
    services = yaml.safe_load(compose.read_text())["services"]
    config = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: _scrape_ports(j) for j in config["scrape_configs"]}
    reassemble = parse_rlstream([str(a) for a in services["reassembler"]["command"]]).params
    port, workers = reassemble["metrics_port"], reassemble["workers"]
    # `reassemble --workers N --metrics-port P`: worker i on P+i, the pool's supervision on P+N.
    assert jobs["rlstream-reassembler"] == {("reassembler", port + i) for i in range(workers)}
    assert jobs["rlstream-pool"] == {("reassembler", port + workers)}
    demo = parse_rlstream([str(a) for a in services["demo"]["command"]]).params
    assert demo["external_reassemblers"], "no reassembler actors: the demo serves only the trainer"
    assert jobs["rlstream-trainer"] == {("demo", demo["metrics_port"])}
    tq_port = int(services["ray-head"]["environment"]["RLSTREAM_TQ_METRICS_PORT"])
    assert jobs["transferqueue"] == {("ray-head", tq_port)}
    assert all(re.fullmatch(r"rlstream.*|transferqueue", job) for job in jobs), "what RlstreamMetricsTargetDown watches"
    rules = (DOCKER / "prometheus" / config["rule_files"][0]).resolve()
    assert rules == d.ALERTS


# --- promtool -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("no promtool here (Debian's prometheus package; .ci/run installs it)")
    return found


def test_promtool_accepts_the_scrape_config(promtool):
    proc = subprocess.run([promtool, "check", "config", str(DOCKER / "prometheus" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_dashboard_query_parses_as_promql(promtool, dash, tmp_path):
    """As recording rules, which promtool parses offline: a syntax error names the panel."""
    rules = [
        {"record": f"dashboard:{re.sub(r'[^a-z0-9]+', '_', q.panel.lower())}:{q.ref}", "expr": d.concrete(q.expr,
         prefix="run-1.x")}
        for q in d.queries(dash)
    ]  # fmt: skip
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout
