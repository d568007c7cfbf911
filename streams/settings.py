"""Settings defined once: each field's type, default, bounds and one-line doc, in one frozen struct.

A component declares `class XConfig(Settings, frozen=True)` with fields written as
`name: Annotated[T, Meta(ge=..., le=..., description="one line")] = default` and a `section` name.
Everything else derives from that one definition: the CLI flags (`workers.cli.options`), the
`[section]` of a `--config` file (TOML or JSON), the `RLSTREAM_<SECTION>_<FIELD>` environment
variables, and the bytes a parent process hands a child on stdin (never rebuilt as argv, so no
setting, secret or not, lands on a command line).

Precedence, later wins: defaults < file < environment < explicit overrides (flags). A dict-valued
setting (`KafkaConfig.client_settings`) is merged key by key along that order; in the environment it
is a JSON object, and a TOML number or boolean in a `dict[str, str]` becomes its text (`5` -> "5").
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgspec

from streams.errors import ConfigError

S = TypeVar("S", bound="Settings")
ENV_PREFIX = "RLSTREAM_"


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every component's settings; `section` names its file section and env prefix."""

    section: ClassVar[str] = ""


@dataclass(frozen=True)
class FieldDoc:
    """One setting as the CLI and the docs show it."""

    name: str
    type: Any  # a msgspec.inspect type
    default: Any
    required: bool
    doc: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def scalar(self) -> msgspec.inspect.Type:
        """The field's type with its constraints, through Annotated metadata and `| None`."""
        t = self.type
        if isinstance(t, msgspec.inspect.Metadata):
            t = t.type
        if isinstance(t, msgspec.inspect.UnionType):
            rest = [x for x in t.types if not isinstance(x, msgspec.inspect.NoneType)]
            t = rest[0] if len(rest) == 1 else t
            if isinstance(t, msgspec.inspect.Metadata):
                t = t.type
        return t

    @property
    def bounds(self) -> str:
        t = self.scalar
        parts = []
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(t, attr, None)
            if value is not None:
                parts.append(f"{sym} {value}")
        return ", ".join(parts)


def fields_of(cls: type[Settings]) -> list[FieldDoc]:
    """The settings of `cls` with their docs, in declaration order."""
    out = []
    for f in msgspec.inspect.type_info(cls).fields:
        doc = ""
        if isinstance(f.type, msgspec.inspect.Metadata):
            doc = (f.type.extra_json_schema or {}).get("description", "")
        default = f.default if f.default is not msgspec.NODEFAULT else None
        if f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        out.append(FieldDoc(f.name, f.type, default, f.required, doc))
    return out


def _scalar_field(f: FieldDoc) -> bool:
    return isinstance(
        f.scalar,
        (
            msgspec.inspect.IntType,
            msgspec.inspect.FloatType,
            msgspec.inspect.StrType,
            msgspec.inspect.BoolType,
            msgspec.inspect.LiteralType,
        ),
    )


def _dict_fields(cls: type[Settings]) -> dict[str, msgspec.inspect.DictType]:
    """The dict-valued settings of `cls` (client settings, say): merged key by key across sources."""
    return {f.name: f.scalar for f in fields_of(cls) if isinstance(f.scalar, msgspec.inspect.DictType)}


def env_name(cls: type[Settings], name: str) -> str:
    return f"{ENV_PREFIX}{cls.section.upper()}_{name.upper()}"


def from_env(cls: type[Settings], env: Mapping[str, str]) -> dict[str, Any]:
    """`RLSTREAM_<SECTION>_<FIELD>` values of the settings of `cls` that are set.

    Scalars are taken as text (converted later); a dict-valued setting is a JSON object, e.g.
    `RLSTREAM_KAFKA_CLIENT_SETTINGS='{"sasl.password": "..."}'`. An error names the variable, never its value.
    """
    out: dict[str, Any] = {}
    dicts = _dict_fields(cls)
    for f in fields_of(cls):
        name = env_name(cls, f.name)
        value = env.get(name)
        if value is None:
            continue
        if f.name in dicts:
            out[f.name] = _json_object(name, value)
        elif _scalar_field(f):
            out[f.name] = value
    return out


def _json_object(name: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise ConfigError(f"environment {name}: not valid JSON ({exc.msg} at {where}); expected an object") from None
    if not isinstance(value, dict):
        raise ConfigError(f"environment {name}: expected a JSON object of settings, got a {type(value).__name__}")
    return value


def _as_text(value: Any) -> Any:
    """A scalar from TOML or JSON as librdkafka wants it: `5` -> "5", `true` -> "true"; others unchanged."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _merge(cls: type[Settings], data: dict[str, Any], layer: Mapping[str, Any]) -> None:
    """Put one source's settings over `data`; a dict-valued setting is merged key by key, not replaced."""
    dicts = _dict_fields(cls)
    for name, value in layer.items():
        if name in dicts and isinstance(value, Mapping):
            text = isinstance(dicts[name].value_type, msgspec.inspect.StrType)
            base = data.get(name)
            merged = dict(base) if isinstance(base, Mapping) else {}
            merged.update({k: _as_text(v) if text else v for k, v in value.items()})
            data[name] = merged
        else:
            data[name] = value


def read_file(path: str | Path) -> dict[str, Any]:
    """A config file's content: TOML (`.toml`) or JSON (anything else), one table per section."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text.decode()) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise ConfigError(f"config file {path}: not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table of sections at the top level")
    return data


def convert(cls: type[S], data: Mapping[str, Any], *, source: str) -> S:
    """Validate `data` as `cls`; strings convert to numbers and booleans (they come from env and flags)."""
    try:
        return msgspec.convert(dict(data), cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{cls.section} settings ({source}): {exc}") from None


def load(
    cls: type[S],
    *,
    file: str | Path | Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> S:
    """Build `cls` from defaults, then the file's `[section]`, then the environment, then `overrides`.

    Overrides that are None are treated as not given (a flag left unset). A dict-valued setting
    (`client_settings`) is merged key by key across the sources, later ones winning per key.
    """
    data: dict[str, Any] = {}
    sources = ["defaults"]
    if file is not None:
        content = file if isinstance(file, Mapping) else read_file(file)
        section = content.get(cls.section, {})
        if not isinstance(section, Mapping):
            raise ConfigError(f"config file {file}: [{cls.section}] must be a table")
        _merge(cls, data, section)
        sources.append(f"file {file}" if not isinstance(file, Mapping) else "file")
    found = from_env(cls, os.environ if env is None else env)
    if found:
        _merge(cls, data, found)
        sources.append("environment " + ", ".join(env_name(cls, k) for k in found))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if given:
        _merge(cls, data, given)
        sources.append("flags")
    return convert(cls, data, source=" < ".join(sources))


def encode(settings: Settings) -> bytes:
    """The whole settings as JSON, for a child process's stdin."""
    return msgspec.json.encode(settings)


def decode(cls: type[S], data: bytes) -> S:
    try:
        return msgspec.json.decode(data, type=cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{cls.section} settings from the parent process: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{cls.section} settings from the parent process: not JSON ({exc})") from None
