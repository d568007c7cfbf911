"""One logging path: the `rlstream` logger only, JSON or text, and librdkafka's lines shaped like ours."""

import io
import json
import logging
import sys

import pytest

from streams.config import CLIENT_LOGGER
from workers.telemetry.logs import JsonFormatter, KafkaClientFilter, configure_logging


@pytest.fixture(autouse=True)
def restore_logging():
    """Leave the loggers as the test found them: other tests (and pytest's capture) rely on them."""
    ours, kafka, root = logging.getLogger("rlstream"), logging.getLogger(CLIENT_LOGGER), logging.getLogger()
    saved = (
        list(ours.handlers),
        ours.level,
        ours.propagate,
        kafka.level,
        list(kafka.filters),
        list(root.handlers),
        root.level,
    )
    yield
    for h in list(ours.handlers):
        ours.removeHandler(h)
    for h in saved[0]:
        ours.addHandler(h)
    ours.level, ours.propagate, kafka.level = saved[1], saved[2], saved[3]
    kafka.filters[:] = saved[4]
    assert root.handlers == saved[5] and root.level == saved[6], "configure_logging touched the root logger"


def _librdkafka(level: int, facility: str, text: str) -> None:
    # Exactly how confluent-kafka hands a librdkafka line to the logger in a client's config.
    logging.getLogger(CLIENT_LOGGER).log(level, "%s [%s] %s", facility, "rdkafka#producer-3", text)


def test_json_formatter_writes_one_object_per_line_with_extra_fields():
    out = io.StringIO()
    configure_logging(json_lines=True, stream=out)
    logging.getLogger("rlstream.test").info("finalized %d groups", 3, extra={"worker_id": "w7"})
    logging.getLogger("rlstream.test").warning("two\nlines")
    first, second = [json.loads(line) for line in out.getvalue().splitlines()]
    assert first["msg"] == "finalized 3 groups" and first["worker_id"] == "w7" and first["level"] == "info"
    assert first["logger"] == "rlstream.test" and first["ts"].endswith("Z")
    assert second["msg"] == "two\nlines" and second["level"] == "warning"


def test_json_formatter_carries_the_exception():
    try:
        raise KeyError("k")
    except KeyError:
        record = logging.LogRecord("rlstream.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    out = json.loads(JsonFormatter().format(record))
    assert out["msg"] == "failed" and "KeyError: 'k'" in out["exc"]


def test_configure_logging_sets_up_only_the_rlstream_logger_once():
    root = logging.getLogger()
    root_handlers = list(root.handlers)
    first, second = io.StringIO(), io.StringIO()
    configure_logging(stream=first)
    configure_logging(stream=second, level=logging.WARNING)
    ours = logging.getLogger("rlstream")
    installed = [h for h in ours.handlers if getattr(h, "_rlstream", False)]
    assert len(installed) == 1 and installed[0].stream is second
    assert ours.propagate is False and ours.level == logging.WARNING
    assert root.handlers == root_handlers
    logging.getLogger("rlstream.demo").warning("on the second stream")
    logging.getLogger("rlstream.demo").info("below the level")
    logging.getLogger("someone.else").warning("not ours")
    assert first.getvalue() == ""
    assert "WARNING rlstream.demo on the second stream" in second.getvalue()
    assert "below the level" not in second.getvalue() and "not ours" not in second.getvalue()


def test_a_librdkafka_line_is_formatted_like_ours():
    text, js = io.StringIO(), io.StringIO()
    configure_logging(stream=text)
    _librdkafka(logging.ERROR, "FAIL", "[thrd:127.0.0.1:1/bootstrap]: 127.0.0.1:1/bootstrap: Connect failed")
    line = text.getvalue().strip()
    assert line.endswith("ERROR rlstream.kafka rdkafka#producer-3 FAIL: 127.0.0.1:1/bootstrap: Connect failed")
    assert "%" not in line and "[thrd:" not in line
    configure_logging(json_lines=True, stream=js)
    _librdkafka(logging.WARNING, "MAXPOLL", "[thrd:main]: Application maximum poll interval exceeded")
    record = json.loads(js.getvalue())
    assert record["msg"] == "rdkafka#producer-3 MAXPOLL: Application maximum poll interval exceeded"
    assert record["level"] == "warning" and record["logger"] == CLIENT_LOGGER
    assert record["kafka_client"] == "rdkafka#producer-3" and record["kafka_facility"] == "MAXPOLL"


def test_librdkafka_chatter_stays_off_the_screen_unless_debugging():
    out = io.StringIO()
    configure_logging(stream=out)
    _librdkafka(logging.INFO, "CGRPOP", "[thrd:main]: Group joined")
    _librdkafka(logging.DEBUG, "FETCH", "[thrd:main]: Fetch 1 partition(s)")
    _librdkafka(logging.WARNING, "GETPID", "[thrd:main]: Failed to acquire PID: Coordinator load in progress: retrying")
    _librdkafka(logging.WARNING, "SESSTMOUT", "[thrd:main]: Consumer group session timed out")
    assert out.getvalue().count("\n") == 1 and "WARNING rlstream.kafka rdkafka#producer-3 SESSTMOUT" in out.getvalue()
    debug = io.StringIO()
    configure_logging(stream=debug, level=logging.DEBUG)
    _librdkafka(logging.INFO, "CGRPOP", "[thrd:main]: Group joined")
    _librdkafka(logging.WARNING, "GETPID", "[thrd:main]: Failed to acquire PID: Coordinator load in progress: retrying")
    assert "INFO rlstream.kafka rdkafka#producer-3 CGRPOP: Group joined" in debug.getvalue()
    assert "INFO rlstream.kafka rdkafka#producer-3 GETPID" in debug.getvalue()


def test_the_client_filter_leaves_other_records_alone():
    record = logging.LogRecord(CLIENT_LOGGER, logging.WARNING, __file__, 1, "plain %s", ("x",), None)
    assert KafkaClientFilter().filter(record) and record.getMessage() == "plain x"
    configure_logging(stream=io.StringIO())
    configure_logging(stream=io.StringIO())
    assert sum(isinstance(f, KafkaClientFilter) for f in logging.getLogger(CLIENT_LOGGER).filters) == 1
