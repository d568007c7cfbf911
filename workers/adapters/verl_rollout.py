"""verl's rollouts through rlstream: an agent-loop manager whose workers stage and publish each prompt's group.

Set ``+actor_rollout_ref.rollout.agent.agent_loop_manager_class=workers.adapters.verl_rollout.
RlstreamAgentLoopManager``. verl's ``TaskRunnerV1`` builds it with ``create(config, llm_client,
teacher_client, reward_loop_worker_handles)`` and its trainer calls only ``generate_sequences(batch)``.
It is verl's ``AgentLoopManagerTQ`` with another worker, `RlstreamAgentLoopWorker`, verl's
``AgentLoopWorkerTQ`` but for training prompts:

- each of the prompt's rollout.n sessions runs verl's agent loop against verl's rollout servers
  (``llm_client``; their weights synced by verl's checkpoint manager, whose labels give the
  versions) and verl's reward workers score it, as in verl;
- instead of writing trajectories into verl's ``train`` partition, the group's n sessions are staged
  in TQ and their receipts published through rlstream's ``RolloutPublisher`` (verl_sessions.py
  converts them); rlstream's reassemblers finalize the group and verl's replay buffer, rlstream's,
  samples it from Kafka. verl's own generation never lands untrained rows in ``train``;
- verl's prompt key (put into ``train`` by ``_submit_batch_to_rollout``) is cleared once the group is
  published, so keys do not pile up, and a prompt still in flight when verl crashes keeps its key
  (verl's async modes re-issue it on resume from a TQ that outlived the crash).

Validation keeps verl's path: batches marked ``validate`` go through ``AgentLoopWorkerTQ`` unchanged
into ``val``, where verl's own buffer samples them. In ``sync`` mode verl puts its rollout servers to
sleep right after ``sample`` returns, so ``generate_sequences`` waits until the batch is published.

The Kafka settings are ``trainer.v1.sampler.sampler_kwargs.rlstream`` (bootstrap_servers,
client_settings, kafka_config, prefix, version_offset), the replay buffer's; no secret among them
(verl hands that config to Ray actors): each worker reads those on its node (`kafka_from_options`).
verl is imported only when one of these classes is first asked for (module ``__getattr__``):
rlstream itself must not import verl.
"""

from __future__ import annotations

import asyncio
import logging
from functools import cache
from typing import Any

log = logging.getLogger("rlstream.adapters.verl")

_CLASSES = ("RlstreamAgentLoopManager", "RlstreamAgentLoopWorker")


def rollout_options(config: Any) -> dict[str, Any]:
    """``trainer.v1.sampler.sampler_kwargs.rlstream`` of verl's full config, as plain values."""
    from workers.adapters.verl_settings import plain

    sampler = config.trainer.v1.sampler
    return dict(plain(sampler.get("sampler_kwargs") or {}).get("rlstream", {}) or {})


def _publisher(options: dict[str, Any], store: Any):
    from workers.adapters.verl_settings import kafka_from_options
    from workers.rollout.publisher import RolloutPublisher
    from workers.topics import TopicNames

    options = dict(options)
    kafka = kafka_from_options(options)
    return RolloutPublisher(kafka, store, TopicNames(options.get("prefix", "")).receipts)


def publish_group(publisher: Any, staged: list, failed: list) -> bool:
    """Publish a prompt's group; True when it will reach the trainer (published, a usable rollout).

    If publishing fails, the group's `failed` receipts (nothing staged) are published instead, so the
    reassembler closes it rather than wait for it; a group left open would hang a sync-mode trainer.
    """
    from workers.adapters.verl_sessions import reaches_trainer

    try:
        publisher.publish(staged)
        return reaches_trainer(staged)
    except Exception:  # noqa: BLE001 - the group must close whatever failed
        log.exception("the group of %s could not be published; publishing its failed receipts", _group_of(staged))
    try:
        publisher.publish(failed)
    except Exception:  # noqa: BLE001
        log.exception("the failed receipts of %s could not be published either", _group_of(failed))
    return False


# verl's own training partition, where its dispatch puts each prompt's key.
VERL_TRAIN = "train"


async def settle_prompt(tq: Any, store: Any, uid: str, reaches_trainer: bool) -> None:
    """verl's prompt key once its group is published: cleared when the group will reach the trainer,
    else tagged failed, so rlstream's replay buffer has verl dispatch another prompt (refill_fn).

    The clear is rlstream's checked one (`TQStore.clear`, on a thread: it waits on TQ's client loop),
    not TQ's `kv_clear`, which deletes storage by the indexes of its lookup in every partition: a
    lookup gone stale would delete whatever row took the index, rlstream.train's included.
    """
    from workers.adapters.verl_partitions import FAILED_PROMPT_TAG

    if reaches_trainer:
        await asyncio.to_thread(store.clear, VERL_TRAIN, [uid])
    else:
        await tq.async_kv_put(key=uid, partition_id=VERL_TRAIN, tag=dict(FAILED_PROMPT_TAG))


