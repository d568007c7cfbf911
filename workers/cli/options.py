"""Options the verbs share: where the Kafka cluster is, and flags derived from a `Settings` definition.

`kafka_options` is the one way a verb learns its cluster: `--bootstrap-servers`, `-X KEY=VALUE`,
`--kafka-config FILE` (librdkafka `.properties`), `--prefix` and `--config FILE`, resolved through
`streams.settings.load` so that the `[kafka]` section of the file and `RLSTREAM_KAFKA_*` variables
count too. Precedence, later wins: `--config` [kafka] < `--kafka-config` < environment < flags; client
settings merge key by key. Secrets read this way stay in the resolved `KafkaConfig` (whose repr hides
them) and reach worker children on stdin, never on a command line; `-X` refuses a secret one. `settings_options`
turns every scalar field of a settings struct into a flag with its type, bounds and doc line;
flags left unset are None and do not override the file or the environment.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import click
import msgspec

from streams.config import KafkaConfig, is_secret, malformed_setting, read_client_properties, shown_key
from streams.settings import FieldDoc, Settings, env_name, fields_of, load, read_file

# Where a secret client setting goes instead of a command line (a JSON object).
SECRETS_ENV = env_name(KafkaConfig, "client_settings")


def say(msg: str) -> None:
    """A line on stderr for the operator: what a verb does and where (stdout is for its results)."""
    print(msg, file=sys.stderr, flush=True)


class KafkaTarget:
    """The cluster options of one invocation; the cluster is resolved (and checked) on first use."""

    def __init__(
        self,
        bootstrap_servers,
        kafka_setting,
        config_file: Path | None,
        prefix: str | None,
        required: bool,
        kafka_config: Path | None = None,
    ):
        self._given = (bootstrap_servers, tuple(kafka_setting), config_file)
        self._required = required
        self.kafka_config = kafka_config
        self.config_file = config_file
        self.prefix = prefix  # None: --prefix not given

    @functools.cached_property
    def kafka(self) -> KafkaConfig | None:
        """The cluster from flags, environment and file; None if optional and given nowhere."""
        servers, settings, file = self._given
        return resolve_kafka(servers, settings, file, required=self._required, kafka_config=self.kafka_config)

    @property
    def servers(self) -> str:
        return self.kafka.bootstrap_servers if self.kafka else "(none)"


class KeyValue(click.ParamType):
    """A `KEY=VALUE` client setting; a malformed one is named by its key only (the value may be secret).

    A secret one (`sasl.password`, ...) is refused: a command line is visible to every user of the
    host (`ps`, /proc) and stays in shell histories; secrets go in a file or the environment.
    """

    name = "KEY=VALUE"

    def convert(self, value, param, ctx) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        key, sep, setting = str(value).partition("=")
        if not sep or not key.strip():
            self.fail(malformed_setting(str(value)), param, ctx)
        if is_secret(key):
            self.fail(
                f"{shown_key(key)!r} is a secret, and a command line is visible to every user of this host: "
                f"put it in the --kafka-config file or in {SECRETS_ENV} (a JSON object)",
                param,
                ctx,
            )
        return key.strip(), setting.strip()


def resolve_kafka(
    bootstrap_servers: str | None,
    kafka_setting: Iterable[tuple[str, str]],
    config_file: Path | None,
    *,
    required: bool,
    kafka_config: Path | None = None,
) -> KafkaConfig | None:
    """The cluster from flags over environment over `--kafka-config` over `[kafka]` of `--config`.

    None if optional and given nowhere. `-X` settings are merged over RLSTREAM_KAFKA_CLIENT_SETTINGS,
    the properties file and `[kafka.client_settings]` key by key; the properties file's
    `bootstrap.servers` (if any) is its address.
    """
    extra = dict(kafka_setting)
    files = kafka_files(config_file, kafka_config)
    section = files.get(KafkaConfig.section)
    in_files = isinstance(section, dict) and bool(section.get("bootstrap_servers"))
    if not (bootstrap_servers or in_files or os.environ.get(env_name(KafkaConfig, "bootstrap_servers"))):
        if required or extra or kafka_config is not None:
            raise click.UsageError(
                "no Kafka cluster given: pass --bootstrap-servers, set "
                f"{env_name(KafkaConfig, 'bootstrap_servers')}, set bootstrap.servers in --kafka-config, "
                "or set bootstrap_servers under [kafka] in --config"
            )
        return None
    overrides = {"bootstrap_servers": bootstrap_servers, "client_settings": extra or None}
    # Without properties, hand `load` the path itself: its errors then name the file.
    return load(KafkaConfig, file=files if kafka_config is not None else config_file, overrides=overrides)


def kafka_files(config_file: Path | None, kafka_config: Path | None) -> dict:
    """The `--config` file's content with the `--kafka-config` properties merged over its [kafka] section."""
    content = read_file(config_file) if config_file is not None else {}
    if kafka_config is None:
        return content
    props = read_client_properties(kafka_config)
    section = content.get(KafkaConfig.section, {})
    section = dict(section) if isinstance(section, Mapping) else {}
    # librdkafka's two names for the address; the rest are client settings.
    servers = props.pop("bootstrap.servers", None) or props.pop("metadata.broker.list", None)
    if servers:
        section["bootstrap_servers"] = servers
    client = section.get("client_settings", {})
    section["client_settings"] = {**(client if isinstance(client, Mapping) else {}), **props}
    return {**content, KafkaConfig.section: section}


