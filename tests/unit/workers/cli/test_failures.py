"""The error funnel: one line for an expected failure, a logged traceback for a bug (no broker needed)."""

import subprocess
import sys

import pytest
from confluent_kafka import KafkaError, KafkaException

import streams.admin
from schemas.errors import RlstreamError
from workers.cli.main import main


def _raising(exc):
    def fail(*_args, **_kwargs):
        raise exc

    return fail


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_an_expected_failure_is_one_line_and_exit_1(monkeypatch, capsys, clean_env):
    monkeypatch.setattr(streams.admin, "list_topics", _raising(RlstreamError("the cluster said no\nwhat it said")))
    code, _, err = _run(capsys, "topics", "list", "--bootstrap-servers", "b:1")
    assert code == 1
    assert err.splitlines() == [f"rlstream topics list: the cluster said no (details in {clean_env})"]
    assert "what it said" in clean_env.read_text() and "Traceback" not in clean_env.read_text()


def test_a_kafka_client_error_is_an_expected_failure(monkeypatch, capsys):
    error = KafkaException(KafkaError(KafkaError._TRANSPORT, "Broker transport failure"))
    monkeypatch.setattr(streams.admin, "list_topics", _raising(error))
    code, _, err = _run(capsys, "topics", "list", "--bootstrap-servers", "b:1")
    assert (code, err) == (1, "rlstream topics list: Broker transport failure\n")


def test_a_bug_keeps_its_traceback_in_the_log_and_on_screen_only_with_debug(monkeypatch, capsys, clean_env):
    monkeypatch.setattr(streams.admin, "list_topics", _raising(TypeError("unhashable thing")))
    code, _, err = _run(capsys, "topics", "list", "--bootstrap-servers", "b:1")
    assert code == 1
    assert err.splitlines() == [
        f"rlstream topics list: internal error TypeError: unhashable thing (traceback in {clean_env})"
    ]
    logged = clean_env.read_text()
    assert "Traceback (most recent call last)" in logged and "TypeError: unhashable thing" in logged
    assert "in fail" in logged  # the frame that raised

    code, _, err = _run(capsys, "--debug", "topics", "list", "--bootstrap-servers", "b:1")
    assert code == 1
    assert "Traceback (most recent call last)" in err and "TypeError: unhashable thing" in err
    assert err.splitlines()[-1].startswith("rlstream topics list: internal error TypeError")
    assert logged.count("Traceback") == 1 and clean_env.read_text().count("Traceback") == 2


def test_ctrl_c_is_interrupted_and_130(monkeypatch, capsys):
    monkeypatch.setattr(streams.admin, "list_topics", _raising(KeyboardInterrupt()))
    code, _, err = _run(capsys, "topics", "list", "--bootstrap-servers", "b:1")
    assert code == 130 and err.strip().splitlines()[-1] == "rlstream topics list: interrupted"


def test_a_usage_error_is_one_line_naming_the_verb(capsys):
    code, _, err = _run(capsys, "topics", "create", "--bootstrap-servers", "b:1", "--partitions", "zero")
    assert code == 2
    assert err.splitlines() == [
        "rlstream topics create: Invalid value for '--partitions': 'zero' is not a valid integer range. "
        "(see 'rlstream topics create --help')"
    ]
    code, _, err = _run(capsys, "no-such-verb")
    assert code == 2 and err.startswith("rlstream: No such command 'no-such-verb'") and len(err.splitlines()) == 1


def test_a_bad_config_file_is_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[kafka\n")
    code, _, err = _run(capsys, "topics", "list", "--config", str(bad))
    assert code == 1
    assert len(err.splitlines()) == 1 and err.startswith(f"rlstream topics list: config file {bad}: not valid TOML")


@pytest.mark.parametrize("argv", [["--help"], ["broker", "--help"], ["lag", "--help"]])
def test_help_exits_0(capsys, argv):
    code, out, _ = _run(capsys, *argv)
    assert code == 0 and out.startswith("Usage: rlstream")


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (PermissionError(13, "Permission denied", "/data/broker"), "[Errno 13] Permission denied: '/data/broker'"),
        (OSError(98, "Address already in use"), "[Errno 98] Address already in use"),
        (NotADirectoryError(20, "Not a directory", "/data/file"), "[Errno 20] Not a directory: '/data/file'"),
    ],
)
def test_an_os_error_is_an_expected_failure(monkeypatch, capsys, clean_env, exc, reason):
    monkeypatch.setattr(streams.admin, "list_topics", _raising(exc))
    code, _, err = _run(capsys, "topics", "list", "--bootstrap-servers", "b:1")
    assert (code, err) == (1, f"rlstream topics list: {reason}\n")


def test_a_read_timeout_is_an_expected_failure(monkeypatch, capsys):
    from streams.consumer import wait_until
    from streams.errors import ReadTimeout

    with pytest.raises(TimeoutError):  # still a TimeoutError for callers that catch that
        wait_until(lambda: False, timeout_s=0, what="nothing")
    monkeypatch.setattr(streams.admin, "list_topics", lambda kafka: wait_until(lambda: False, timeout_s=0, what="x"))
    code, _, err = _run(capsys, "topics", "list", "--bootstrap-servers", "b:1")
    assert (code, err) == (1, "rlstream topics list: timed out after 0s waiting for x\n")
    assert issubclass(ReadTimeout, RlstreamError)


def test_details_go_to_the_screen_when_the_log_file_cannot_be_written(monkeypatch, capsys, tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    details = [f"log line {i}" for i in range(1, 26)]
    monkeypatch.setattr(streams.admin, "list_topics", _raising(RlstreamError("\n".join(["it failed", *details]))))
    code, _, err = _run(capsys, "topics", "list", "--bootstrap-servers", "b:1")
    assert code == 1
    lines = err.splitlines()
    assert lines[0] == "rlstream topics list: it failed"
    assert lines[1:11] == details[:10]
    assert lines[11].startswith("... (15 more lines; the log file") and len(lines) == 12


def test_short_details_are_shown_whole_when_the_log_file_cannot_be_written(monkeypatch, capsys, tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    monkeypatch.setattr(streams.admin, "list_topics", _raising(RlstreamError("it failed\nbecause\nof this")))
    code, _, err = _run(capsys, "topics", "list", "--bootstrap-servers", "b:1")
    assert (code, err) == (1, "rlstream topics list: it failed\nbecause\nof this\n")


# Lists `n` topics, one line each, through the real command in a process of its own.
_LISTER = (
    "import sys, streams.admin\n"
    "streams.admin.list_topics = lambda kafka: {{f't{{i}}': 1 for i in range({n})}}\n"
    "from workers.cli.main import main\n"
    "sys.exit(main(['topics', 'list', '--bootstrap-servers', 'b:1']))\n"
)


@pytest.mark.parametrize("topics", [200_000, 3])
def test_a_closed_stdout_ends_the_command_quietly_with_141(clean_env, topics):
    # 200,000 lines break the pipe while the verb writes; 3 only when stdout is flushed at the end.
    proc = subprocess.Popen(
        [sys.executable, "-c", _LISTER.format(n=topics)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    if topics > 3:
        assert proc.stdout.readline()  # `| head -1`
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err.decode()) == (141, "")
    assert not clean_env.exists() or "Traceback" not in clean_env.read_text()
