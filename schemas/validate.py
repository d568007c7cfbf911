"""Field checks shared by the message types; each raises SchemaError naming the field."""

from __future__ import annotations

import math
from collections.abc import Iterable

from schemas.errors import SchemaError


def non_empty(path: str, value: str) -> None:
    """Reject an empty string (ids must identify something)."""
    if not value:
        raise SchemaError(path, "must be a non-empty string")


def optional_non_empty(path: str, value: str | None) -> None:
    """Reject an empty string while allowing None."""
    if value is not None and not value:
        raise SchemaError(path, "must be None or a non-empty string")


def at_least(path: str, value: int | float, low: int | float) -> None:
    """Reject a value below `low`."""
    if not value >= low:
        raise SchemaError(path, f"must be >= {low}, got {value!r}")


def finite(path: str, value: float) -> None:
    """Reject NaN and +/-inf."""
    if not math.isfinite(value):
        raise SchemaError(path, f"must be finite, got {value!r}")


def all_finite(path: str, values: dict[str, float]) -> None:
    """Reject a mapping holding a NaN or infinite value, naming its key."""
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise SchemaError(f'{path}["{key}"]', f"must be finite, got {value!r}")


def same_length(owner: str, names: Iterable[str], values: Iterable[tuple]) -> None:
    """Reject parallel tuples of different lengths, naming the first that disagrees."""
    names, values = list(names), list(values)
    expected = len(values[0])
    for name, value in zip(names[1:], values[1:]):
        if len(value) != expected:
            raise SchemaError(
                f"{owner}.{name}",
                f"has {len(value)} entries but {names[0]} has {expected}",
            )
