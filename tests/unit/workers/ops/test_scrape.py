"""Reading metrics endpoints without a Prometheus: a live endpoint, one that is down, one that answers
something else, and the sum over endpoints of one run's samples."""

import http.server
import socket
import threading

from prometheus_client import CollectorRegistry

from workers.ops.scrape import Figures, Scrape, metrics_url, scrape, scrape_all
from workers.telemetry.prometheus import PrometheusReassemblerSensor, PrometheusTrainerSensor, start_metrics_server


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_url_accepts_host_port_a_base_url_or_a_whole_url():
    assert metrics_url("10.0.0.1:9400") == "http://10.0.0.1:9400/metrics"
    assert metrics_url("http://h:1") == "http://h:1/metrics"
    assert metrics_url("https://h:1/custom/path") == "https://h:1/custom/path"


def test_a_live_endpoint_is_read_and_one_that_is_down_or_not_prometheus_says_why():
    r = CollectorRegistry()
    PrometheusReassemblerSensor(r, prefix="run1").on_receipts(12)
    live = f"http://127.0.0.1:{start_metrics_server(0, addr='127.0.0.1', registry=r)}/metrics"

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html><body>a login page</body></html>\n")

        def log_message(self, *args):
            pass

    html = http.server.HTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=html.serve_forever, daemon=True).start()
    try:
        down = f"http://127.0.0.1:{_closed_port()}/metrics"
        got = scrape_all([live, down, f"http://127.0.0.1:{html.server_port}/metrics"], timeout_s=2)
    finally:
        html.shutdown()
    assert [s.url for s in got][:2] == [live, down], "in the order given"
    assert got[0].up and ("rlstream_receipts_consumed_total", {"prefix": "run1"}, 12.0) in got[0].samples
    assert not got[1].up and "refused" in got[1].error.lower()
    assert not got[2].up and got[2].error.startswith("not Prometheus text")
    assert scrape(down, timeout_s=1).samples == ()


def test_figures_sum_one_runs_samples_over_the_endpoints_that_answered():
    a = Scrape("a", (
        ("rlstream_receipts_consumed_total", {"prefix": "run1"}, 10.0),
        ("rlstream_receipts_consumed_total", {"prefix": "run2"}, 99.0),
        ("rlstream_dead_letters_total", {"prefix": "run1", "reason": "decode_error"}, 2.0),
        ("tq_partition_samples_total", {"partition_id": "rlstream.staging"}, 40.0),
    ))  # fmt: skip
    b = Scrape("b", (
        ("rlstream_receipts_consumed_total", {"prefix": "run1"}, 5.0),
        ("rlstream_dead_letters_total", {"prefix": "run1", "reason": "decode_error"}, 1.0),
        ("rlstream_dead_letters_total", {"prefix": "run1", "reason": "late_receipt"}, 4.0),
        ("tq_partition_samples_total", {"partition_id": "rlstream.staging"}, 40.0),
    ))  # fmt: skip
    down = Scrape("c", error="Connection refused")
    f = Figures([a, b, down], "run1")
    assert f.total("rlstream_receipts_consumed_total") == 15
    assert f.by("rlstream_dead_letters_total", "reason") == {"decode_error": 3, "late_receipt": 4}
    assert f.total("rlstream_dead_letters_total", reason="late_receipt") == 4
    # TQ's figures have no prefix (one TQ serves every run on its Ray): the same TQ seen twice counts once.
    assert f.by("tq_partition_samples_total", "partition_id", combine=max) == {"rlstream.staging": 40}
    assert f.total("rlstream_trainer_version") is None, "not reported is None, never 0"
    assert Figures([a], "").total("rlstream_receipts_consumed_total") is None
    bare = Scrape("d", (("rlstream_open_groups", {}, 3.0),))
    assert Figures([bare], "").total("rlstream_open_groups") == 3, "a run without a prefix has no prefix label"


def test_figures_read_what_the_sensors_export():
    r = CollectorRegistry()
    t = PrometheusTrainerSensor(r, prefix="run1")
    for wv in (5, 4, 4, 1):
        t.on_yield(5, wv)
    t.on_version(5)
    url = f"http://127.0.0.1:{start_metrics_server(0, addr='127.0.0.1', registry=r)}/metrics"
    f = Figures([scrape(url, timeout_s=5)], "run1")
    assert f.largest("rlstream_trainer_version") == 5
    buckets = f.by("rlstream_trainer_staleness_versions_bucket", "le")
    assert buckets["0.0"] == 1 and buckets["1.0"] == 3 and buckets["4.0"] == 4 and buckets["+Inf"] == 4
