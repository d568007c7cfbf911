"""The seed's Ray face: `RolloutReassemblerActor` and `create_rollout_reassembler_actors`.

An actor owns a connect-only TQ client. It finalizes one metadata-only request at a time over RPC,
runs TQ checkpoint commands owner-locally, and can run the Kafka worker loop, so a Ray pool of
actors is a consumer group. A request's receipts may be rlstream's, or NeMo Gym `RolloutReceipt`
dicts as the seed's `ReassemblyRequest` carries them (their group fields come from the request).
Ray restarts an actor whose process dies and retries the calls that were in flight on it (see
`RolloutReassemblerActor` for why each method may run again). No Kafka secret travels through Ray:
`start_worker` hands an actor its settings without them, and the actor reads them on its node
(`workers.actors.kafka_secrets`).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas.errors import RlstreamError, SchemaError
from schemas.finalized import FinalizedGroup
from schemas.gym_receipt import GymReceipt, GymRolloutReceipt
from schemas.metadata_guard import assert_metadata_only
from schemas.receipt import Receipt
from schemas.request import ReassemblyRequest, RolloutReassemblerActorConfig
from schemas.staged_rows import sample_id
from streams.config import KafkaConfig
from streams.tq import TQConfig, nodes_offering
from workers.actors.kafka_secrets import NO_FILES, KafkaFiles, NodeKafka, for_actors

# How often Ray restarts a dead actor (its process killed or its node lost) before it stays dead, and
# how often a call in flight on it is retried on the restarted actor (-1: as long as it restarts).
MAX_RESTARTS = 10
MAX_TASK_RETRIES = -1
# What an actor asks of the custom resource that marks the nodes it may run on (1/1000 of a unit).
NODE_RESOURCE_SHARE = 0.001


# NeMo Gym's finalization API, as the seed's check_dependencies imports it (nemo-gym 0.7.0).
NEMO_GYM_INSTALL = "pip install --no-deps --ignore-requires-python nemo-gym==0.7.0 orjson"


@dataclass(frozen=True)
class DataPlaneConfig:
    """How an actor reaches the data plane (the Ray/TQ address), what it must be able to import, and
    how its RPC finalize treats a group with no valid rollout.

    `nemo_gym`: the actors finalize NeMo Gym receipts, so `check_dependencies` imports NeMo Gym's
    staging API and checks this process agrees with its golden vectors (rlstream verifies with its
    own `schemas.gym_verify`, held to NeMo Gym's). `placeholder_groups`: a group with no valid
    rollout comes back as masked placeholder rows (NeMo RL's way) instead of an error.
    """

    tq: TQConfig = TQConfig()
    required_modules: tuple[str, ...] = (
        "transfer_queue",
        "tensordict",
        "schemas.group_build",
        "workers.reassembler.finalize",
    )
    nemo_gym: bool = False
    placeholder_groups: bool = False


class RolloutReassemblerActor:
    """Own a connect-only TQ client and a lightweight finalizer in one process.

    After a restart Ray constructs the actor again from the same arguments and retries the calls that
    were in flight; each is safe to run again. The TQ client attaches on first use. A `run_worker`
    that was running starts the Kafka loop again under the same worker id: the new producer fences
    the dead one's transactional id (its open transaction is aborted) and every partition is restored
    from the committed offsets and the state topic, so nothing is lost or emitted twice. `finalize`
    puts rows idempotently under deterministic sample ids; a checkpoint save or load repeats;
    `check_dependencies` and `stop_worker` are idempotent. A call that raised is not retried.

    With `metrics_port`, the actor serves its worker loop's Prometheus metrics on that port (0: a free
    one, see `metrics_endpoint`) from its construction, so a restarted actor serves them again.
    """

    def __init__(
        self, dp_config: DataPlaneConfig, config: RolloutReassemblerActorConfig, metrics_port: int | None = None
    ):
        self.dp_config = dp_config
        self.config = config
        self._store = None
        self._stop = threading.Event()
        self._metrics: str | None = None
        if metrics_port is not None:
            import ray

            from workers.telemetry.prometheus import start_metrics_server

            port = start_metrics_server(metrics_port)
            self._metrics = f"{ray.util.get_node_ip_address()}:{port}"

    def metrics_endpoint(self) -> str | None:
        """`host:port` of this actor's /metrics, None when it serves none."""
        return self._metrics

    def _tq(self):
        if self._store is None:
            from streams.tq import TQStore, init_tq

            init_tq(self.dp_config.tq)
            self._store = TQStore()
        return self._store

    def check_dependencies(self) -> None:
        """Import the finalization API and attach to TQ before the controller starts rollouts."""
        for name in self.dp_config.required_modules:
            importlib.import_module(name)
        if self.dp_config.nemo_gym:
            check_nemo_gym()
        self._tq()

    def finalize(self, request: ReassemblyRequest) -> FinalizedGroup:
        """Finalize one request without allowing tensor payloads across Ray RPC."""
        assert_metadata_only(request, path="rpc")
        from workers.reassembler.finalize import finalize_groups

        group = request_group(request)
        (outcome,) = finalize_groups(
            self._tq(),
            [group],
            self.config,
            receipts_topic="rpc",
            now_ms=0,
            placeholder_groups=self.dp_config.placeholder_groups,
        )
        if outcome.finalized is None:
            raise ValueError(f"group {request.group_id}: {outcome.dead_letter_message}")
        result = outcome.finalized
        assert_metadata_only(result, path="result")
        return result

    def mooncake_checkpoint(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Run an owner-local TQ checkpoint command ({"op": "save"|"load", "path": ...}); return metadata only."""
        assert_metadata_only(body, path="body")
        import transfer_queue as tq

        self._tq()
        op, path = body.get("op"), body.get("path")
        if op not in ("save", "load") or not isinstance(path, str) or not path:
            raise ValueError(f"checkpoint body needs op 'save' or 'load' and a path, got {body!r}")
        if op == "save":
            tq.save_checkpoint(path, metadata=body.get("metadata") or {})
        else:
            tq.load_checkpoint(path)
        result = {"op": op, "path": path, "ok": True}
        assert_metadata_only(result, path="result")
        return result

    def check_kafka(self, kafka: NodeKafka) -> list[str]:
        """The names of the Kafka client settings this actor has on its node (secrets read here), never values;
        ConfigError if a secret named is not found on the node."""
        return sorted(kafka.resolve().client_settings)

    def run_worker(self, kafka: NodeKafka | KafkaConfig, worker_config) -> dict[str, Any]:
        """Run the Kafka reassembler loop (a `ReassemblerConfig`) in this actor until `stop_worker`.

        `kafka` comes without secrets (`start_worker`, `kafka_secrets.for_actors`): they are read on this
        node, since Ray records a call's arguments. A `KafkaConfig` holding one is refused.
        """
        from workers.reassembler.worker import ReassemblerWorker
        from workers.telemetry.sensors import ReassemblerStats, fan_out

        if isinstance(kafka, KafkaConfig):
            kafka = NodeKafka(kafka)  # refuses secrets: the caller must not hand them over Ray
        stats = ReassemblerStats()
        sensor = stats
        if self._metrics is not None:
            from workers.telemetry.prometheus import PrometheusReassemblerSensor

            sensor = fan_out(stats, PrometheusReassemblerSensor(prefix=worker_config.prefix))
        worker = ReassemblerWorker(kafka.resolve(), self._tq(), worker_config, sensor=sensor)
        try:
            worker.run(self._stop)
        finally:
            # Cleared after the run, not before: a stop_worker that arrives before run_worker starts
            # (calls run concurrently, max_concurrency > 1) must still stop it.
            self._stop.clear()
        return stats.snapshot()

    def stop_worker(self) -> None:
        self._stop.set()

    def node_id(self) -> str:
        """The hex id of the Ray node this actor runs on (after a restart, the node it runs on now)."""
        import ray

        return ray.get_runtime_context().get_node_id()


def check_nemo_gym() -> None:
    """Import NeMo Gym's finalization API as the seed does, and check rlstream's digests agree with the
    installed NeMo Gym's golden vectors; one clear error if it is missing or disagrees."""
    try:
        from nemo_gym.token_id_capture.staging.conformance import assert_golden_vectors, load_golden_vectors
        from nemo_gym.token_id_capture.staging.rebuild import (  # noqa: F401
            RebuildError,
            ReceiptVerificationError,
            verify_and_linearize,
        )
        from nemo_gym.token_id_capture.staging.records import RolloutReceipt  # noqa: F401
    except ImportError as exc:
        raise RlstreamError(f"NeMo Gym receipts need nemo-gym 0.7.0, which is not importable here ({exc}): "
                            f"{NEMO_GYM_INSTALL}") from None  # fmt: skip
    from schemas import gym_digest

    assert_golden_vectors()
    vectors = load_golden_vectors()
    if gym_digest.compute_staging_digest(**vectors["staged_call"]) != vectors["staged_call_digest"] or (
        gym_digest.compute_extras_digest(vectors["extras"]) != vectors["extras_digest"]
    ):
        raise RlstreamError(
            "the installed nemo-gym's golden vectors disagree with rlstream's digests (another version?)"
        )


def request_group(request: ReassemblyRequest) -> Any:
    """The open group a request finalizes (`workers.reassembler.groups.OpenGroup`), its receipts in
    their slots; `SchemaError` naming the field for a request that would not build N distinct rows.

    One rollout in two slots would be trained twice (the Kafka path's intake refuses it as a
    duplicate), so a rollout id named twice, or one receipt's rollout in two slots, is refused.
    """
    from workers.reassembler.groups import OpenGroup

    expected = tuple(sample_id(request.group_id, i) for i in range(len(request.rollout_ids)))
    if request.canonical_sample_ids != expected:
        # NeMo RL's finalizer asserts the same: rows are put under {group_id}_g{i}, nothing else.
        raise SchemaError(
            "rpc.canonical_sample_ids",
            f"must be {list(expected[:3])}... ({{group_id}}_g{{i}}), got {list(request.canonical_sample_ids[:3])}",
        )
    _distinct("rpc.rollout_ids", "slots {} and {}", request.rollout_ids)
    receipts = [_receipt(r, f"rpc.receipts[{i}]", request, i) for i, r in enumerate(request.receipts)]
    seen: dict[str, int] = {}
    for i, r in enumerate(receipts):
        if r is None:
            continue
        if r.rollout_id in seen:
            raise SchemaError(
                f"rpc.receipts[{i}].rollout_id",
                f"{r.rollout_id!r} is also receipts[{seen[r.rollout_id]}]'s: one rollout cannot fill two slots",
            )
        seen[r.rollout_id] = i
    group = OpenGroup(
        request.group_id,
        partition=-1,
        group_size=len(request.rollout_ids),
        prompt_idx=request.prompt_idx,
        first_offset=0,
        last_offset=0,
        first_seen_ms=0,
    )
    for i, r in enumerate(receipts):
        if r is not None:
            group.receipts[i] = r
    return group


def _distinct(path: str, where: str, values: Sequence[str]) -> None:
    first: dict[str, int] = {}
    for i, value in enumerate(values):
        if value in first:
            raise SchemaError(path, f"names {value!r} twice ({where.format(first[value], i)}): each rollout once")
        first[value] = i


def _receipt(value: dict | None, path: str, request: ReassemblyRequest, index: int) -> Receipt | GymReceipt | None:
    if value is None:
        return None
    kind = value.get("kind")
    try:
        if kind == GymReceipt.kind():
            return msgspec.convert(value, GymReceipt)
        if kind is None and "group_id" not in value:
            return _from_nemo_gym(value, request, index, path)
        return msgspec.convert(value, Receipt)
    except (msgspec.ValidationError, SchemaError) as exc:
        raise SchemaError(path, str(exc)) from None


def _from_nemo_gym(value: dict, request: ReassemblyRequest, index: int, path: str) -> GymReceipt:
    """A NeMo Gym `RolloutReceipt` dict (the seed's form): its group fields are the request's.

    Read as the seed reads it, with NeMo Gym's own model when it is installed: pydantic's lax
    coercions (`"reward": "0.5"`, `"capture_poisoned": "false"`, `"schema_version": 2.0`) are
    accepted and applied exactly as pydantic applies them, and what it refuses is refused with the
    field's path. Without NeMo Gym, rlstream's structs read it strictly (no coercion at all).
    """
    receipt = msgspec.convert(_as_nemo_gym_reads_it(value, path), GymRolloutReceipt)
    if receipt.rollout_id != request.rollout_ids[index]:
        raise SchemaError(
            f"{path}.rollout_id",
            f"is {receipt.rollout_id!r}, but rollout_ids[{index}] is {request.rollout_ids[index]!r}",
        )
    return GymReceipt(
        group_id=request.group_id,
        prompt_idx=request.prompt_idx,
        rollout_index=index,
        group_size=len(request.rollout_ids),
        reward=request.rewards[index],
        mask_sample=request.mask_sample[index],
        loss_multiplier=request.loss_multiplier,
        environment="unknown",
        receipt=receipt,
    )


def _as_nemo_gym_reads_it(value: dict, path: str) -> dict:
    try:
        from nemo_gym.token_id_capture.staging.records import RolloutReceipt
        from pydantic import ValidationError
    except ImportError:
        return value
    try:
        return RolloutReceipt.model_validate(value).model_dump(mode="json")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise SchemaError(
            f"{path}.{where}" if where else path, f"{first.get('msg')} (NeMo Gym's RolloutReceipt)"
        ) from None


def start_worker(actor, kafka: KafkaConfig, worker_config, files: KafkaFiles = NO_FILES):
    """Start `actor`'s Kafka worker loop (`run_worker`); returns its ObjectRef.

    `kafka`'s secrets are not sent: the actor reads them on its node, from `files` (the same paths on
    every node) or the node's environment (`kafka_secrets`), since Ray records a call's arguments.
    """
    return actor.run_worker.remote(for_actors(kafka, files), worker_config)


def create_rollout_reassembler_actors(
    dp_config: DataPlaneConfig | Sequence[DataPlaneConfig],
    config: RolloutReassemblerActorConfig,
    *,
    num_workers: int,
    name_prefix: str | None = None,
    max_restarts: int = MAX_RESTARTS,
    max_task_retries: int = MAX_TASK_RETRIES,
    node_resource: str | None = None,
    metrics_port: int | None = None,
) -> list[Any]:
    """Construct and validate the pool after TQ partitions are registered; all or nothing.

    `dp_config` may be one config for all actors or one per actor (e.g. per-node addresses);
    with `name_prefix`, actor i is a named actor `<name_prefix>-<i>` that other processes can find.
    Ray restarts a dead actor up to `max_restarts` times and retries its calls in flight up to
    `max_task_retries` times (-1: unbounded); `ray.kill(actor)` stops one for good.
    The actors are spread over the Ray nodes (Ray's SPREAD strategy: each on the next node with a free
    CPU, so losing one node loses only its share); with `node_resource`, only over the nodes that
    offer that custom resource (TQError if none does). With `metrics_port`, actor i serves its worker's
    Prometheus metrics on `metrics_port + i` (each a free port for 0; `metrics_endpoint` says which).
    """
    if num_workers <= 0:
        raise ValueError(f"num_workers must be > 0, got {num_workers}")
    configs = [dp_config] * num_workers if isinstance(dp_config, DataPlaneConfig) else list(dp_config)
    if len(configs) != num_workers:
        raise ValueError(f"got {len(configs)} data-plane configs for num_workers={num_workers}")
    import ray

    # A token amount of the resource: it only restricts where an actor may run, never how many.
    resources = {}
    if node_resource is not None:
        nodes_offering(node_resource)
        resources = {node_resource: NODE_RESOURCE_SHARE}
    remote_cls = ray.remote(
        num_cpus=1,
        max_concurrency=4,
        max_restarts=max_restarts,
        max_task_retries=max_task_retries,
        scheduling_strategy="SPREAD",
        resources=resources,
    )(RolloutReassemblerActor)
    actors: list[Any] = []
    try:
        for i, c in enumerate(configs):
            opts = {"name": f"{name_prefix}-{i}"} if name_prefix else {}
            served = {} if metrics_port is None else {"metrics_port": metrics_port + i if metrics_port else 0}
            actors.append(remote_cls.options(**opts).remote(c, config, **served))
        ray.get([a.check_dependencies.remote() for a in actors])
    except BaseException:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise
    return actors
