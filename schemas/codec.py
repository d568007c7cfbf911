"""MessagePack codec with a schema version: the base `Message` struct plus `encode` and `decode`.

Every message is one MessagePack map holding its fields, `"kind"` and `"schema_version": [major,
minor]`. Decoding rejects another major version, tolerates a higher minor and unknown fields, and
raises only `SchemaError`.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from schemas.errors import SchemaError

SCHEMA_VERSION: tuple[int, int] = (1, 0)
MAX_MESSAGE_BYTES = 1 << 20


T = TypeVar("T", bound="Message")


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every wire message; subclasses set `tag=<kind>` and implement `_validate`."""

    schema_version: tuple[int, int] = SCHEMA_VERSION

    # Frozen structs with a __post_init__ cost one Python call per message; it is the single place
    # where both constructors and the decoder validate values (msgspec has already checked types).
    def __post_init__(self) -> None:
        major = self.schema_version[0]
        if major != SCHEMA_VERSION[0]:
            raise SchemaError(
                f"{self.kind()}.schema_version",
                f"unsupported major version {major} (this reader speaks {SCHEMA_VERSION[0]}.x)",
            )
        self._validate()

    def _validate(self) -> None:
        """Check values beyond their types; raise SchemaError with the field path."""

    @classmethod
    def kind(cls) -> str:
        """The `"kind"` string this message carries on the wire."""
        return cls.__struct_config__.tag

    def to_bytes(self) -> bytes:
        """Encode as one MessagePack map."""
        return _ENCODER.encode(self)

    @classmethod
    def from_bytes(cls: type[T], data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> T:
        """Decode and validate; raises SchemaError only."""
        return decode(data, cls, max_bytes=max_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able builtins for printing: tuples become lists, bytes become base64 strings."""
        return _lists(msgspec.to_builtins(self))


class _Header(msgspec.Struct):
    # Read first so that a message of another major version is reported as such even when its
    # fields no longer match this reader's types.
    kind: str
    schema_version: tuple[int, int]


_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(_Header)
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}
_AT = re.compile(r"^(?P<reason>.*?)(?: - at `\$(?P<loc>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def encode(msg: Message) -> bytes:
    """Encode any message as one MessagePack map."""
    if not isinstance(msg, Message):
        raise TypeError(f"expected a schemas Message, got {type(msg).__name__}")
    return _ENCODER.encode(msg)


def decode(data: bytes, cls: type[T], *, max_bytes: int = MAX_MESSAGE_BYTES) -> T:
    """Decode `data` as a `cls` message, raising SchemaError (and nothing else) on any problem."""
    kind = cls.kind()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError(kind, f"expected bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > max_bytes:
        # Checked before parsing so that an oversized payload costs nothing to refuse.
        raise SchemaError(kind, f"message of {size} bytes exceeds the limit of {max_bytes} bytes")
    try:
        header = _HEADER_DECODER.decode(data)
    except Exception as exc:  # noqa: BLE001 - the contract is "only SchemaError escapes"
        raise _schema_error(kind, exc) from exc
    if header.schema_version[0] != SCHEMA_VERSION[0]:
        raise SchemaError(
            f"{kind}.schema_version",
            f"unsupported major version {header.schema_version[0]} (this reader speaks {SCHEMA_VERSION[0]}.x)",
        )
    if header.kind != kind:
        raise SchemaError(f"{kind}.kind", f"expected {kind!r}, got {header.kind!r}")
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    try:
        return decoder.decode(data)
    except Exception as exc:  # noqa: BLE001
        raise _schema_error(kind, exc) from exc


def _lists(value: Any) -> Any:
    # to_builtins keeps tuples; lists make to_dict() equal to what JSON or msgpack gives back.
    if isinstance(value, (tuple, list)):
        return [_lists(item) for item in value]
    if isinstance(value, dict):
        return {key: _lists(item) for key, item in value.items()}
    return value


def _schema_error(kind: str, exc: BaseException) -> SchemaError:
    """Translate a msgspec (or any) failure into a SchemaError with a dotted field path."""
    if isinstance(exc, SchemaError):
        return exc
    if not isinstance(exc, msgspec.MsgspecError):
        return SchemaError(kind, f"{type(exc).__name__}: {exc}")
    match = _AT.match(str(exc))
    reason, loc = match.group("reason"), match.group("loc") or ""
    cause = exc.__cause__
    if isinstance(cause, SchemaError):
        # Raised by a struct's own validation: its path starts with that struct's label, which the
        # location msgspec reports replaces.
        _, _, rest = cause.path.partition(".")
        return SchemaError(f"{kind}{loc}.{rest}" if rest else f"{kind}{loc}", cause.reason)
    missing = _MISSING.search(reason)
    if missing:
        return SchemaError(f"{kind}{loc}.{missing.group('field')}", "missing required field")
    return SchemaError(f"{kind}{loc}", reason)
