"""The step's shape, verl's config for it, the actor built from it and each step's batch."""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

from verl_step.common import ATTENTION


# --------------------------------------------------------------------------------------------- run
@dataclasses.dataclass
class _Shape:
    batch_per_rank: int
    prompt_len: int
    response_len: int
    mini_batches: int  # PPO mini-batches per update (optimizer steps per update_actor)
    micro_batch_per_gpu: int
    log_prob_micro_batch_per_gpu: int


SHAPES = ("small", "compute-rich")


def _shape(tiny: bool, name: str = "small") -> _Shape:
    """The batch per step. ``compute-rich``: 16 x (256 + 768) = 16,384 tokens per rank and phase
    (enough compute to hide a 1.5B model's copies behind: ``bench --workload compute-rich``)."""
    if tiny:
        return _Shape(batch_per_rank=4, prompt_len=8, response_len=8, mini_batches=2, micro_batch_per_gpu=1,
                      log_prob_micro_batch_per_gpu=2)
    if name == "compute-rich":
        return _Shape(batch_per_rank=16, prompt_len=256, response_len=768, mini_batches=2, micro_batch_per_gpu=2,
                      log_prob_micro_batch_per_gpu=4)
    return _Shape(batch_per_rank=8, prompt_len=128, response_len=256, mini_batches=2, micro_batch_per_gpu=2,
                  log_prob_micro_batch_per_gpu=4)


def _verl_config(model_dir: str, shape: _Shape, world: int, lr: float, offload: bool = True,
                 strategy: str = "fsdp2", lora_rank: int = 0):
    """verl's generated PPO config with the overrides a verl user would give on the command line."""
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    overrides = {
        "actor_rollout_ref.model.path": model_dir,
        "actor_rollout_ref.model.use_remove_padding": False,  # padded batches: no flash-attn needed
        # Eager attention: verl's full_determinism sets use_deterministic_algorithms(warn_only=True), under
        # which PyTorch's flash / memory-efficient SDPA backward kernels stay non-deterministic.
        "actor_rollout_ref.model.override_config": {"attn_implementation": ATTENTION},
        "actor_rollout_ref.actor.strategy": strategy,
        "actor_rollout_ref.actor.fsdp_config.strategy": strategy,
        "actor_rollout_ref.actor.fsdp_config.param_offload": offload,
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": offload,
        "actor_rollout_ref.actor.fsdp_config.full_determinism": True,  # verl's knob: deterministic kernels
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
        "actor_rollout_ref.actor.use_torch_compile": False,
        "actor_rollout_ref.actor.optim.lr": lr,
        "actor_rollout_ref.actor.ppo_mini_batch_size": shape.batch_per_rank * world // shape.mini_batches,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": shape.micro_batch_per_gpu,
        "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.shuffle": False,
        "actor_rollout_ref.rollout.n": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": shape.log_prob_micro_batch_per_gpu,
    }
    if lora_rank:  # verl's LoRA flags (peft); the reference would be the actor with adapters off
        overrides.update({"actor_rollout_ref.model.lora_rank": lora_rank,
                          "actor_rollout_ref.model.lora_alpha": 2 * lora_rank,
                          "actor_rollout_ref.model.target_modules": "all-linear"})
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def _build_actor(cfg):
    """ActorRolloutRefWorker.init_model's "actor" branch (verl 0.9.1), without Ray."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    arr = cfg.actor_rollout_ref
    model_config = omega_conf_to_dataclass(arr.model)
    actor_config = omega_conf_to_dataclass(arr.actor)
    actor_config.model_config = model_config
    config = TrainingWorkerConfig(
        model_type=actor_config.model_config.get("model_type", "language_model"),
        model_config=actor_config.model_config, engine_config=actor_config.engine,
        optimizer_config=actor_config.optim, checkpoint_config=actor_config.checkpoint, profiler_config=None,
    )
    config.engine_config.use_dynamic_bsz = arr.actor.use_dynamic_bsz
    config.engine_config.infer_max_token_len_per_gpu = arr.rollout.log_prob_max_token_len_per_gpu
    config.engine_config.infer_micro_batch_size_per_gpu = arr.rollout.log_prob_micro_batch_size_per_gpu
    config.engine_config.max_token_len_per_gpu = arr.actor.ppo_max_token_len_per_gpu
    config.engine_config.micro_batch_size_per_gpu = arr.actor.ppo_micro_batch_size_per_gpu
    config.engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    actor = TrainingWorker(config=config)
    actor.reset()
    actor.set_loss_fn(partial(ppo_loss, config=actor_config))
    return actor, actor_config


def _batch(step: int, rank: int, shape: _Shape, vocab: int, seed: int):
    """A rollout's output in verl's left-right padded layout: left-padded prompts, right-padded responses.

    The tokens are seeded by (seed, step, rank), the valid lengths by (seed, rank) alone: every round
    does the same work on the same shapes.

    [Note: the same shapes every round]: with lengths drawn per
    round (as until 2026-12-06), a round's valid tokens varied by 8% (11,673 to 12,680 of 16,384 at seed
    1, rank 0), and the resident step with them, which the spread of the resident step counted as noise.
    """
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    b, p_len, r_len = shape.batch_per_rank, shape.prompt_len, shape.response_len
    prompts = torch.randint(1, vocab, (b, p_len), generator=g)
    responses = torch.randint(1, vocab, (b, r_len), generator=g)
    lengths = torch.Generator().manual_seed(seed * 1_000_003 + 7919 + rank)
    p_valid = torch.randint(max(1, p_len // 2), p_len + 1, (b,), generator=lengths)
    r_valid = torch.randint(max(1, r_len // 2), r_len + 1, (b,), generator=lengths)
    prompt_mask = (torch.arange(p_len)[None, :] >= (p_len - p_valid)[:, None]).long()  # left padding
    response_mask = (torch.arange(r_len)[None, :] < r_valid[:, None]).long()  # right padding
    prompts = prompts * prompt_mask
    responses = responses * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    scores = torch.randn(b, generator=g)
    advantages = ((scores - scores.mean()) / (scores.std() + 1e-6))[:, None] * response_mask.float()
    td = TensorDict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                     "prompts": prompts, "responses": responses, "response_mask": response_mask},
                    batch_size=[b])
    return td, advantages
