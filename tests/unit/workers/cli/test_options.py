"""Flags derived from the settings, the shared Kafka options, and their precedence (no broker needed)."""

import json

import msgspec
import pytest
from click.testing import CliRunner

import streams.admin
import workers.ops.lag
import workers.ops.replay
import workers.reassembler.run
from streams.settings import fields_of
from workers.cli.main import cli, main
from workers.cli.options import click_type
from workers.reassembler.config import ReassemblerConfig


@pytest.fixture
def runs(monkeypatch):
    """What `rlstream reassemble` would run: (kafka, config, tq, sensor) per call, without a broker or Ray."""
    calls = []

    def run_worker(kafka, config, tq, *, log=print, sensor=None, **_):
        calls.append((kafka, config, tq, sensor))

    monkeypatch.setattr(workers.reassembler.run, "run_worker", run_worker)
    return calls


def _main(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def _flag_value(f):
    """A valid value for setting `f` that is not its default, as the flag's text."""
    t = f.scalar
    if isinstance(t, msgspec.inspect.LiteralType):
        return next(v for v in t.values if v != f.default)
    if isinstance(t, msgspec.inspect.StrType):
        return f"x-{f.name}"
    bound = t.le if t.le is not None else (t.ge or 0) + 7
    return bound if bound != f.default else bound - 1


def test_every_scalar_reassembler_setting_is_a_flag_that_reaches_the_worker(runs, capsys):
    scalar = [f for f in fields_of(ReassemblerConfig) if click_type(f) is not None and f.name != "prefix"]
    argv, want = ["reassemble", "--bootstrap-servers", "b:1", "--prefix", "p1"], {"prefix": "p1"}
    for f in scalar:
        if isinstance(f.scalar, msgspec.inspect.BoolType):
            argv.append(f.flag if not f.default else f"--no-{f.flag[2:]}")
            want[f.name] = not f.default
        else:
            value = _flag_value(f)
            argv += [f.flag, str(value)]
            want[f.name] = value
    code, err = _main(capsys, *argv)
    assert code == 0, err
    (_, config, _, sensor) = runs[0]
    assert {name: getattr(config, name) for name in want} == want
    assert sensor is None
    assert {f.name for f in scalar} >= {"consumer_group", "group_timeout_s", "max_open_groups", "max_poll_records"}


def test_bounds_are_enforced_and_name_the_flag(runs, capsys):
    code, err = _main(capsys, "reassemble", "--bootstrap-servers", "b:1", "--group-timeout-s", "-1")
    assert code == 2 and not runs
    assert err.startswith("rlstream reassemble: Invalid value for '--group-timeout-s': -1.0 is not in the range")
    code, err = _main(capsys, "reassemble", "--bootstrap-servers", "b:1", "--session-timeout-ms", "999")
    assert code == 2 and "'--session-timeout-ms'" in err and not runs
    code, err = _main(capsys, "reassemble", "--bootstrap-servers", "b:1", "--group", "g")
    assert code == 2 and "No such option '--group'" in err


def test_no_setting_flag_file_or_environment_variable_reaches_a_fault(runs, capsys, monkeypatch, tmp_path):
    # Faults are objects a test or drill passes in (workers/reassembler/faults.py): a production
    # environment that sets what used to be a crash point must not make a worker kill itself.
    monkeypatch.setenv("RLSTREAM_REASSEMBLER_CRASH_POINT", "before_commit")
    monkeypatch.setenv("RLSTREAM_REASSEMBLER_STOP_POINT", "before_put")
    fault_words = ("crash", "stop_point", "fault", "freeze")
    assert not [f for f in ReassemblerConfig.__struct_fields__ if any(w in f for w in fault_words)]
    help_text = CliRunner().invoke(cli, ["reassemble", "--help"]).output
    assert "--crash-point" not in help_text and "--stop-point" not in help_text
    code, err = _main(capsys, "reassemble", "--bootstrap-servers", "b:1", "--crash-point", "before_commit")
    assert code == 2 and "No such option" in err and not runs
    cfg = tmp_path / "run.toml"
    cfg.write_text("[reassembler]\ncrash_point = 'before_commit'\n")
    code, err = _main(capsys, "reassemble", "--bootstrap-servers", "b:1", "--config", str(cfg))
    assert code != 0 and "crash_point" in err and not runs


def test_flags_override_environment_which_overrides_the_config_file(runs, capsys, monkeypatch, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        "[kafka]\nbootstrap_servers = 'file:9092'\n[kafka.client_settings]\n"
        "'sasl.password' = 'from-file'\n'client.id' = 'file'\n"
        "[reassembler]\nprefix = 'fp'\nconsumer_group = 'file-group'\ngroup_timeout_s = 5.0\nmax_open_groups = 77\n"
    )
    monkeypatch.setenv("RLSTREAM_REASSEMBLER_GROUP_TIMEOUT_S", "7.5")
    monkeypatch.setenv("RLSTREAM_REASSEMBLER_CONSUMER_GROUP", "env-group")
    monkeypatch.setenv("RLSTREAM_KAFKA_BOOTSTRAP_SERVERS", "env:9092")
    code, err = _main(
        capsys, "reassemble", "--config", str(cfg), "--consumer-group", "flag-group", "-X", "client.id=flag"
    )
    assert code == 0, err
    kafka, config, _, _ = runs[0]
    assert kafka.bootstrap_servers == "env:9092"
    assert kafka.client_settings == {"sasl.password": "from-file", "client.id": "flag"}
    assert (config.prefix, config.consumer_group, config.group_timeout_s, config.max_open_groups) == (
        "fp",
        "flag-group",
        7.5,
        77,
    )
    assert "from-file" not in err

    code, err = _main(capsys, "reassemble", "--config", str(cfg), "--bootstrap-servers", "flag:9092")
    assert code == 0, err
    assert runs[1][0].bootstrap_servers == "flag:9092" and runs[1][1].consumer_group == "env-group"


def test_a_json_config_file_works_too_and_a_bad_value_in_it_is_one_line(runs, capsys, tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"kafka": {"bootstrap_servers": "j:1"}, "reassembler": {"max_poll_records": 5}}))
    code, err = _main(capsys, "reassemble", "--config", str(cfg))
    assert code == 0, err
    assert runs[0][1].max_poll_records == 5
    cfg.write_text(json.dumps({"kafka": {"bootstrap_servers": "j:1"}, "reassembler": {"max_poll_records": 0}}))
    code, err = _main(capsys, "reassemble", "--config", str(cfg))
    assert code == 1 and len(err.strip().splitlines()) == 1 and "max_poll_records" in err


