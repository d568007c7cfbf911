"""verl's whole-TQ checkpoint and shutdown, kept off rlstream's partitions when both share one TQ.

verl 0.9.1 treats TransferQueue as its own (transfer_queue 0.1.11, ``interface.py``/``controller.py``):

- ``tq.save_checkpoint(dir)`` (``_save_checkpoint``, async trainer modes) snapshots every partition and
  every storage unit, rlstream's ``rlstream.staging``/``rlstream.train`` included;
- ``tq.load_checkpoint(dir)`` (``_load_checkpoint`` on resume) replaces the controller's partitions,
  its index allocator and each storage unit's data wholesale: rlstream's partitions go back to the
  save while rlstream's Kafka offsets have moved on (rows staged since vanish, rows cleared since
  come back);
- ``tq.close()`` (``TaskRunnerV1.run``'s ``finally``, every mode) kills the controller even in a
  process that only attached to it: every rlstream worker loses its TQ.

`install()` replaces those three in the process that runs verl's trainer (the replay buffer calls it
when verl builds it) and in the ``transfer_queue`` module verl reads them from at call time:

- save writes ``rlstream_tq_skipped.json`` instead of a snapshot. With rlstream's replay buffer,
  nothing verl keeps in its own partitions is worth restoring (the rows of a step are re-delivered
  by rlstream, its exactly-once state is the consumer's, saved by the checkpoint callback), while a
  snapshot would copy rlstream's staging into every checkpoint. TQ's own loader refuses the
  directory (no ``metadata.json``), so a run without the guard cannot rewind from it by accident;
- load restores nothing: verl's in-flight prompts are re-issued from the live TQ if it outlived
  the crash (``_reissue_inflight_prompts`` reads the partition, not the checkpoint);
- close closes this process's client only; the controller and storage units stay for rlstream.

Deployment: rlstream creates the TQ (its pipeline process) before verl starts, so verl's ``tq.init``
attaches. A TQ that verl's own process created is owned by that Ray actor and dies with it, guard or
not; `install` logs a warning then.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rlstream.adapters.verl")

GUARDED = ("save_checkpoint", "load_checkpoint", "close")
SKIPPED_MARKER = "rlstream_tq_skipped.json"
_originals: dict[str, Callable[..., Any]] = {}


def save_checkpoint(checkpoint_dir: str, *, include_storage: bool = True, metadata: dict | None = None) -> None:
    """verl's TQ snapshot, replaced by a marker naming why (module doc)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    marker = {
        "skipped_by": "rlstream",
        "why": "rlstream's partitions share this TQ; verl's replay buffer is rlstream's, whose state is saved"
        " beside this checkpoint by the rlstream checkpoint callback",
        "user_metadata": metadata or {},
    }
    with open(os.path.join(checkpoint_dir, SKIPPED_MARKER), "w") as f:
        json.dump(marker, f)


def load_checkpoint(checkpoint_dir: str) -> None:
    """Nothing to restore: loading a whole-TQ snapshot would rewind rlstream's partitions (module doc)."""
    log.info("verl's TQ checkpoint %s not loaded: rlstream's partitions in this TQ must not be rewound", checkpoint_dir)


def close() -> None:
    """Close this process's TQ client only; the controller and the storage units outlive it."""
    from transfer_queue import interface

    client = interface._TQ_CLIENT
    if client is not None:
        client.close()
    interface._TQ_CLIENT = None
    # The controller's handle stays: in the process that created it, dropping the last handle makes
    # Ray destroy the actor as surely as ray.kill does.


_GUARDS: dict[str, Callable[..., Any]] = {
    "save_checkpoint": save_checkpoint,
    "load_checkpoint": load_checkpoint,
    "close": close,
}


def installed() -> bool:
    import transfer_queue

    return all(getattr(transfer_queue, name) is _GUARDS[name] for name in GUARDED)


def install() -> None:
    """Put the guards in place of TQ's save_checkpoint, load_checkpoint and close (idempotent)."""
    import transfer_queue
    from transfer_queue import interface

    if installed():
        return
    if interface._TQ_STORAGE:
        log.warning(
            "this process created the TransferQueue: it dies with this process, rlstream's partitions with it;"
            " start rlstream's TQ first so that verl attaches to it"
        )
    for name in GUARDED:
        _originals.setdefault(name, getattr(interface, name))
        # verl resolves `tq.<name>` on the package at call time; the interface module for anyone else.
        setattr(transfer_queue, name, _GUARDS[name])
        setattr(interface, name, _GUARDS[name])


def uninstall() -> None:
    """TQ's own functions back (tests)."""
    import transfer_queue
    from transfer_queue import interface

    for name, original in _originals.items():
        setattr(transfer_queue, name, original)
        setattr(interface, name, original)
    _originals.clear()
