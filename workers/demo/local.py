"""What a local run (the demo, the examples) starts for itself, and how it stops all of it.

A run appends a stop function for everything it starts to one list; `stop_all` calls them newest
first and keeps going past a failing one, so a Ctrl-C or an error mid-start still stops the rest.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from streams.broker import BrokerConfig, LocalBroker


def start_local_broker(cleanups: list[Callable[[], None]], log: Callable[[str], None], *, name: str) -> str:
    """A single-node KRaft broker on a temporary directory, stopped and removed by `cleanups`; its bootstrap."""
    tmp = tempfile.TemporaryDirectory(prefix=f"rlstream-{name}-")
    cleanups.append(tmp.cleanup)
    log("starting a local Kafka broker (KRaft, single node) ...")
    broker = LocalBroker(BrokerConfig(data_dir=Path(tmp.name)), log=log).start()
    cleanups.append(broker.stop)
    return broker.bootstrap_servers


def stop_all(cleanups: list[Callable[[], None]], log: Callable[[str], None]) -> None:
    for fn in reversed(cleanups):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - keep stopping the rest
            log(f"cleanup: {type(exc).__name__}: {exc}")
