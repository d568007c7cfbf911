"""verl 0.9.1's v1 trainer on CPU, with rlstream plugged in by verl's own config keys.

What is verl's own code here: the Hydra config (``verl/trainer/config/ppo_trainer.yaml``), the trainer
class (``get_trainer_cls(trainer_mode)``, built by its ``__init__``: checkpoint callback and replay
buffer by the configured names), ``_init_tokenizer``, ``_init_dataloader`` (RLHFDataset over parquet),
``_init_resource_pool_mgr``, ``RewardLoopManager`` (rule-based reward workers on Ray),
``_load_checkpoint``, ``on_init_end``, ``TaskRunnerV1.init_agent_loop_manager`` (the configured
manager's ``create``), verl's ``LLMServerClient``/``FullyAsyncLLMServerClient`` and its global load
balancer, and then ``fit`` itself: ``_validate``, ``prepare_step``, ``sample``, ``_balance_batch``,
``_compute_old_log_prob`` (bypass mode: the rollout's logprobs), ``_compute_advantage`` (GRPO),
``_update_actor``, ``_save_checkpoint``, ``on_step_end``, ``_compute_metrics``, the TQ clears.

Stubbed, because verl 0.9.1 runs them on GPUs only (no CPU training engine, no CPU rollout backend):

- `StubActorWorkerGroup` for the actor worker group (``init_model``, ``update_actor``,
  ``save_checkpoint``, ``load_checkpoint``): its ``update_actor`` reads from TQ every field verl's
  actor reads and records which rows it trained;
- `TinyRolloutServer` for a vLLM server: a tiny randomly initialised Llama generating on CPU,
  reporting the weight label verl's ``update_weights`` gave it, as vLLM's server does;
- `StubCheckpointManager` for verl's ``CheckpointEngineManager`` (weight sync to the servers):
  ``update_weights(global_steps)`` labels the stand-in server's weights.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from tests.verl.tiny import TinyFiles

SAMPLER = "pkg://workers.adapters.verl_sampler"
MANAGER = "workers.adapters.verl_rollout.RlstreamAgentLoopManager"
CALLBACK = "workers.adapters.verl_checkpoint.RlstreamCheckpointCallback"


def rlstream_overrides(bootstrap: str, prefix: str, consumer_group: str) -> list[str]:
    """The override lines docs/VERL.md gives a verl user (the Kafka address and names vary)."""
    kw = "+trainer.v1.sampler.sampler_kwargs.rlstream"
    return [
        f"trainer.v1.sampler.custom_sampler.path={SAMPLER}",
        "trainer.v1.sampler.custom_sampler.name=RlstreamReplayBuffer",
        f"{kw}.bootstrap_servers={bootstrap}",
        f"{kw}.prefix={prefix}",
        f"{kw}.consumer_group={consumer_group}",
        f"{kw}.group_size=${{actor_rollout_ref.rollout.n}}",
        f"{kw}.checkpoint_dir=${{trainer.default_local_dir}}",
        f"{kw}.resume_mode=${{trainer.resume_mode}}",
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER}",
        f"trainer.checkpoint_callback_class={CALLBACK}",
    ]


def cpu_overrides(tiny: TinyFiles, checkpoints: str, *, mode: str = "sync", steps: int = 3) -> list[str]:
    """A tiny GRPO run: 2 prompts of 2 rollouts per step, checkpoints every step, validation before training."""
    return [
        f"data.train_files={tiny.train}",
        f"data.val_files={tiny.val}",
        "data.train_batch_size=2",
        "data.max_prompt_length=16",
        "data.max_response_length=4",
        "data.dataloader_num_workers=0",
        "data.shuffle=False",
        f"actor_rollout_ref.model.path={tiny.model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.name=vllm",  # the stand-in server takes vLLM's calls
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.bypass_mode=True",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={tiny.reward}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=[console]",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=True",
        f"trainer.default_local_dir={checkpoints}",
        f"trainer.v1.trainer_mode={mode}",
        "trainer.v1.colocate_async.num_warmup_batches=1",
    ]


def compose(overrides: list[str]):
    """verl's ppo_trainer config with `overrides`, resolved as TaskRunnerV1.run resolves it."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = hydra_compose("ppo_trainer", overrides=overrides)
    config.transfer_queue.enable = True
    OmegaConf.resolve(config)
    return config