def _group_of(staged: list) -> str:
    return staged[0].receipt.group_id if staged else "?"


@cache
def _build() -> dict[str, type]:
    import ray
    import transfer_queue as tq
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ, apply_greedy_sampling_params

    from streams.tq import TQStore
    from workers.adapters.verl_sessions import failed_group, group_rollouts

    class RlstreamAgentLoopWorker(AgentLoopWorkerTQ.__ray_actor_class__):  # Ray actor classes cannot be subclassed
        """verl's TQ agent-loop worker; training prompts go to rlstream (module doc)."""

        def __init__(self, config, llm_client, teacher_client=None, reward_loop_worker_handles=None):
            super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
            if self.distillation_enabled:
                raise NotImplementedError("rlstream's agent-loop worker does not carry teacher logprobs yet")
            options = rollout_options(config)
            self._version_offset = int(options.get("version_offset", 0))
            self._store = TQStore()
            self._publisher = _publisher(options, self._store)

        async def drain(self) -> None:
            """Wait for every prompt dispatched so far (sync mode: before verl puts the servers to sleep)."""
            if self.background_tasks:
                await asyncio.gather(*list(self.background_tasks), return_exceptions=True)

        async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False):
            if trajectory["validate"]:
                return await super()._run_prompt(prompt, sampling_params, trajectory, trace)
            uid = prompt["uid"]
            rollout = self.config.actor_rollout_ref.rollout
            n = int(rollout.n)
            where = {
                "prompt_idx": int(prompt.get("index", 0) or 0),
                "environment": str(prompt.get("data_source", "verl")),
            }
            try:
                # verl lets a prompt ask for its own n; its trainer still sizes mini-batches by rollout.n.
                asked = int(prompt.pop("__rollout_n__", n))
                if asked != n:
                    log.warning("prompt %s asks for %d sessions, rollout.n is %d: a group is n rollouts", uid, asked, n)
                params = dict(sampling_params)
                if not prompt.pop("__do_sample__", True):
                    apply_greedy_sampling_params(params)
                tasks = [
                    asyncio.create_task(
                        self._run_agent_loop(params, trajectory=trajectory, trace=trace, session_id=i, **prompt)
                    )
                    for i in range(max(0, min(asked, n)))
                ]
                outputs = await asyncio.gather(*tasks, return_exceptions=True)
                outputs = [o if isinstance(o, BaseException) else o.model_dump() for o in outputs]
                staged = group_rollouts(
                    uid,
                    n,
                    outputs,
                    asked=asked,
                    version_offset=self._version_offset,
                    max_response_length=rollout.response_length,
                    **where,
                )
            except Exception as exc:  # noqa: BLE001 - whatever failed, the group must still close
                log.exception("prompt %s failed", uid)
                staged = failed_group(uid, n, reason=f"{type(exc).__name__}: {exc}", **where)
            failed = failed_group(uid, n, reason="its rollouts could not be published", **where)
            reaches = await asyncio.to_thread(publish_group, self._publisher, staged, failed)
            await settle_prompt(tq, self._store, uid, reaches)

        async def _agent_loop_postprocess(self, output, validate, **kwargs):
            if validate:
                return await super()._agent_loop_postprocess(output, validate, **kwargs)
            outputs = output if isinstance(output, list) else [output]
            if not outputs:
                raise ValueError(f"agent loop returned no output for {kwargs['uid']}_{kwargs['session_id']}")
            await self._compute_score(outputs, kwargs=kwargs)  # verl's reward workers, as AgentLoopWorkerTQ
            # A session is one rlstream rollout: of an agent loop's several outputs, the final one.
            return outputs[-1]

    class RlstreamAgentLoopManager(AgentLoopManagerTQ):
        """verl's AgentLoopManagerTQ with rlstream's worker (module doc); verl builds it with ``create``."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # After AgentLoopManagerTQ.__init__, which sets its own worker; workers start in create().
            self.agent_loop_workers_class = ray.remote(RlstreamAgentLoopWorker)
            self._wait_published = self.config.trainer.v1.trainer_mode == "sync"

        def generate_sequences(self, prompts) -> None:
            validate = "validate" in prompts  # a TensorDict: its keys
            super().generate_sequences(prompts)
            if self._wait_published and not validate:
                ray.get([worker.drain.remote() for worker in self.agent_loop_workers])

    classes = {"RlstreamAgentLoopManager": RlstreamAgentLoopManager, "RlstreamAgentLoopWorker": RlstreamAgentLoopWorker}
    for name, cls in classes.items():
        # Ray and verl's load_class_from_fqn find them by this module and name (__getattr__ below).
        cls.__module__, cls.__qualname__ = __name__, name
    return classes


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return _build()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
