"""NeMo Gym staged calls read back from TQ staging, for the reassembler and for NeMo Gym's `StagingSource`.

A row's tags say which fields it holds (`schemas.staged_rows.gym_fields`: its token columns, its
extras when it has any, its attachments); a reader selects only those it uses (the reassembler:
tokens and attachments, never extras), and one TQ get reads the rows of one field set: a get of
rows that differ in their fields would be refused, and text calls (tokens only) are usually most
of a step's. A row is returned as a `GymStagedRow`, or as the reason it cannot be read as one (a
string: the receipt's row is then `invalid_staging_row`); an absent row is left out (missing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from schemas.gym_receipt import GymReceipt
from schemas.staged_rows import GymStagedRow, gym_fields, gym_staged_row, gym_tags_problem
from streams.tq import KVStore
from workers.reassembler.staged_fetch import get_present

GymRows = dict[str, GymStagedRow | str]


def is_gym(receipt: Any) -> bool:
    """Whether a receipt is NeMo Gym's: its staged calls are read as NeMo Gym rows, not rlstream's."""
    return isinstance(receipt, GymReceipt)


def fetch_gym_rows(
    store: KVStore,
    staging_partition: str,
    keys: Sequence[str],
    tags: Mapping[str, Mapping[str, Any] | None],
    *,
    extras: bool = False,
    attachments: bool = True,
    unread: set[str] | None = None,
) -> GymRows:
    """The staged calls under `keys` whose `tags` (as looked up) were found; one get per field set.
    Keys the store then reported missing are left out and added to `unread` (when given).

    Only what is asked for is read: the token columns always, the attachments (the media a row is
    built with) unless `attachments` is False, the extras (which no row field comes from) only with
    `extras`.
    """
    read = {"extras": extras, "attachments": attachments}
    out: GymRows = {}
    by_fields: dict[tuple[str, ...], list[str]] = {}
    for key in dict.fromkeys(keys):
        tag = tags.get(key)
        if tag is None:
            continue
        problem = gym_tags_problem(tag)
        if problem is not None:
            out[key] = problem
            continue
        by_fields.setdefault(gym_fields(tag, **read), []).append(key)
    for fields, same in by_fields.items():
        out.update(_read(store, staging_partition, same, fields, tags, read, unread))
    return out


def _read(
    store: KVStore,
    partition: str,
    keys: list[str],
    fields: tuple[str, ...],
    tags: Mapping[str, Mapping[str, Any] | None],
    read: Mapping[str, bool],
    unread: set[str] | None,
    *,
    whole: bool = True,
) -> GymRows:
    try:
        keys, td = get_present(store, partition, keys, fields, unread)
    except ValueError as exc:
        # Rows the store cannot give as their tags describe them: input, not a fault.
        if not whole:
            return {keys[0]: f"its fields cannot be read ({exc})"}
        out: GymRows = {}
        for key in keys:
            out.update(_read(store, partition, [key], fields, tags, read, unread, whole=False))
        return out
    if not keys:
        return {}
    if any(td.get(name, None) is None for name in fields):
        return {key: "its fields are not the ones its tags name" for key in keys}
    columns = {name: _rows(td.get(name)) for name in fields}
    return {
        key: _row(tags[key] or {}, {name: col[i] for name, col in columns.items()}, read) for i, key in enumerate(keys)
    }


def _row(tags: Mapping[str, Any], fields: Mapping[str, Any], read: Mapping[str, bool]) -> GymStagedRow | str:
    # Runs in the fetch phase, outside any group's build: what the checks of `gym_staged_row` did not
    # foresee must still reject this one row (invalid_staging_row), not crash-loop the worker.
    try:
        return gym_staged_row(tags, fields, **read)
    except Exception as exc:  # noqa: BLE001 - a staged row is input
        return f"it cannot be read ({type(exc).__name__}: {exc})"


def _rows(value: Any) -> list:
    return list(value.unbind()) if value.is_nested else list(value)