@ray.remote
class TinyRolloutServer:
    """Stands in for verl's vLLM server (GPU only): a tiny random Llama generating on CPU.

    Like vLLM's server it labels every output with the weights verl's ``update_weights`` installed.
    """

    def __init__(self, model_dir: str, response_length: int, seed: int = 0):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(seed)
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).eval()
        self.response_length = response_length
        self.global_steps: int | None = None
        self.calls = 0
        self.fail_at: int | None = None

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    def fail_call(self, k: int) -> None:
        """The k-th request from now fails, as a request to a crashed engine would."""
        self.fail_at = self.calls + k

    async def generate(self, request_id: str, *, prompt_ids, sampling_params: dict, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("stand-in rollout server: this request failed")
        ids = torch.tensor([list(prompt_ids)], dtype=torch.int64)
        with torch.no_grad():
            out = self.model.generate(
                ids,
                do_sample=True,
                max_new_tokens=int(sampling_params.get("max_tokens") or self.response_length),
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                eos_token_id=1,
            )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        logprobs = [torch.log_softmax(score[0].float(), dim=-1)[tok].item() for score, tok in zip(out.scores, tokens)]
        return TokenOutput(
            token_ids=tokens,
            log_probs=logprobs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )


class StubCheckpointManager:
    """verl's CheckpointEngineManager pushes the actor's weights to the servers (GPU); here it labels them."""

    def __init__(self, server):
        self.server = server
        self.calls: list[tuple[str, Any]] = []

    def update_weights(self, global_steps: int | None = None) -> None:
        self.calls.append(("update_weights", global_steps))
        if global_steps is not None:
            ray.get(self.server.set_global_steps.remote(global_steps))

    def sleep_replicas(self) -> None:
        self.calls.append(("sleep_replicas", None))

    def abort_replicas(self) -> None:
        self.calls.append(("abort_replicas", None))

    def resume_generation_replicas(self) -> None:
        self.calls.append(("resume_generation_replicas", None))


# What verl's actor (engine_workers.py, losses.py) reads from TQ for each row it trains.
ACTOR_FIELDS = [
    "input_ids",
    "position_ids",
    "prompts",
    "responses",
    "response_mask",
    "loss_mask",
    "old_log_probs",
    "advantages",
]


@dataclass
class StubActorWorkerGroup:
    """The actor worker group (FSDP/Megatron on GPUs): trains nothing, records what it was given.

    ``update_actor`` reads every field verl's actor reads for every row, verl's padding rows too (a
    field on some rows only raises, as TQ does), and keeps per verl step the rlstream group of each
    row (``trained``; a rejected rollout's masked row counts, verl's padding rows, keyed "pad...", do
    not) and the rejected ones (``rejected``). ``crash_after_update`` raises right after that step
    trained, as a process dying there would.
    """

    _dispatch_info: dict = field(default_factory=lambda: {"actor": [0]})
    trained: dict[int, list[str]] = field(default_factory=dict)
    rejected: dict[int, list[str]] = field(default_factory=dict)
    padding_rows: int = 0
    saved: list[int] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    crash_after_update: int | None = None
    step_of: Any = None  # the trainer's global step (the worker group is told nothing of it)

    def update_actor(self, batch):
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=ACTOR_FIELDS)
        assert set(ACTOR_FIELDS) <= set(data.keys()), f"fields missing for verl's actor: {set(data.keys())}"
        mask = data["loss_mask"].to_padded_tensor(padding=0)
        assert mask.shape[0] == len(batch.keys) and batch.extra_info["mini_batch_size"] > 0
        step = self.step_of()
        for key, tag in zip(batch.keys, batch.tags):
            if key.startswith("pad"):  # verl's own padding (upsample_batch_to_divisible_size)
                self.padding_rows += 1
                continue
            self.trained.setdefault(step, []).append(tag["rlstream_group_id"])
            if "rlstream_rejected" in tag:
                self.rejected.setdefault(step, []).append(tag["rlstream_group_id"])
        if self.crash_after_update == step:
            raise RuntimeError(f"crash after training step {step}")
        return {"metrics": {"mfu": 0.0, "pg_loss": 0.0}}  # what verl's _update_actor reads of the output

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        self.saved.append(global_step)

    def load_checkpoint(self, local_path, del_local_after_load=False):
        self.loaded.append(local_path)


