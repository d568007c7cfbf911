"""TransferQueue on Ray: starting it or attaching to it, sized for where it runs, and bounding its calls.

`init_tq` starts or attaches to Ray, then creates or attaches to TQ's controller and storage units;
`TQConfig` says where and how big. The KV client the workers use is `streams.tq` (which re-exports
these names, so `from streams.tq import TQConfig, init_tq` keeps working).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Literal

import psutil

from streams.errors import TQError
from streams.pids import record_pid


@dataclass(frozen=True)
class TQProfile:
    """TQ's sizing for one kind of deployment: what a `TQConfig` field left None takes."""

    num_storage_units: int
    client_io_threads: int  # TQ_CLIENT_ZMQ_IO_THREADS: libzmq I/O threads of each process's TQ client
    num_threads: int | None  # TQ_NUM_THREADS: torch threads in TQ's put/get; None: physical cores, at most 8


# Cluster defaults: TQ's own (8 client I/O threads), storage spread over two units (and nodes).
CLUSTER = TQProfile(num_storage_units=2, client_io_threads=8, num_threads=None)
# One node, chosen by measurement (bench/dataplane, docs/DESIGN.md "TQ settings"): every
# process on the machine shares its cores, so one storage unit (each put, get and clear is then one
# storage request, a dense field is never sliced with a step, one process fewer) and one I/O and
# torch thread per client (8 I/O threads in each of the publisher, reassembler and trainer
# processes only compete for the cores the bytes need).
SINGLE_NODE = TQProfile(num_storage_units=1, client_io_threads=1, num_threads=1)


@dataclass(frozen=True)
class TQConfig:
    """How to reach Ray and size TQ; address None starts a new local Ray unless this process has one.

    The sizing fields left None follow `profile`: "auto" takes `SINGLE_NODE` when this process
    starts Ray itself or attaches to a one-node cluster, `CLUSTER` otherwise. A TQ_* environment
    variable already set (by the operator, or by the parent that started this process) wins over a
    profile; an explicit field wins over both.
    """

    address: str | None = None
    num_storage_units: int | None = None
    client_io_threads: int | None = None
    num_threads: int | None = None
    profile: Literal["auto", "single_node", "cluster"] = "auto"
    # TQ's controller and each storage unit ask Ray for one CPU, and reassembler actors one each;
    # logical CPUs above the physical count only oversubscribe cores that mostly wait on I/O.
    num_cpus: int = 16
    namespace: str = "rlstream"
    # TQ pins its storage units round-robin over the alive Ray nodes (sorted by node id) that offer
    # this custom resource; None: every alive node, so N units on k nodes put N/k on each.
    storage_node_resource: str | None = None
    # The longest one storage-unit request (put, get, clear) of this process may take, all of its
    # attempts together; None keeps TQ's own (200 s, three times). A reassembler process bounds it
    # (reassembler/run.py) beside the deadline of every call its store makes (`with_call_deadline`).
    call_budget_s: float | None = None


def _physical_threads() -> int:
    # TQ warns on every call when TQ_NUM_THREADS exceeds the physical cores.
    return max(1, min(8, psutil.cpu_count(logical=False) or 1))


def _apply_client_settings(config: TQConfig, profile: TQProfile) -> dict[str, str]:
    """Resolve TQ's per-process settings (field > environment > profile) into os.environ; returns them.

    TQ reads them at import: set before `transfer_queue` is imported, or patched in its client
    module when something imported it earlier (its client is created later, by `tq.init`).
    """
    wanted = {
        "TQ_CLIENT_ZMQ_IO_THREADS": (config.client_io_threads, profile.client_io_threads),
        "TQ_NUM_THREADS": (config.num_threads, profile.num_threads or _physical_threads()),
    }
    settings = {}
    for name, (explicit, default) in wanted.items():
        value = str(explicit) if explicit is not None else os.environ.get(name) or str(default)
        if int(value) < 1:
            raise TQError(f"{name} must be at least 1, got {value}")
        os.environ[name] = settings[name] = value
    client = sys.modules.get("transfer_queue.client")
    if client is not None:
        client.TQ_CLIENT_ZMQ_IO_THREADS = int(settings["TQ_CLIENT_ZMQ_IO_THREADS"])
        client.TQ_NUM_THREADS = int(settings["TQ_NUM_THREADS"])
    return settings


def _profile(config: TQConfig, single_node: bool) -> TQProfile:
    if config.profile == "single_node" or (config.profile == "auto" and single_node):
        return SINGLE_NODE
    return CLUSTER


class TQSession:
    """Ray and TQ as started or attached by `init_tq`; `close` stops only what this process started."""

    def __init__(self, started_ray: bool, started_tq: bool):
        self.started_ray = started_ray
        self.started_tq = started_tq

    def close(self) -> None:
        import ray
        import transfer_queue as tq

        if self.started_tq:
            tq.close()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


# Attempts of one storage-unit request when its budget is bounded: one retry on a fresh connection.
BOUNDED_ATTEMPTS = 2