def test_kafka_options_are_shared_by_every_kafka_verb(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(streams.admin, "list_topics", lambda kafka: seen.append(kafka) or {})
    monkeypatch.setenv("RLSTREAM_KAFKA_BOOTSTRAP_SERVERS", "env:9092")
    assert _main(capsys, "topics", "list", "-X", "security.protocol=SASL_SSL", "-X", "sasl.username=u")[0] == 0
    assert seen[0].bootstrap_servers == "env:9092"
    assert seen[0].client_settings == {"security.protocol": "SASL_SSL", "sasl.username": "u"}
    for argv in (["replay", "t", "--to", "x"], ["tail", "t"], ["inspect", "group", "g"], ["deadletter", "redrive"]):
        help_text = CliRunner().invoke(cli, [*argv, "--help"]).output
        assert all(flag in help_text for flag in ("--bootstrap-servers", "--kafka-setting", "--prefix", "--config"))
    for argv in (["lag"], ["refinalize"], ["reassemble"], ["topics", "create"]):
        help_text = CliRunner().invoke(cli, [*argv, "--help"]).output
        assert "--kafka-setting" in help_text and "--config" in help_text


def test_a_malformed_client_setting_is_one_line_that_never_shows_its_value(capsys):
    code, err = _main(capsys, "topics", "list", "--bootstrap-servers", "b:1", "-X", "sasl.password:hunter2")
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("rlstream topics list: Invalid value for '-X' / '--kafka-setting': 'sasl.password'")
    assert "KEY=VALUE" in err and "hunter2" not in err


@pytest.mark.parametrize("setting", ["sasl.password=hunter2", "ssl.key.password=hunter2", "sasl.oauthbearer.config=x"])
def test_a_secret_given_with_X_is_refused_in_one_line_naming_its_key_and_where_secrets_go(capsys, setting):
    code, err = _main(capsys, "topics", "list", "--bootstrap-servers", "b:1", "-X", setting)
    key = setting.partition("=")[0]
    assert code == 2 and len(err.splitlines()) == 1 and "hunter2" not in err
    assert f"'{key}' is a secret" in err and "--kafka-config" in err and "RLSTREAM_KAFKA_CLIENT_SETTINGS" in err


def test_the_X_help_says_secrets_go_in_the_kafka_config_file_or_the_environment():
    help_text = " ".join(CliRunner().invoke(cli, ["topics", "list", "--help"]).output.split())
    x_help = help_text[help_text.index("-X, --kafka-setting") : help_text.index("--kafka-config FILE")]
    assert "Not for secrets (sasl.password" in x_help
    assert "--kafka- config file" in x_help or "--kafka-config file" in x_help
    assert "RLSTREAM_KAFKA_CLIENT_SETTINGS" in x_help


def test_no_cluster_anywhere_is_a_usage_error(capsys):
    code, err = _main(capsys, "lag")
    assert code == 2 and err.startswith("rlstream lag: no Kafka cluster given: pass --bootstrap-servers")


def test_consumer_groups_and_prompt_groups_have_distinct_flags(monkeypatch, capsys):
    got = {}
    monkeypatch.setattr(workers.ops.lag, "lag", lambda kafka, names, **kw: got.update(kw) or [])
    code, err = _main(
        capsys, "lag", "--bootstrap-servers", "b:1", "--consumer-group", "r1", "--trainer-consumer-group", "t1"
    )
    assert code == 0, err
    assert got == {"reassembler_consumer_group": "r1", "trainer_consumer_group": "t1", "input_topic": None}
    assert "consumer group 'r1'" in err and "consumer group 't1'" in err
    assert _main(capsys, "lag", "--bootstrap-servers", "b:1", "--group", "r1")[0] == 2

    class Report:
        def lines(self):
            return ["copied"]

    monkeypatch.setattr(workers.ops.replay, "replay", lambda *a, **kw: got.update(kw) or Report())
    code, err = _main(
        capsys, "replay", "src", "--to", "x", "--bootstrap-servers", "b:1", "--group-id", "g1", "--group-id", "g2"
    )
    assert code == 0, err
    assert got["group_ids"] == {"g1", "g2"}


def test_a_malformed_partition_offset_names_the_flag(capsys):
    code, err = _main(
        capsys, "replay", "src", "--to", "x", "--bootstrap-servers", "b:1", "--partition-offsets", "0:9-1"
    )
    assert code == 2 and err.startswith("rlstream replay: Invalid value for '--partition-offsets'")


def test_demo_flags_derive_from_its_settings_and_client_settings_reach_it(monkeypatch, capsys):
    import workers.demo.run

    seen = []

    class Report:
        accounted, problems = True, []

    def run_demo(cfg, *, log=None, client_settings=None, kafka_files=None):
        seen.append((cfg, client_settings))
        return Report()

    monkeypatch.setattr(workers.demo.run, "run_demo", run_demo)
    monkeypatch.setattr(workers.demo.run, "summary_table", lambda report: "table")
    argv = ["demo", "--groups", "24", "--timeout", "240", "--policy", "in_order", "--external-reassemblers"]
    code, err = _main(capsys, *argv, "--bootstrap-servers", "b:1", "-X", "sasl.username=u", "--prefix", "d1")
    assert code == 0, err
    cfg, client_settings = seen[0]
    assert (cfg.groups, cfg.timeout_s, cfg.policy, cfg.external_reassemblers) == (24, 240.0, "in_order", True)
    assert (cfg.bootstrap_servers, cfg.prefix, client_settings) == ("b:1", "d1", {"sasl.username": "u"})
    code, _ = _main(capsys, "demo")
    assert code == 0 and seen[1][0].bootstrap_servers is None and seen[1][1] is None
    code, err = _main(capsys, "demo", "--producers", "0")
    assert code == 2 and "'--producers'" in err and len(seen) == 2


@pytest.mark.parametrize("setting", ["=hunter2", " = hunter2", "sasl.password:hunter2"])
def test_a_malformed_client_setting_never_shows_what_follows_its_key(capsys, setting):
    code, err = _main(capsys, "topics", "list", "--bootstrap-servers", "b:1", "-X", setting)
    assert code == 2 and len(err.splitlines()) == 1
    assert "KEY=VALUE" in err and "hunter2" not in err


def test_client_settings_merge_file_then_environment_then_flags(monkeypatch, capsys, tmp_path):
    seen = []
    monkeypatch.setattr(streams.admin, "list_topics", lambda kafka: seen.append(kafka) or {})
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        "[kafka]\nbootstrap_servers = 'file:9092'\n[kafka.client_settings]\n"
        "'security.protocol' = 'SASL_SSL'\n'sasl.username' = 'file'\n'linger.ms' = 5\n"
    )
    monkeypatch.setenv("RLSTREAM_KAFKA_CLIENT_SETTINGS", '{"sasl.password": "from-env", "sasl.username": "env"}')
    code, err = _main(capsys, "topics", "list", "--config", str(cfg), "-X", "sasl.username=flag")
    assert code == 0, err
    assert seen[0].client_settings == {
        "security.protocol": "SASL_SSL",
        "sasl.username": "flag",
        "linger.ms": "5",
        "sasl.password": "from-env",
    }
    monkeypatch.setenv("RLSTREAM_KAFKA_CLIENT_SETTINGS", '{"sasl.password": from-env}')
    code, err = _main(capsys, "topics", "list", "--config", str(cfg))
    assert code == 1 and len(err.splitlines()) == 1 and "RLSTREAM_KAFKA_CLIENT_SETTINGS" in err
    assert "from-env" not in err