def kafka_options(*, required: bool = True, prefix: bool = True, prefix_help: str | None = None) -> Callable:
    """Add the cluster options to a verb, which receives them as `target: KafkaTarget`."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, bootstrap_servers, kafka_setting, kafka_config, config_file, prefix=None, **kwargs):
            target = KafkaTarget(bootstrap_servers, kafka_setting, config_file, prefix, required, kafka_config)
            return fn(*args, target=target, **kwargs)

        servers_help = "Kafka bootstrap servers, host:port[,...]"
        if not required:
            servers_help += " (default: start a local broker)"
        opts = [
            click.option("--bootstrap-servers", metavar="HOST:PORT[,...]", help=servers_help),
            click.option(
                "-X",
                "--kafka-setting",
                type=KeyValue(),
                multiple=True,
                help="librdkafka client setting for every Kafka client (TLS, SASL mechanism, ...); repeatable; "
                "merged over RLSTREAM_KAFKA_CLIENT_SETTINGS, --kafka-config and [kafka.client_settings] of --config. "
                "Not for secrets (sasl.password, ...: refused, since ps shows a command line to every user): "
                f"put those in the --kafka-config file or in {SECRETS_ENV}",
            ),
            click.option(
                "--kafka-config",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                metavar="FILE",
                help="librdkafka client properties (key=value lines, # comments; e.g. what "
                "`rlstream broker user add` writes): settings for every Kafka client, and bootstrap.servers",
            ),
            click.option(
                "--config",
                "config_file",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                help="settings file (TOML if *.toml, else JSON) with [kafka] and other sections; "
                "flags override RLSTREAM_<SECTION>_<FIELD> variables, which override the file",
            ),
        ]
        if prefix:
            opts.append(
                click.option(
                    "--prefix",
                    default=None,
                    help=prefix_help or "topic name prefix, so several runs can share a cluster",
                )
            )
        for opt in reversed(opts):
            run = opt(run)
        return run

    return decorate


def _bounded(range_type, t: msgspec.inspect.Type) -> click.ParamType:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    return range_type(lo, hi, min_open=t.gt is not None, max_open=t.lt is not None)


def click_type(f: FieldDoc) -> click.ParamType | None:
    """The click type of a scalar setting, with its bounds; None for a setting that is no flag."""
    t = f.scalar
    if isinstance(t, msgspec.inspect.BoolType):
        return click.BOOL
    if isinstance(t, msgspec.inspect.IntType):
        return _bounded(click.IntRange, t)
    if isinstance(t, msgspec.inspect.FloatType):
        return _bounded(click.FloatRange, t)
    if isinstance(t, msgspec.inspect.StrType):
        return click.STRING
    if isinstance(t, msgspec.inspect.LiteralType):
        return click.Choice([str(v) for v in t.values])
    return None


def settings_flag(cls: type[Settings], f: FieldDoc, *, hidden: bool = False, aliases: Iterable[str] = ()) -> Callable:
    """One click option for setting `f` of `cls`: its flag (and `aliases`), type, bounds, doc line and default."""
    kind = click_type(f)
    shown = f"; default: {f.default}" if f.default not in (None, "") else ""
    help_text = f"{f.doc} [env {env_name(cls, f.name)}{shown}]"
    if kind is click.BOOL:
        flag = f"{f.flag}/--no-{f.flag[2:]}"
        return click.option(flag, f.name, default=None, help=help_text, hidden=hidden)
    return click.option(f.flag, *aliases, f.name, type=kind, default=None, help=help_text, hidden=hidden)


def settings_options(
    cls: type[Settings],
    *,
    into: str,
    exclude: Iterable[str] = (),
    hidden: Iterable[str] = (),
    aliases: Mapping[str, Iterable[str]] | None = None,
) -> Callable:
    """A flag for each scalar setting of `cls`; the verb receives the ones given as a dict named `into`.

    `exclude` names settings the verb takes another way, `hidden` ones left out of the help,
    `aliases` extra flag names per setting.
    """
    fields = [f for f in fields_of(cls) if f.name not in set(exclude) and click_type(f) is not None]
    names = [f.name for f in fields]
    hidden = set(hidden)
    aliases = aliases or {}

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            given = {n: v for n in names if (v := kwargs.pop(n)) is not None}
            return fn(*args, **{into: given}, **kwargs)

        for f in reversed(fields):
            run = settings_flag(cls, f, hidden=f.name in hidden, aliases=aliases.get(f.name, ()))(run)
        return run

    return decorate


def given_flags(ctx: click.Context, *, ignore: Iterable[str] = ()) -> list[str]:
    """The options of this invocation set on the command line or by their envvar (not defaults)."""
    skip = set(ignore)
    out = []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)
        if p.name not in skip and source not in (None, click.core.ParameterSource.DEFAULT):
            out.append(p.opts[0])
    return out