def bound_tq_calls(budget_s: float) -> None:
    """Make every storage-unit request of this process give up within `budget_s`, retries included.

    TQ reads these settings when its storage module is imported (the attempts at each request, the
    timeout when its client is created): in a process that imported TQ already, its module's copies
    are set too. Run it before `init_tq` creates the client.
    """
    if budget_s <= 0:
        raise ValueError(f"a TQ call budget must be positive, got {budget_s}")
    settings = {
        "TQ_SIMPLE_STORAGE_MAX_ATTEMPTS": BOUNDED_ATTEMPTS,
        "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT": max(1, int(budget_s / BOUNDED_ATTEMPTS)),
    }
    storage = sys.modules.get("transfer_queue.storage.managers.simple_storage_manager")
    for name, value in settings.items():
        os.environ[name] = str(value)
        if storage is not None:
            setattr(storage, name, value)


def set_torch_threads(threads: int) -> None:
    """This process's torch intra-op threads, and the count TQ's put and get restore after their own.

    TQ sets torch's threads to its `TQ_NUM_THREADS` for each put and get and then back to the count
    it saw when it was imported: in a process that imported TQ already, that count is set too, or
    every TQ call would undo this one.
    """
    import torch

    if threads < 1:
        raise ValueError(f"torch threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)
    common = sys.modules.get("transfer_queue.utils.common")
    if common is not None:
        common.DEFAULT_TORCH_NUM_THREADS = threads


def init_tq(config: TQConfig = TQConfig()) -> TQSession:
    """Start or attach to Ray, then create or attach to the TQ controller and its storage units."""
    if config.call_budget_s is not None:
        bound_tq_calls(config.call_budget_s)
    import ray

    started_ray = False
    if not ray.is_initialized():
        local = config.address is None
        # Ray actors (TQ's controller and storage units) take the job's environment.
        env = {"env_vars": _apply_client_settings(config, _profile(config, single_node=local))}
        if not local:
            _attach(ray, config, env)
        else:
            # Ray turns token authentication on for a new local cluster and says so as a WARNING
            # on every start, which a user of rlstream can do nothing about: that one logger of
            # Ray's only speaks from ERROR up. Authentication itself is unchanged.
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
            ray.init(
                # "local", never a cluster found on the machine: this process owns what it starts.
                address="local",
                num_cpus=config.num_cpus,
                include_dashboard=False,
                namespace=config.namespace,
                runtime_env=env,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
            started_ray = True
            _record_ray_pids()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    profile = _profile(config, single_node=len(alive) <= 1)
    _apply_client_settings(config, profile)
    import transfer_queue as tq
    from transfer_queue import interface

    logging.getLogger("transfer_queue").setLevel(logging.ERROR)
    had_controller = _controller_exists()
    units = config.num_storage_units if config.num_storage_units is not None else profile.num_storage_units
    storage = {"num_data_storage_units": units}
    if config.storage_node_resource is not None:
        if not had_controller:
            # Before TQ creates its controller: a controller left without storage hangs every attach.
            nodes_offering(config.storage_node_resource)
        storage["required_node_resource"] = config.storage_node_resource
    tq.init({"backend": {"SimpleStorage": storage}})
    return TQSession(started_ray, started_tq=not had_controller and interface._TQ_STORAGE is not None)


def _attach(ray, config: TQConfig, env: dict) -> None:
    try:
        ray.init(
            address=config.address,
            namespace=config.namespace,
            runtime_env=env,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    except ConnectionError as exc:
        raise TQError(f"cannot reach Ray at {config.address!r}: {str(exc).splitlines()[0]}") from None


def _record_ray_pids() -> None:
    # Ray's own daemons (GCS, raylet, log monitor, ...) of the instance this process just started.
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    for infos in (getattr(node, "all_processes", None) or {}).values():
        for info in infos:
            pid = getattr(getattr(info, "process", None), "pid", None)
            if pid:
                record_pid("ray", pid)


def _controller_exists() -> bool:
    import ray

    try:
        ray.get_actor("TransferQueueController", namespace="transfer_queue")
        return True
    except ValueError:
        return False


def nodes_offering(resource: str) -> list[str]:
    """Ids of the alive Ray nodes that offer custom `resource`; TQError if none does (Ray must be attached)."""
    import ray

    found = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(resource, 0) > 0)
    if not found:
        raise TQError(
            f"no alive Ray node offers custom resource {resource!r}: start the nodes meant to host it with "
            f"ray start --resources '{{\"{resource}\": 1}}'"
        )
    return found


def ray_address() -> str:
    """The address another process uses to attach to the running Ray instance."""
    import ray

    return ray.get_runtime_context().gcs_address


def start_tq_metrics(port: int = 0) -> str:
    """`host:port` of TQ's own Prometheus exporter (`tq_*` metrics: rows per partition, storage units),
    started in its controller on `port` (0: a free one) unless it runs already (TQ's call is idempotent).

    After `init_tq`, from the process that created TQ or one attached to it. The endpoint lives as long
    as the controller, on the controller's node; its figures refresh every TQ_METRICS_COLLECT_INTERVAL
    seconds (TQ's, default 10).
    """
    import ray

    try:
        controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    except ValueError:
        raise TQError("no TransferQueue controller runs in this Ray cluster: init_tq first") from None
    return str(ray.get(controller.start_metrics.remote(port=port), timeout=60))
