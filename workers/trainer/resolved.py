"""What a checkpoint keeps of the trainer's memory of resolved groups, so a restored trainer drops duplicates.

A trainer drops a duplicate (a second finalized record of a group id) against the groups it
remembers resolved (`PendingGroups`, up to `max_seen_groups`). A trainer restored from a checkpoint
starts each partition at the checkpoint's cut and never reads the records before it again, so
without that memory a duplicate past the cut of a group resolved before it is a new group whose
rows are gone: handed back and trained twice. So `save_into_checkpoint` writes the remembered groups
as they stood at the cut into `rlstream-resolved` (`schemas/spill.py` `ResolvedGroups` messages,
framed like the spill, the last one marked, bound to the state by its run and cut), and
`load_state` gives them to `ExperienceConsumer.load_state_dict`. A checkpoint written before this
file existed has none; `resume` then finds such groups by reading the finalized topic from its
start, and writes the file for the restored trainer.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from schemas.errors import SchemaError
from schemas.spill import FRAME, INDEX_ENTRIES, ResolvedGroups
from workers.trainer.errors import SpillError

RESOLVED_FILE = "rlstream-resolved"
# Most resolved groups a message holds: 65,536 of them are a few MB.
_PER_MESSAGE = INDEX_ENTRIES


def write_resolved(directory: str | Path, binding: str, groups: Iterable[tuple[str, int, int]]) -> int:
    """Write `groups` (group id, partition, offset) into `directory`'s resolved file, replaced whole; bytes written."""
    path = Path(directory) / RESOLVED_FILE
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    it = iter(groups)
    with open(tmp, "wb") as f:
        part = list(itertools.islice(it, _PER_MESSAGE))
        while True:
            following = list(itertools.islice(it, _PER_MESSAGE))
            msg = ResolvedGroups(
                binding=binding,
                group_ids=tuple(g for g, _, _ in part),
                partitions=tuple(p for _, p, _ in part),
                offsets=tuple(o for _, _, o in part),
                last=not following,
            )
            data = msg.to_bytes()
            f.write(FRAME.pack(len(data)))
            f.write(data)
            written += FRAME.size + len(data)
            if not following:
                break
            part = following
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_dir(path.parent)  # the rename itself, so a crash after it cannot leave the old file or none
    return written


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def has_resolved(directory: str | Path) -> bool:
    return (Path(directory) / RESOLVED_FILE).exists()


def read_resolved(directory: str | Path, binding: str) -> Iterator[tuple[str, int, int]]:
    """The resolved groups in `directory`'s file, a message at a time; SpillError when it is missing,
    cut short, undecodable or bound to another checkpoint."""
    path = Path(directory) / RESOLVED_FILE
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, also when the reader stops early
    except OSError as exc:
        raise SpillError(f"{path}: cannot read the resolved groups ({exc.strerror or exc})") from None
    with f:
        last = False
        while not last:
            head = f.read(FRAME.size)
            if len(head) < FRAME.size:
                raise SpillError(f"{path}: cut short (its last message is missing)")
            (n,) = FRAME.unpack(head)
            data = f.read(n)
            if len(data) < n:
                raise SpillError(f"{path}: cut short in a message of {n} bytes")
            try:
                msg = ResolvedGroups.from_bytes(data, max_bytes=max(n, 1))
            except SchemaError as exc:
                raise SpillError(f"{path}: {exc}") from None
            if msg.binding != binding:
                raise SpillError(f"{path}: written for checkpoint {msg.binding!r}, not {binding!r}")
            yield from zip(msg.group_ids, msg.partitions, msg.offsets)
            last = msg.last
        if f.read(1):
            raise SpillError(f"{path}: bytes after its last message")