def test_reassemble_keeps_debug_logging_and_hands_it_to_pool_children(runs, capsys, monkeypatch):
    import logging

    code, err = _main(capsys, "--debug", "reassemble", "--bootstrap-servers", "b:1")
    assert code == 0, err
    assert logging.getLogger("rlstream").level == logging.DEBUG
    code, err = _main(capsys, "reassemble", "--bootstrap-servers", "b:1")
    assert code == 0, err
    assert logging.getLogger("rlstream").level == logging.INFO
    pools = []
    monkeypatch.setattr(workers.reassembler.run, "run_pool", lambda *a, **kw: pools.append(kw) or 0)
    code, err = _main(capsys, "--debug", "reassemble", "--bootstrap-servers", "b:1", "--workers", "2")
    assert code == 0, err
    assert pools[0]["debug"] is True


def test_a_pool_with_a_spare_joins_as_static_members_only_under_stable_worker_ids(runs, capsys, monkeypatch):
    pools = []
    monkeypatch.setattr(
        workers.reassembler.run, "run_pool", lambda kafka, config, *a, **kw: pools.append((config, kw)) or 0
    )
    base = ("reassemble", "--bootstrap-servers", "b:1", "--workers", "2")
    for extra in (("--worker-id", "p"), (), ("--worker-id", "p", "--no-spare")):
        code, err = _main(capsys, *base, *extra)
        assert code == 0, err
    (named, named_kw), (random_id, random_kw), (no_spare, no_spare_kw) = pools
    assert named.static_membership and named_kw["keep_spare"]
    # A random id is new at every start: old static members would hold their partitions a session timeout.
    assert random_id.worker_id.startswith("w") and not random_id.static_membership and random_kw["keep_spare"]
    assert not no_spare.static_membership and not no_spare_kw["keep_spare"]