class StubServerManager:
    """verl's LLMServerManager launches vLLM replicas (GPU); its client and load balancer are verl's own."""

    def __init__(self, config, server):
        from verl.workers.rollout.router import get_router_handle

        self.config = config
        self.balancer = get_router_handle(servers={"tiny-0": server})

    def get_client(self, client_cls=None, **kwargs):
        from verl.workers.rollout.llm_server import LLMServerClient

        return (client_cls or LLMServerClient)(config=self.config, load_balancer_handle=self.balancer, **kwargs)


@dataclass
class Shared:
    """What one test module builds once: the stand-in rollout server and verl's reward workers."""

    server: Any
    reward_loop_manager: Any


def shared_services(config) -> Shared:
    from verl.experimental.reward_loop import RewardLoopManager

    server = TinyRolloutServer.remote(config.actor_rollout_ref.model.path, config.data.max_response_length)
    return Shared(server, RewardLoopManager(config=config, rm_resource_pool=None))


def cpu_trainer(config, shared: Shared, actor: StubActorWorkerGroup | None = None):
    """verl's trainer as ``PPOTrainer.init()`` builds it, with the GPU parts stubbed (module doc)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)  # callback and replay buffer
    # _setup, in its order, without what needs GPUs (resource pools, model engines, vLLM replicas).
    trainer._init_tokenizer()
    trainer._init_dataloader()
    trainer._init_dump_executor()
    trainer._init_resource_pool_mgr()
    trainer.ref_in_actor = False
    trainer.actor_rollout_wg = actor or StubActorWorkerGroup()
    trainer.actor_rollout_wg.step_of = lambda: trainer.global_steps
    trainer.reward_loop_manager = shared.reward_loop_manager
    trainer.teacher_model_manager = None
    trainer.distillation_config = None
    trainer.llm_server_manager = StubServerManager(config, shared.server)
    trainer.checkpoint_manager = StubCheckpointManager(shared.server)
    trainer.checkpoint_manager.sleep_replicas()
    trainer._load_checkpoint()
    trainer.on_init_end()
    return trainer


def agent_loop_manager(config, trainer):
    """The configured agent-loop manager, built by verl's own TaskRunnerV1.init_agent_loop_manager."""
    from verl.trainer.main_ppo import TaskRunnerV1

    runner = TaskRunnerV1.__ray_actor_class__()
    runner.config, runner.trainer = config, trainer
    runner.init_agent_loop_manager()
    return runner.agent_loop_manager


def stop_agent_loop_manager(manager) -> None:
    for worker in getattr(manager, "agent_loop_workers", []):
        ray.kill(worker)


def record(trainer, name: str) -> list:
    """Each call of the trainer's method `name` (its verl code still runs): (kwargs or args, result)."""
    calls: list = []
    method = getattr(trainer, name)

    def recorded(*args, **kwargs):
        result = method(*args, **kwargs)
        calls.append((args, kwargs, result))
        return result

    setattr(trainer, name, recorded)
    return calls


@dataclass
class VerlRun:
    """One verl run's names under a unique prefix: topics, consumer group, checkpoint folder."""

    names: Any
    prefix: str
    consumer_group: str
    checkpoints: str
    tiny: TinyFiles
    bootstrap: str
    services: Shared

    def config(self, *extra: str, **kw):
        return compose(
            cpu_overrides(self.tiny, self.checkpoints, **kw)
            + rlstream_overrides(self.bootstrap, self.prefix, self.consumer_group)
            + list(extra)
        )


class ReassemblerThread:
    """rlstream's reassembler, in this process: finalizes the groups verl's rollouts publish."""

    def __init__(self, kafka, store, prefix: str):
        from workers.reassembler.config import ReassemblerConfig
        from workers.reassembler.worker import ReassemblerWorker

        config = ReassemblerConfig(prefix=prefix, worker_id=f"re-{prefix}", consumer_group=f"re-{prefix}")
        self.worker = ReassemblerWorker(kafka, store, config)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.worker.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
