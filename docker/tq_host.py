"""Host TransferQueue on the Ray head for as long as this process runs (the image's `ray-head` mode).

TQ pins its storage units to the Ray nodes that are alive when its controller is created, and a Ray
actor lives only as long as the process that created it. So this runs on the head right after
`ray start --head`, before any other node joins, and stays in the foreground: every rlstream process
that attaches later (reassemblers, the demo, a trainer) finds the controller and its storage here,
never on a container that may restart. It writes --ready-file once TQ is up (the compose
healthcheck) and exits 1 when the controller disappears, so the container restarts. With
--metrics-port (or RLSTREAM_TQ_METRICS_PORT) it starts TQ's own Prometheus exporter on that port.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="auto", help="Ray cluster to attach to (default: the local head)")
    parser.add_argument("--ready-file", type=Path, help="touch this file once TQ is up")
    parser.add_argument("--check-every-s", type=float, default=10.0, help="how often to check the TQ controller")
    port = os.environ.get("RLSTREAM_TQ_METRICS_PORT")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(port) if port else None,
        help="serve TQ's Prometheus metrics on this port (default: $RLSTREAM_TQ_METRICS_PORT, else none)",
    )
    args = parser.parse_args(argv)

    import ray

    from streams.tq import TQConfig, init_tq, start_tq_metrics

    session = init_tq(TQConfig(address=args.address))
    if args.metrics_port is not None:
        print(f"TQ metrics: http://{start_tq_metrics(args.metrics_port)}/metrics", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.ready_file is not None:
        args.ready_file.touch()
    print("TransferQueue is up on this Ray head", flush=True)
    try:
        while not stop.wait(args.check_every_s):
            try:
                ray.get_actor("TransferQueueController", namespace="transfer_queue")
            except Exception as exc:  # noqa: BLE001 - any failure to find it means TQ is gone
                print(f"TransferQueue controller is gone ({type(exc).__name__}); exiting", file=sys.stderr)
                return 1
    finally:
        if args.ready_file is not None:
            args.ready_file.unlink(missing_ok=True)
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
