#!/usr/bin/env python3
"""verl 0.9.1's own actor (FSDP2 or FSDP1, ``param_offload`` and ``optimizer_offload`` on) in a
colocated step: resident (offload off), verl's own helpers (the seed) and torchferry's, in one
process, rounds interleaved, on the same seeds and data: bit-identity, bytes moved and the
transfer each strategy leaves exposed in the step.

One command runs it all (the run, then the report)::

    bash benchmarks/verl_actor.sh OUT [NPROC] [PRESET] [STEPS]

or by hand::

    python benchmarks/verl_actor.py prepare --preset qwen2.5-1.5b --model-dir /tmp/verl_actor_model
    torchrun --standalone --nproc_per_node 2 benchmarks/verl_actor.py run --model-dir /tmp/verl_actor_model \\
        --strategies resident verl torchferry plain:TORCHFERRY_LAYERWISE_RELOAD=0 --out OUT/runs.json
    python benchmarks/verl_actor.py report OUT/runs.json --out-dir OUT

Each strategy has its own actor, built with its helpers in place (``patch()`` under its settings
for a torchferry strategy, verl's own helpers otherwise); each round runs one step of every
strategy, the order rotated by one each round, so drift of the machine falls on all alike. While
one strategy runs, the others' state sits where their last phase left it (offloaded, or on the
GPU for ``resident``), as the roles of a colocated worker share one GPU.

What of verl runs (verl 0.9.1, unmodified; see ``VERL_CODE`` below, also written into the JSON):

* the actor is built as ``ActorRolloutRefWorker.init_model`` builds it (its "actor" branch):
  the config from verl's own ``trainer/config/_generated_ppo_trainer.yaml`` with Hydra-style
  overrides (``actor_rollout_ref.actor.strategy=fsdp2``, ``...fsdp_config.param_offload=True``,
  ``...fsdp_config.optimizer_offload=True``, ...), turned into dataclasses by
  ``verl.utils.config.omega_conf_to_dataclass``, a ``verl.workers.engine_workers.TrainingWorker``
  (whose engine is ``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead``: the model
  from the checkpoint folder, ``apply_fsdp2``, ``fsdp2_load_full_state_dict``, AdamW), ``reset()``
  and ``set_loss_fn(partial(ppo_loss, config=actor_config))``;
* each step does what verl's PPO trainer does around the rollout (no rollout engine here: the
  "responses" are seeded random tokens, and the advantages seeded random scores):
  ``left_right_2_no_padding``, then ``TrainingWorker.infer_batch`` (what
  ``ActorRolloutRefWorker.compute_log_prob`` calls: old log-probs and entropy), then
  ``TrainingWorker.train_mini_batch`` (what ``ActorRolloutRefWorker.update_actor`` calls: PPO
  mini-batches, ``ppo_loss``, clip, AdamW); with LoRA, between them, the reference log-probs as
  verl's trainer computes them with ``ref_in_actor`` (``infer_batch`` with ``no_lora_adapter``:
  the actor with its adapters off). All enter verl's ``engine.eval_mode()`` /
  ``engine.train_mode()``, whose ``BaseEngineCtx`` calls ``FSDPEngine.to(...)``, which calls
  ``load_fsdp_model_to_gpu`` / ``load_fsdp_optimizer`` on entry and ``offload_fsdp_model_to_cpu``
  / ``offload_fsdp_optimizer`` on exit: verl's own offload helpers (PR #7347's
  ``model.to(..., non_blocking=True)``) for the ``verl`` strategy, torchferry's after
  ``torchferry.integrations.verl.patch()`` for a torchferry one;
* the process group is set up as verl's SFT trainer (``run_sft``) sets it up under torchrun
  (``verl.utils.distributed.initialize_global_process_group``), and ``TrainingWorker`` is used
  in that SPMD mode, as ``verl.trainer.sft_trainer.SFTTrainer`` uses it.

Measured around verl's code, not inside it: ``FSDPEngine.to`` is timed (synchronised before the
call, a phase boundary; an offload until its copies are complete, synchronised; a reload from the
call until the compute stream may go on, by CUDA events, with no synchronisation after it, so a
reload left to the forward overlaps it as in verl's trainer), and after the last round each rank
compares every local parameter shard, optimizer-state tensor and weight-sync buffer of each
strategy with verl's, byte for byte, in the process (log-probs by sha256 per step). The
``resident`` strategy (verl with ``param_offload`` and ``optimizer_offload`` off) is the baseline
of ``exposed``: per round, each strategy's step seconds less the resident step of the same round,
which is what offloading costs a step even where its copies hide behind compute.

Not verl: where ``ray`` is not installed (it is large; verl imports it at module level but this
SPMD path never talks to a Ray cluster), ``benchmarks/verl_raystub`` stands in for it (see its
docstring; recorded in the JSON). On a machine without CUDA (a check that the script runs end to
end, gloo), a CPU platform is registered through verl's own ``verl.plugin.platform.set_platform``
and ``FSDPEngine.to`` is told the direction it is asked for (on the CPU the device's name and
"cpu" are the same, so verl would load on both sides); neither happens on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verl_isolate import StepProbe, Turns, context_bytes, fingerprint, pin_cpus  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCHEMA = "torchferry.verl-step/1"
ATTENTION = "eager"

VERL_CODE = [
    "verl.utils.config.omega_conf_to_dataclass (verl/trainer/config/_generated_ppo_trainer.yaml + overrides)",
    "verl.utils.distributed.initialize_global_process_group (as verl.trainer.sft_trainer.run_sft)",
    "verl.workers.engine_workers.TrainingWorker: __init__, reset, set_loss_fn, infer_batch, train_mini_batch, "
    "train_batch (as ActorRolloutRefWorker.init_model / compute_log_prob / update_actor use it)",
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead: initialize (apply_fsdp2, "
    "fsdp2_load_full_state_dict, build_optimizer), eval_mode/train_mode, infer_batch/train_batch, optimizer_step",
    "verl.workers.engine.base.BaseEngineCtx._context_switch -> FSDPEngine.to -> load_fsdp_model_to_gpu, "
    "load_fsdp_optimizer, offload_fsdp_model_to_cpu, offload_fsdp_optimizer",
    "verl.workers.utils.losses.ppo_loss (vanilla policy loss, token-mean)",
    "verl.workers.utils.padding.left_right_2_no_padding / no_padding_2_padding",
]


# --------------------------------------------------------------------------------------------- setup
def _use_ray_stub_if_needed() -> bool:
    """Puts benchmarks/verl_raystub on sys.path when ray is not installed; returns whether the stand-in is used."""
    if importlib.util.find_spec("ray") is None:
        sys.path.append(str(HERE / "verl_raystub"))
    import ray

    return bool(getattr(ray, "STUB", False))


def _install_cpu_platform() -> None:
    """CPU only: a verl platform named "cpu" (verl 0.9.1 falls back to "cuda" without a GPU)."""
    import types

    import torch
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import set_platform

    def _zero(*args, **kwargs):
        return 0

    module = types.SimpleNamespace(
        synchronize=lambda *a, **k: None, empty_cache=lambda: None, current_device=lambda: "cpu",
        device_count=lambda: 1, is_available=lambda: True, set_device=lambda *a: None,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, max_memory_allocated=_zero,
        max_memory_reserved=_zero, memory_allocated=_zero, memory_reserved=_zero,
        mem_get_info=lambda *a: (0, 0), reset_peak_memory_stats=lambda *a: None,
        set_per_process_memory_fraction=lambda *a, **k: None, get_device_name=lambda *a: "CPU",
    )

    class PlatformCPU(PlatformCUDA):
        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def device_module(self):
            return module

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return "cpu"

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def empty_cache(self) -> None:
            pass

        def communication_backend_name(self) -> str:
            return "gloo"

    set_platform(PlatformCPU())


def _cpu_engine_to_by_direction() -> None:
    """CPU only: verl's FSDP engine registered for "cpu", and FSDPEngine.to told the direction.

    On a GPU, verl's ``BaseEngineCtx`` calls ``engine.to("cuda")`` on entry and
    ``engine.to("cpu")`` on exit. On the CPU both names are "cpu", and ``FSDPEngine.to`` takes
    its load branch both times; this version keeps, per part (model, optimizer), whether it is
    offloaded, and calls the same module-level helpers verl's ``to`` calls (patched or not).
    """
    from verl.workers.engine.base import BaseEngine, EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl as ti

    # verl registers its FSDP engine for "cuda" and "npu" only.
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
        ti.FSDPEngineWithLMHead)

    def to(self, device, model=True, optimizer=True, grad=True):
        BaseEngine.to(self, device=device, model=model, optimizer=optimizer, grad=grad)
        if self.engine_config.forward_only:
            return
        off = self.__dict__.setdefault("_cpu_offloaded", {"model": False, "optimizer": False})
        if model:
            (ti.load_fsdp_model_to_gpu if off["model"] else ti.offload_fsdp_model_to_cpu)(self.module)
            off["model"] = not off["model"]
        if optimizer and self.optimizer is not None:
            if off["optimizer"]:
                ti.load_fsdp_optimizer(self.optimizer, "cpu")
            else:
                ti.offload_fsdp_optimizer(self.optimizer)
            off["optimizer"] = not off["optimizer"]

    ti.FSDPEngine.to = to


# --------------------------------------------------------------------------------------------- prepare
def cmd_prepare(args) -> None:
    """A random-init (seeded) Qwen2 checkpoint folder at the published Qwen2.5 sizes; no download."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "src"))
    from torchferry.bench._common.presets import PRESETS

    p = dataclasses.asdict(PRESETS[args.preset])
    p["tie_word_embeddings"] = True  # as Qwen2.5-0.5B/1.5B: verl then builds the model on every rank
    if args.layers:
        p["num_hidden_layers"] = args.layers
    cfg = transformers.Qwen2Config(**p, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6)
    cfg.architectures = ["Qwen2ForCausalLM"]
    out = Path(args.model_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)  # verl loads it as fp32
    n = sum(x.numel() for x in model.parameters())
    synced = sum(v.numel() for v in model.state_dict().values())  # what the weight sync yields (tied: twice)
    (out / "torchferry_prepare.json").write_text(json.dumps({"preset": args.preset, "params": n, "seed": args.seed,
                                                             "layers": cfg.num_hidden_layers,
                                                             "state_dict_numel": synced}))
    print(f"prepare: {args.preset} ({n / 1e9:.3f} B parameters, {cfg.num_hidden_layers} layers) in {out} "
          f"({time.perf_counter() - t:.1f} s)", flush=True)


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
    (issue 27's measure needs at least that much compute to hide copies behind)."""
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

    Seeded by (seed, step, rank): the same on every run.
    """
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    b, p_len, r_len = shape.batch_per_rank, shape.prompt_len, shape.response_len
    prompts = torch.randint(1, vocab, (b, p_len), generator=g)
    responses = torch.randint(1, vocab, (b, r_len), generator=g)
    p_valid = torch.randint(max(1, p_len // 2), p_len + 1, (b,), generator=g)
    r_valid = torch.randint(max(1, r_len // 2), r_len + 1, (b,), generator=g)
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


def fingerprints(engine, weights: dict, device) -> dict[str, dict[str, str]]:
    """This rank's local parameter shards, optimizer-state tensors and weight-sync buffers of ``engine``
    (and its rollout's ``weights``), each as :func:`verl_isolate.fingerprint` (exact, computed on ``device``)."""
    import torch

    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {
        "params": {n: fingerprint(_local(p), device) for n, p in engine.module.named_parameters()},
        "optimizer_state": {f"{names.get(id(p), '?')}.{k}": fingerprint(_local(v), device)
                            for p, st in engine.optimizer.state.items() for k, v in st.items() if torch.is_tensor(v)},
        "weight_sync": {n: fingerprint(t, device) for n, t in weights.items()},
    }


def against(ref: dict[str, dict[str, str]], got: dict[str, dict[str, str]]) -> dict:
    """``got``'s fingerprints (:func:`fingerprints`) against verl's (``ref``): per kind the names that differ
    or that only one of them has, and how many were compared."""
    out: dict = {}
    for kind in ("params", "optimizer_state", "weight_sync"):
        a, b = ref[kind], got[kind]
        out[kind] = sorted(set(a) ^ set(b)) + sorted(n for n in b if n in a and a[n] != b[n])
    out["compared"] = {kind: len(got[kind]) for kind in ("params", "optimizer_state", "weight_sync")}
    return out


def merge_runs(parts: list[dict]) -> dict:
    """The records of one run from its processes' records (one per strategy, ``run --own``; or one
    process's of every strategy): strategies in the run's order, per rank every strategy's records, and
    each strategy's ``against_verl`` from the fingerprints.

    Raises:
        ValueError: the parts disagree on the ranks or the strategies, or verl's records are missing.
    """
    order = [s["label"] for s in parts[0]["strategies_all"]]
    specs = {s["label"]: s for part in parts for s in part["strategies"]}
    if sorted(specs) != sorted(order) or any([s["label"] for s in p["strategies_all"]] != order for p in parts):
        raise ValueError(f"the parts hold strategies {sorted(specs)}, the run names {order}")
    worlds = {len(p["per_rank"]) for p in parts}
    if len(worlds) != 1:
        raise ValueError(f"the parts have different numbers of ranks: {sorted(worlds)}")
    per_rank = []
    for rank in range(worlds.pop()):
        merged: dict = {"rank": rank, "strategies": {}}
        for p in parts:
            r = p["per_rank"][rank]
            merged["strategies"].update(r["strategies"])
            merged.setdefault("caching_host_allocator_pinned_bytes", {}).update(
                {label: r["caching_host_allocator_pinned_bytes"] for label in r["strategies"]})
        if "verl" not in merged["strategies"]:
            raise ValueError("verl's records are missing: it is the reference of against_verl")
        ref = merged["strategies"]["verl"]["fingerprints"]
        for rec in merged["strategies"].values():
            rec["against_verl"] = against(ref, rec["fingerprints"])
        per_rank.append(merged)
    base = parts[0]
    steps = min(p["config"]["steps"] for p in parts)
    return {**base, "strategies": [specs[label] for label in order], "per_rank": per_rank,
            "config": {**base["config"], "steps": steps, "processes": len(parts)}}


def _sha(t) -> str:
    import torch

    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _part_bytes(engine, part: str) -> int:
    """Bytes of this rank's parameters (``model``) or optimizer state (``optimizer``)."""
    import torch

    if part == "model":
        return sum(_local(p).numel() * _local(p).element_size() for p in engine.module.parameters())
    return sum(_local(v).numel() * _local(v).element_size() for st in engine.optimizer.state.values()
               for v in st.values() if torch.is_tensor(v))


class RolloutStandIn:
    """verl's colocated rollout (``BaseRollout``: ``async resume(tags)``, ``async release()``) without
    vLLM: its weights are the weight sync's bf16 device buffers (``weights``: name -> tensor, written by
    :func:`_weight_sync`), its KV cache a ``kv_bytes`` allocation, its generation ``matmuls`` bf16
    8192 x 8192 matmuls (a forward-only generation's compute) on operands inside the KV cache's bytes
    (vLLM's activations are within its ``gpu_memory_utilization`` too).

    The order of a verl step (``PPOTrainer._step_once``, verl 0.9.1): ``update_weights`` (``resume(["weights"])``,
    the sync, ``resume(["kv_cache"])``), ``generate_sequences``, the driver's ``sleep_replicas`` (:meth:`sleep`:
    the worker's code does not see it), then the training phases. Here the KV cache wakes at the start of
    the next step's rollout, so that it is held only while this strategy runs (the others' steps sit between).
    """

    def __init__(self, device, kv_bytes: int, matmuls: int) -> None:
        self.device, self.kv_bytes, self.matmuls = device, kv_bytes, matmuls
        self.weights: dict = {}
        self.kv = None

    async def resume(self, tags) -> None:
        import torch

        if "kv_cache" in tags and self.kv is None and self.kv_bytes:
            self.kv = torch.empty(self.kv_bytes, dtype=torch.uint8, device=self.device)
        # "weights": the sync allocates its buffers on first use after a sleep

    async def release(self) -> None:
        self.sleep()

    def sleep(self) -> None:
        """The driver's ``sleep_replicas``: KV cache and weights freed (vLLM's sleep)."""
        self.kv = None
        self.weights.clear()

    def generate(self) -> None:
        """The generation's compute, then a wait, as ``generate_sequences`` returns its tokens to the host."""
        import torch

        if self.matmuls:
            n = 8192 if self.device.type == "cuda" else 128  # the CPU check: that it runs
            g = torch.Generator(device=self.device).manual_seed(0)
            if self.kv is not None and self.kv.numel() >= 4 * n * n:  # inside the KV cache's memory, as vLLM's
                a, out = self.kv[:4 * n * n].view(torch.bfloat16).view(2, n, n).unbind(0)  # activations are
            else:
                a, out = torch.empty(2, n, n, dtype=torch.bfloat16, device=self.device).unbind(0)
            a.normal_(generator=g)
            for _ in range(self.matmuls):
                torch.matmul(a, a, out=out)
            del a, out
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def gpu_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.weights.values(), *([self.kv] if self.kv is not None
                                                                                    else [])])


def _gpu_bytes(engine, rollout: RolloutStandIn) -> int:
    """Device bytes this strategy holds: its parameters, gradients, buffers and optimizer state where they
    are on the GPU (each storage once), and its rollout's."""
    import torch

    seen: dict[int, int] = {}
    tensors = [*engine.module.parameters(), *engine.module.buffers()]
    tensors += [p.grad for p in engine.module.parameters() if p.grad is not None]
    if engine.optimizer is not None:
        tensors += [v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    for t in tensors:
        st = _local(t).untyped_storage()
        if _local(t).device.type == "cuda" and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values()) + rollout.gpu_bytes()


def _weight_sync(engine, into: dict, first: bool, device) -> int:
    """verl's weight sync without vLLM (``ActorRolloutRefWorker.update_weights``, verl 0.9.1):
    ``engine.get_per_tensor_param(layered_summon=False, base_sync_done=True)`` consumed into device
    buffers of the rollout's weight size (``into``: name -> bf16 tensor on ``device``, allocated on
    first use and kept, as the rollout's weights; verl hands the adapters over on the host). With LoRA that yields the adapters only, and on the ``first``
    sync the base goes first (``base_sync_done=False``), as verl does once with its default
    ``rollout.load_format: dummy``; without LoRA both calls yield every parameter (with
    ``param_offload`` read back from the host per tensor). Returns the bytes written."""
    import torch

    def consume(per_tensor) -> int:
        n = 0
        for name, t in per_tensor:
            dst = into.get(name)
            if dst is None:
                dst = into[name] = torch.empty(t.shape, dtype=torch.bfloat16, device=device)
            dst.copy_(t, non_blocking=True)
            n += dst.numel() * dst.element_size()
        return n

    per_tensor, peft_config = engine.get_per_tensor_param(layered_summon=False, base_sync_done=True)
    n = 0
    if peft_config is not None and first:  # update_weights' do_lora_base_sync
        base, _ = engine.get_per_tensor_param(layered_summon=False, base_sync_done=False)
        n += consume(base)
    return n + consume(per_tensor)


def _rewarm_cublas(device) -> None:
    """Makes cuBLAS's workspaces again on the current stream (plain and Lt, fp32 and bf16), which
    ``torch.cuda.empty_cache()`` frees with the cache: so the next step's start counts them among the
    process's fixed bytes (``others``), as before its first empty_cache, not as the step's own (32 MiB under
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which a tight dock budget does not hold)."""
    import torch

    a = torch.ones(16, 16, device=device)
    for x in (a, a.bfloat16()):
        torch.nn.functional.linear(x, x, x[0])
        x @ x


LOGPROB_ROWS = 2048  # rows per log_softmax in the chunked log-probs (verl's entropy chunk size)


def _logprobs_chunked(logits, labels, inplace_backward: bool = True):
    """The bench's stand-in for ``verl.utils.torch_functional.logprobs_from_logits`` in verl's FSDP
    engine, for every strategy alike: ``log_softmax`` over ``LOGPROB_ROWS`` rows at a time, then each
    row's label entry. ``logits``: (N, vocab) or (..., vocab); ``labels``: the leading shape, int64;
    returns the log-probs in ``labels``' shape and ``logits``' dtype.

    Why: without flash-attn's cross-entropy kernel (not installed here, and turned off by verl's
    ``full_determinism``, ``VERL_DISABLE_FLASH_ATTN_CE=1``) verl falls back to
    ``logprobs_from_logits_v2``, which runs one ``log_softmax`` per token in a Python loop. Measured on
    one H200 (a compute-rich update_actor of Qwen2.5-1.5B, resident, torch 2.11): 472,510 kernels a step,
    3.2 s of kernel time against 13.3 s of wall under the profiler, host-bound, and step times spread by
    2-4 s, more than the transfers this bench measures. Same maths per row (``log_softmax`` over the
    vocabulary, deterministic); a verl user with flash-attn installed gets one fused kernel instead.
    (The kernel counts are from a profiler probe whose output is not kept; the spread is the f70690e
    run, ``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-full-compute-rich_h200x1_2026-12-02.json``.)

    Raises:
        ValueError: ``labels`` does not name one entry per row of ``logits``.
    """
    import torch

    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels of shape {tuple(labels.shape)} for logits of shape {tuple(logits.shape)}: "
                         "one label per row of logits expected")
    rows = logits.reshape(-1, logits.shape[-1])
    index = labels.reshape(-1, 1)
    out = [torch.log_softmax(rows[i:i + LOGPROB_ROWS], dim=-1).gather(-1, index[i:i + LOGPROB_ROWS]).squeeze(-1)
           for i in range(0, rows.shape[0], LOGPROB_ROWS)]
    return (torch.cat(out) if out else rows.new_empty(0)).view(labels.shape)


BUDGETS = {
    "tight": "too small to hold everything at once: the rollout (weights and KV cache) with the optimizer state and "
             "half of the parameters' bytes (so a set must leave for the rollout: the dock evicts the parameters, "
             "the fewest bytes to bring back), and update_actor's phase (parameters, optimizer state, gradients and "
             "activations)",
    "roomy": "twice everything at once (the rollout, parameters, gradients and optimizer state): nothing need move",
}


def dock_budget(kind: str, params: int, world: int, kv_bytes: int, weights_bytes: int) -> int:
    """The dock strategy's budget on each rank (bytes), from the model's parameter count and the rollout
    stand-in's KV cache (see :data:`BUDGETS`): fp32 parameters and gradients (4 bytes a parameter, sharded over
    ``world`` ranks), AdamW's two fp32 moments (8 bytes), the rollout's bf16 weights (``weights_bytes``, whole
    on each rank). Tight: KV + weights + half the parameters + the optimizer state; roomy: twice the sum of all.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in BUDGETS:
        raise ValueError(f"budget kind {kind!r} is none of {sorted(BUDGETS)}")
    p, o, w = 4 * params // world, 8 * params // world, weights_bytes
    if kind == "tight":
        return kv_bytes + w + p // 2 + o
    return 2 * (kv_bytes + w + 2 * p + o)


@dataclasses.dataclass
class Strategy:
    """One way of running the actor: ``resident`` (verl with param_offload and optimizer_offload off),
    ``verl`` (verl's own helpers: the seed), ``torchferry`` (``patch()`` with these environment
    settings; the label names a variant)."""

    label: str
    kind: str
    env: dict[str, str]


def parse_strategies(specs: list[str]) -> list[Strategy]:
    """``resident``, ``verl``, ``torchferry`` and ``LABEL:K=V,K=V`` (a torchferry variant with these
    environment settings, e.g. ``plain:TORCHFERRY_LAYERWISE_RELOAD=0``).

    Raises:
        SystemExit: a spec is malformed, a label repeats, or ``verl`` is missing (the reference).
    """
    out: list[Strategy] = []
    for spec in specs:
        if spec in ("resident", "verl", "torchferry"):
            out.append(Strategy(spec, spec, {}))
            continue
        label, sep, kvs = spec.partition(":")
        pairs = [kv.partition("=") for kv in kvs.split(",") if kv]
        if not sep or not label or not pairs or any(not k or not s for k, s, _ in pairs):
            raise SystemExit(f"error: strategy {spec!r} is none of resident, verl, torchferry, LABEL:K=V[,K=V]")
        out.append(Strategy(label, "torchferry", {k: v for k, _, v in pairs}))
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels) or "verl" not in labels:
        raise SystemExit(f"error: strategies {labels} must have distinct labels and include verl (the reference)")
    return out


def _settings_env() -> dict[str, str]:
    """The process's TORCHFERRY_* settings (those patch() reads)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHFERRY_") and k != "TORCHFERRY_COMMIT"}


def cmd_run(args) -> None:
    cpus = None
    if args.cpu_slot:  # before torch starts a thread: every thread of the process inherits the share
        cpus = pin_cpus(args.cpu_slot[0], args.cpu_slot[1], int(os.environ.get("LOCAL_RANK", 0)),
                        int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        os.environ.setdefault("OMP_NUM_THREADS", str(len(cpus)))
    stubbed = _use_ray_stub_if_needed()
    import asyncio
    import contextlib

    import torch

    cuda = torch.cuda.is_available()
    sys.path.insert(0, str(ROOT / "src"))
    if not cuda:
        _install_cpu_platform()
    import torch.distributed as dist

    if cuda:
        from verl.utils.distributed import initialize_global_process_group

        initialize_global_process_group()  # as verl's run_sft: cpu:gloo,cuda:nccl; set_device(LOCAL_RANK)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gpu = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ctx = context_bytes(gpu) if cuda else None  # the CUDA context (and NCCL's), before the allocator holds any

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(gpu)

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[verl_actor] {msg}", flush=True)

    import verl
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp import transformer_impl as ti
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    import torchferry.integrations.verl as tf_verl
    from torchferry.integrations.verl import docked, dock_rollout, ferry_for

    strategies = parse_strategies(args.strategies)
    if args.own and args.own not in {s.label for s in strategies}:
        raise SystemExit(f"error: --own {args.own!r} is not among the strategies {[s.label for s in strategies]}")
    # [Note: one process per strategy]: with --own this process builds and steps that strategy alone,
    # taking its turns with the other strategies' processes through --turns.
    own = [s for s in strategies if not args.own or s.label == args.own]
    turns = Turns(args.turns, rank)
    isolated = bool(args.own)
    kinds = {s.label: s.kind for s in strategies}
    with_dock = {s.label for s in strategies if s.env.get("TORCHFERRY_VERL_DOCK", "0") not in ("", "0")}
    prepared = json.loads((Path(args.model_dir) / "torchferry_prepare.json").read_text())
    weights_bytes = 2 * prepared.get("state_dict_numel", prepared["params"])  # the stand-in rollout's bf16 weights
    docks: dict[str, dict] = {}  # label -> its budget: patch(dock=...) keeps one dock per budget
    for s in strategies:  # TORCHFERRY_VERL_DOCK=tight|roomy: the budget from the sizes (dock_budget)
        if s.label in with_dock:
            kind = s.env["TORCHFERRY_VERL_DOCK"] if s.env["TORCHFERRY_VERL_DOCK"] in BUDGETS else None
            if kind:
                s.env["TORCHFERRY_VERL_DOCK"] = str(dock_budget(kind, prepared["params"], world,
                                                                int(args.rollout_gb * 1e9), weights_bytes))
                log(f"{s.label}: a {kind} budget of {int(s.env['TORCHFERRY_VERL_DOCK']) / 1e9:.3f} GB")
            docks[s.label] = {"budget": kind, "budget_why": BUDGETS.get(kind or ""),
                              "TORCHFERRY_VERL_DOCK": s.env["TORCHFERRY_VERL_DOCK"]}
    if len({d["TORCHFERRY_VERL_DOCK"] for d in docks.values()}) < len(docks):
        raise SystemExit(f"error: dock strategies {sorted(docks)} share a budget, so they would share one dock")
    if not cuda:
        _cpu_engine_to_by_direction()
    base_env = _settings_env()
    patched_names: dict[str, list[str]] = {}

    @contextlib.contextmanager
    def active(s: Strategy):
        """The strategy's helpers in place: patch() under its settings, or verl's own."""
        saved = {k: os.environ.get(k) for k in s.env}
        os.environ.update(s.env)
        try:
            if s.kind == "torchferry":
                patched_names[s.label] = tf_verl.patch()
            else:
                tf_verl.unpatch(keep_offloaded=True)
            yield
        finally:
            # the other strategies' turns: this one's state stays in its ferries' pools until its next turn
            tf_verl.unpatch(keep_offloaded=True)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # Timing around verl's FSDPEngine.to (instrumentation only: it calls verl's own method).
    current: dict = {"label": None, "phase": "init", "step": -1}
    records: dict[str, dict] = {s.label: {"events": []} for s in strategies}
    verl_to = ti.FSDPEngine.to

    def timed_to(self, device, model=True, optimizer=True, grad=True):
        if cuda:
            direction = "offload" if device == "cpu" else "reload"
        else:  # the CPU check: the part's state before the call (see _cpu_engine_to_by_direction)
            off = self.__dict__.get("_cpu_offloaded", {"model": False, "optimizer": False})
            direction = "reload" if off["model" if model else "optimizer"] else "offload"
        with_optimizer = bool(optimizer and self.optimizer is not None and self.optimizer.state)
        sync()  # a phase boundary: verl's phases end with their outputs on the host
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = verl_to(self, device, model=model, optimizer=optimizer, grad=grad)
        if direction == "offload":
            sync()  # the next phase (the rollout) needs the memory: the copies complete here
        host_s = time.perf_counter() - t0
        if end is not None:
            end.record()  # a reload: where the compute stream may go on (no sync: the phase's forward follows)
        residency: dict[str, str | None] = {"model": None, "optimizer": None}
        parts = [p for p, on in (("model", model), ("optimizer", with_optimizer)) if on]
        moved = sum(_part_bytes(self, p) for p in parts)  # what verl's helpers move: the whole part
        for part, obj in (("model", self.module), ("optimizer", self.optimizer)):
            f = None if obj is None else ferry_for(obj)
            residency[part] = None if f is None else f.residency.name
            if f is not None and part in parts and direction == "offload":  # unchanged storages stay
                moved += f.stats.offload_bytes_copied - _part_bytes(self, part)
        records[current["label"]]["events"].append({
            "phase": current["phase"], "step": current["step"], "direction": direction, "model": bool(model),
            "optimizer": with_optimizer, "host_s": host_s, "seconds": host_s, "_timing": (start, end),
            "bytes": 0 if kinds[current["label"]] == "resident" else moved,
            "gpu_allocated_after": torch.cuda.memory_allocated() if cuda else 0,
            "model_residency_after": residency["model"], "optimizer_residency_after": residency["optimizer"]})
        return out

    def resolve_timings(label: str) -> None:
        """After a synchronisation: each reload's seconds from its call until the compute stream could go on."""
        for e in records[label]["events"]:
            start, end = e.pop("_timing", (None, None))
            if start is not None and e["direction"] == "reload":
                e["seconds"] = max(start.elapsed_time(end) / 1e3, 0.0)

    ti.FSDPEngine.to = timed_to
    if args.logprobs == "chunked":  # see _logprobs_chunked: the same for every strategy
        ti.logprobs_from_logits = _logprobs_chunked

    shape = _shape(args.tiny, args.shape)
    if args.micro_batch:  # the same tokens per phase in fewer, larger forward/backward passes
        shape = dataclasses.replace(shape, micro_batch_per_gpu=args.micro_batch[0],
                                    log_prob_micro_batch_per_gpu=args.micro_batch[1])
        per_mini = shape.batch_per_rank // shape.mini_batches
        if min(args.micro_batch) < 1 or per_mini % shape.micro_batch_per_gpu or \
                shape.batch_per_rank % shape.log_prob_micro_batch_per_gpu:
            raise SystemExit(f"error: --micro-batch {args.micro_batch[0]} {args.micro_batch[1]} must divide the "
                             f"{per_mini} sequences of a PPO mini-batch and the {shape.batch_per_rank} of a phase")
    mini = shape.batch_per_rank * world // shape.mini_batches
    actors: dict[str, tuple] = {}
    for s in own:  # each strategy's own actor, built with its helpers in place
        turns.wait(strategies.index(s))
        cfg = _verl_config(args.model_dir, shape, world, args.lr, offload=s.kind != "resident",
                           strategy=args.strategy, lora_rank=args.lora_rank)
        current.update(label=s.label, phase="init", step=-1)
        with active(s):
            t_build = time.perf_counter()
            actor, actor_config = _build_actor(cfg)
            sync()
            records[s.label]["build_s"] = time.perf_counter() - t_build
        resolve_timings(s.label)
        actors[s.label] = (actor, actor_config)
        log(f"{s.label}: {type(actor).__name__} / {type(actor.engine).__name__} built in "
            f"{records[s.label]['build_s']:.1f} s, "
            f"{sum(p.numel() for p in actor.engine.module.parameters()) / 1e9:.3f} B parameters")
        if cuda:  # what the build left cached is not the steps' (verl's own init empties the cache too)
            torch.cuda.empty_cache()
        turns.done(strategies.index(s))
    rollouts = {s.label: RolloutStandIn(gpu, int(args.rollout_gb * 1e9), args.rollout_matmuls) for s in own}
    for label in with_dock & {s.label for s in own}:  # its weights (the sync's bf16 bytes) and KV cache become the dock's claimants
        s = next(x for x in strategies if x.label == label)
        with active(s):
            dock_rollout(rollouts[label], weights_bytes, int(args.rollout_gb * 1e9))
    if args.cublas_workspace:  # before any matmul of the process: torch reads it at its first cuBLAS call
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = args.cublas_workspace
    vocab = actors[own[0].label][0].engine.module.config.vocab_size
    probe = StepProbe(gpu)
    lora = bool(args.lora_rank)
    for r in records.values():
        r.update(losses=[], grad_norms=[], log_prob_sha256=[], log_prob_sum=[], ref_log_prob_sha256=[],
                 step_s=[], phase_s=[], gpu_allocated_at_start=[], peak_gpu_allocated=[], weight_sync_bytes=0,
                 weight_sync_bytes_per_step=[], peak_own_gpu_bytes=[], dock_steps=[], order=[],
                 phase_peak_gpu_bytes=[], at_rollout_wake=[], probe=[], context_bytes=ctx)

    def one_step(s: Strategy, step: int) -> None:
        actor, actor_config = actors[s.label]
        engine, rec, rollout = actor.engine, records[s.label], rollouts[s.label]
        current.update(label=s.label, step=step)
        vd = docked()
        others = 0  # device bytes of the other strategies (where their last step left them)
        if cuda:
            _rewarm_cublas(gpu)  # the last step's empty_cache() freed cuBLAS's workspaces: counted in `others`
            sync()
            torch.cuda.reset_peak_memory_stats(gpu)
            if vd is not None:
                vd.take_peak()
            rec["gpu_allocated_at_start"].append(torch.cuda.memory_allocated(gpu))
            others = rec["gpu_allocated_at_start"][-1] - _gpu_bytes(engine, rollout)
        stats0 = vd.dock.stats if vd is not None and vd.dock is not None else None
        seq0 = vd.dock.moves[-1].seq + 1 if vd is not None and vd.dock is not None and vd.dock.moves else 0
        peaks: dict[str, int] = {}

        def peak(phase: str) -> None:  # the phase's peak allocated bytes of this strategy's own, then a new phase
            if cuda:
                peaks[phase] = max(torch.cuda.max_memory_allocated(gpu), vd.take_peak() if vd is not None else 0) \
                    - others
                torch.cuda.reset_peak_memory_stats(gpu)

        if cuda:  # what the rollout finds when it wakes: the device's free bytes (another process's included)
            free, total = torch.cuda.mem_get_info(gpu)  # and this process's bytes held (allocator + context)
            rec["at_rollout_wake"].append({
                "device_free_bytes": free, "device_total_bytes": total,
                "allocated_bytes": torch.cuda.memory_allocated(gpu) - others,
                "reserved_bytes": torch.cuda.memory_reserved(gpu),
                "free_alone_bytes": total - torch.cuda.memory_reserved(gpu) - (ctx or 0) if isolated else None})
        probe.begin()
        t_step = time.perf_counter()
        marks = {}
        if args.rollout_gb or args.rollout_matmuls:  # the KV cache wakes, the generation, the driver's sleep
            current["phase"] = "rollout"
            asyncio.run(rollout.resume(["kv_cache"]))
            rollout.generate()
            rollout.sleep()
        marks["rollout"] = time.perf_counter()
        peak("rollout")
        batch, advantages = _batch(step, rank, shape, vocab, args.seed)
        # compute_log_prob (the trainer's _compute_old_log_prob -> ActorRolloutRefWorker.compute_log_prob)
        current["phase"] = "log_prob"
        td = left_right_2_no_padding(batch.clone())
        tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False,
                             temperature=1.0)
        out = actor.infer_batch(td)
        old_log_probs = no_padding_2_padding(tu.get(out, "log_probs"), td).float()
        rec["log_prob_sha256"].append(_sha(old_log_probs))
        rec["log_prob_sum"].append(float(old_log_probs.double().sum()))
        marks["log_prob"] = time.perf_counter()
        peak("log_prob")
        if lora:  # ref_in_actor: the reference is the actor with its adapters off (_compute_ref_log_prob)
            current["phase"] = "ref"
            td = left_right_2_no_padding(batch.clone())
            tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, no_lora_adapter=True,
                                 temperature=1.0)
            out = actor.infer_batch(td)
            rec["ref_log_prob_sha256"].append(_sha(no_padding_2_padding(tu.get(out, "log_probs"), td).float()))
            marks["ref"] = time.perf_counter()
            peak("ref")
        # update_actor (the trainer's _update_actor -> ActorRolloutRefWorker.update_actor)
        current["phase"] = "update"
        upd = batch.clone()
        upd["old_log_probs"] = old_log_probs.cpu()
        upd["advantages"] = advantages
        td = left_right_2_no_padding(upd)
        tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=mini, mini_batch_size=mini, epochs=1, seed=actor_config.data_loader_seed,
                             dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)
        out = actor.train_mini_batch(td)
        metrics = tu.get(out, "metrics")
        rec["losses"].append([float(x) for x in metrics["loss"]])
        rec["grad_norms"].append([float(x) for x in metrics.get("grad_norm", [])])
        marks["update"] = time.perf_counter()
        peak("update")
        if args.weight_sync:  # ActorRolloutRefWorker.update_weights, after update_actor
            current["phase"] = "weight_sync"
            if cuda:  # update_weights empties the cache before the rollout's weights wake (engine_workers.py)
                torch.cuda.empty_cache()
            asyncio.run(rollout.resume(["weights"]))
            rec["weight_sync_bytes"] = _weight_sync(engine, rollout.weights, first=step == 0, device=gpu)
            rec["weight_sync_bytes_per_step"].append(rec["weight_sync_bytes"])  # LoRA: the first with the base
            sync()
            if cuda:  # and again after the sync, before the KV cache wakes
                torch.cuda.empty_cache()
        if vd is not None and vd.dock is not None:  # the step ends when the dock's copies are complete
            vd.dock.wait()
            sync()
        marks["weight_sync"] = time.perf_counter()
        rec["step_s"].append(time.perf_counter() - t_step)
        rec["probe"].append(probe.end())
        if args.weight_sync or vd is not None:
            peak("weight_sync")
        rec["phase_peak_gpu_bytes"].append(peaks)
        if vd is not None and vd.dock is not None:
            st = vd.dock.stats
            rec["dock_steps"].append({
                "bytes_loaded": st.bytes_loaded - (stats0.bytes_loaded if stats0 else 0),
                "bytes_evicted": st.bytes_evicted - (stats0.bytes_evicted if stats0 else 0),
                "moves": [{"at_s": m.at - t_step, "kind": m.kind, "name": m.name, "bytes": m.nbytes,
                           "background": m.background} for m in vd.dock.moves if m.seq >= seq0],
                "marks_s": {k: t - t_step for k, t in marks.items()}, "resident_bytes_after": vd.dock.resident_bytes})
        prev, spans = t_step, {}
        for k, t in marks.items():
            spans[k], prev = t - prev, t
        rec["phase_s"].append(spans)
        if cuda:  # the step's peak: the largest of its phases'
            rec["peak_gpu_allocated"].append(max(peaks.values()) + others)
            rec["peak_own_gpu_bytes"].append(max(peaks.values()))  # this strategy's own peak in its step
        resolve_timings(s.label)

    t_rounds = time.perf_counter()
    n = len(strategies)
    for step in range(args.steps):  # rounds: every strategy one step, the order rotated each round
        k = step % n
        order = strategies[k:] + strategies[:k]
        mine_now = [s for s in order if s in own]
        first = turns.folder is not None and order[0] in own
        if turns.folder is None and args.max_round_seconds and step >= 2:  # one process: rank 0 decides
            stop = [time.perf_counter() - t_rounds > args.max_round_seconds]
            dist.broadcast_object_list(stop, src=0)
            if stop[0]:
                log(f"stopping after {step} rounds: past --max-round-seconds {args.max_round_seconds}")
                break
        stopped = False
        for s in mine_now:
            ticket = n + step * n + order.index(s)
            turns.wait(ticket)
            if first and s is order[0]:  # the round's first turn: stop starting rounds past the budget
                turns.decide_stop(step, args.max_round_seconds)
            if isolated:
                dist.barrier()  # every rank read the same stop
            if turns.stop_round() is not None and turns.stop_round() <= step:
                stopped = True
                turns.done(ticket)
                break
            if args.settle_seconds:  # what the previous turn left running on the host (memory given back) ends
                time.sleep(args.settle_seconds)
            with active(s):
                one_step(s, step)
            records[s.label]["order"].append(order.index(s))
            gc.collect()  # between turns, not inside the next strategy's step (the probe counts what is left)
            if isolated and cuda:  # what this process cached goes back before the next strategy's turn, as a
                torch.cuda.empty_cache()  # colocated role's would before the rollout wakes (else: OOM beside it)
                _rewarm_cublas(gpu)  # empty_cache() also freed cuBLAS's workspaces: not the next step's bytes
            if isolated:
                dist.barrier()
            turns.done(ticket)
        if stopped:
            log(f"stopping after {step} rounds: past --max-round-seconds {args.max_round_seconds}")
            break
        log(f"round {step + 1}/{args.steps}: " + ", ".join(
            f"{s.label} {records[s.label]['step_s'][-1]:.2f} s (loss {records[s.label]['losses'][-1]})"
            for s in mine_now))

    sync()
    pinned_process = 0
    if cuda and hasattr(torch.cuda, "host_memory_stats"):
        hs = torch.cuda.host_memory_stats()
        pinned_process = int(hs.get("reserved_bytes.current", hs.get("allocated_bytes.current", 0)))
    mine: dict = {"rank": rank, "strategies": {}}
    for s in own:
        actor, _ = actors[s.label]
        engine, rec = actor.engine, records[s.label]
        ferries = [f for f in (ferry_for(engine.module), ferry_for(engine.optimizer)) if f is not None]
        mine["strategies"][s.label] = {
            **rec,
            "state_bytes": {"params": _part_bytes(engine, "model"), "optimizer": _part_bytes(engine, "optimizer")},
            "torchferry_pool_bytes": {"pinned": sum(f.pinned_bytes for f in ferries),
                                      "host": sum(f.host_bytes for f in ferries)},
            "ferries": [repr(f) for f in ferries], "cpus": cpus,
            # The state after the steps (offloaded by verl's update_actor exit), fingerprinted exactly; compared
            # with verl's by against_verl once every strategy's records are together (merge_runs).
            "fingerprints": fingerprints(engine, rollouts[s.label].weights, gpu),
        }
        if s.label in with_dock:
            with active(s):
                vd = docked()
                mine["strategies"][s.label]["dock"] = None if vd is None or vd.dock is None else {
                    "budget_bytes": vd.dock.budget_bytes, "budget": os.environ.get("TORCHFERRY_VERL_DOCK"),
                    "stats": dataclasses.asdict(vd.dock.stats),
                    "workspace_bytes": {e.workspace[m]: b for e in vd.engines.values() for m, b in e.measured.items()},
                    "phase_log": [[event, list(names)] for event, names in list(vd.phase_log)[-40:]]}
    mine["caching_host_allocator_pinned_bytes"] = pinned_process
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        import transformers

        result = {
            "schema": "torchferry.verl-step-runs/1",
            "ray": "stand-in (benchmarks/verl_raystub)" if stubbed else "installed",
            "env": {"gpu": torch.cuda.get_device_name(gpu) if cuda else None, "torch": torch.__version__,
                    "verl": verl.__version__, "transformers": transformers.__version__, "world_size": world,
                    "python": sys.version.split()[0], "device": str(gpu),
                    "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                    "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None},
            "strategies": [{"label": s.label, "kind": s.kind, "settings": {**base_env, **s.env},
                            "patched": patched_names.get(s.label, [])} for s in own],
            "strategies_all": [{"label": s.label, "kind": s.kind} for s in strategies],
            "config": {"steps": len(records[own[0].label]["step_s"]), "seed": args.seed, "lr": args.lr,
                       "shape": "tiny" if args.tiny else args.shape,
                       **dataclasses.asdict(shape), "tokens_per_phase_per_rank": shape.batch_per_rank * (
                           shape.prompt_len + shape.response_len),
                       "attn_implementation": ATTENTION, "full_determinism": True,
                       "logprobs": (f"chunked: log_softmax over {LOGPROB_ROWS} rows at a time (the bench's "
                                    "_logprobs_chunked)" if args.logprobs == "chunked" else
                                    "verl: logprobs_from_logits_v2, one log_softmax per token"),
                       "strategy": args.strategy, "lora": lora, "lora_rank": args.lora_rank,
                       "phases": ["rollout", "log_prob", *(["ref"] if lora else []), "update",
                                  *(["weight_sync"] if args.weight_sync else [])],
                       "rollout_stand_in": {"kv_cache_bytes": int(args.rollout_gb * 1e9),
                                            "matmuls_8192_bf16": args.rollout_matmuls},
                       "weight_sync": args.weight_sync,
                       "docks": docks,
                       "optimizer": f"{actor_config.optim.optimizer} (lr {actor_config.optim.lr}, "
                                    f"clip_grad {actor_config.optim.clip_grad})",
                       "ppo_mini_batch_size": mini, "model_dir": args.model_dir,
                       "model": json.loads((Path(args.model_dir) / "torchferry_prepare.json").read_text())},
            "per_rank": gathered,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        log(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- report
def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _view(runs: dict, label: str) -> dict:
    """One strategy's records, per rank: ``{"per_rank": [...]}`` (what :func:`identical` compares)."""
    return {"per_rank": [{"rank": r["rank"], **r["strategies"][label]} for r in runs["per_rank"]]}


def _transfers(rank_result: dict) -> dict:
    """FSDPEngine.to seconds, first and steady (median of the later ones).

    ``offload_s`` / ``reload_s``: update_actor's, of the full state (parameters and AdamW state;
    the first reload with optimizer state is step 2's, the state exists after step 1's update);
    ``model_only_*``: compute_log_prob's (parameters); ``init_offload_s``: the engine's
    initialize() (parameters, before any optimizer state).
    """
    events = rank_result["events"]
    out = {}
    full = [e for e in events if e["phase"] == "update" and e["model"] and e["optimizer"]]
    lp = [e for e in events if e["phase"] == "log_prob" and e["model"]]
    for key, evs, direction in (("offload_s", full, "offload"), ("reload_s", full, "reload"),
                                ("model_only_offload_s", lp, "offload"), ("model_only_reload_s", lp, "reload")):
        xs = [e["seconds"] for e in evs if e["direction"] == direction]
        out[key] = {"first": xs[0] if xs else None, "steady": _median(xs[1:]), "all": xs}
    init = [e["seconds"] for e in events if e["phase"] == "init" and e["direction"] == "offload"]
    out["init_offload_s"] = init[0] if init else None
    out["gpu_bytes_left_offloaded"] = _median([e["gpu_allocated_after"] for e in full if e["direction"] == "offload"])
    return out


def _bytes_per_step(rank_result: dict) -> dict[str, int | None]:
    """Bytes each direction moved per step (median over the steps after the first), from
    ``FSDPEngine.to``'s events: verl's helpers move whole parts, torchferry skips unchanged storages."""
    out: dict[str, int | None] = {}
    steps = sorted({e["step"] for e in rank_result["events"] if e["step"] >= 1})
    for direction in ("offload", "reload"):
        per = [sum(e.get("bytes", 0) for e in rank_result["events"] if e["step"] == s and e["direction"] == direction)
               for s in steps]
        out[direction] = int(statistics.median(per)) if per else None
    return out


def _dock_bytes_per_step(rank_result: dict) -> dict[str, int | None]:
    """A dock strategy's bytes per step (median over the steps after the first): its evictions (offload)
    and loads (reload), prefetches included, from the dock's counts."""
    steps = rank_result["dock_steps"][1:]
    return {"offload": int(statistics.median([x["bytes_evicted"] for x in steps])) if steps else None,
            "reload": int(statistics.median([x["bytes_loaded"] for x in steps])) if steps else None}


def identical(a: dict, b: dict) -> tuple[dict[str, bool], dict[str, object]]:
    """Exact comparison of a strategy's records (:func:`_view`) with verl's (``a``): losses, old
    (and reference) log-probs (sha256), and ``b``'s parameter shards, optimizer state and
    weight-sync buffers, compared byte for byte in the run against verl's (``against_verl``).

    Returns:
        ``(same, differing)``: per kind whether all are equal, and what differs (rank:name).

    Raises:
        ValueError: the two have different numbers of ranks.
    """
    if len(a["per_rank"]) != len(b["per_rank"]):
        raise ValueError(f"the runs have {len(a['per_rank'])} and {len(b['per_rank'])} ranks")
    diffs: dict[str, object] = {"losses": a["per_rank"][0]["losses"] != b["per_rank"][0]["losses"],
                                "log_probs": [], "params": [], "optimizer_state": [], "weight_sync": []}
    for ra, rb in zip(a["per_rank"], b["per_rank"], strict=True):
        if (ra["log_prob_sha256"], ra.get("ref_log_prob_sha256")) != (rb["log_prob_sha256"],
                                                                      rb.get("ref_log_prob_sha256")):
            diffs["log_probs"].append(ra["rank"])
        for kind in ("params", "optimizer_state", "weight_sync"):
            diffs[kind] += [f"rank{rb['rank']}:{n}" for n in rb["against_verl"][kind]]
    same = {k: not v for k, v in diffs.items()}
    return same, {k: v for k, v in diffs.items() if v}


def _spread(xs: list[float]) -> dict:
    return {"median": _median(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None, "all": xs}


def _exposed(views: dict[str, dict], resident: str = "resident") -> dict:
    """What offload costs a step: per round, each strategy's step seconds less the resident step of
    the same round (rank 0), over the rounds after the first; per phase too; and each against verl's."""
    base = views[resident]["per_rank"][0]
    rs = base["step_s"][1:]
    out: dict = {"what": "per round after the first: the strategy's step seconds less the resident strategy's step "
                         "of the same round (rank 0); median, min, max over the rounds; per phase: the median of "
                         "the phase's seconds less the resident's of the same round",
                 "resident_step_s": _spread(rs),
                 "resident_step_spread": (max(rs) - min(rs)) / _median(rs) if rs else None,
                 "resident_phase_s": {k: _spread([p[k] for p in base["phase_s"][1:]])
                                      for k in (base["phase_s"][0] if base["phase_s"] else {})}}
    for label, v in views.items():
        if label == resident:
            continue
        r0 = v["per_rank"][0]
        per_round = [a - b for a, b in zip(r0["step_s"][1:], base["step_s"][1:])]
        phases = {k: _median([a[k] - b[k] for a, b in zip(r0["phase_s"][1:], base["phase_s"][1:])])
                  for k in (r0["phase_s"][0] if r0["phase_s"] else {})}
        at_calls = [sum(e["seconds"] for e in r0["events"] if e["step"] == st) for st in range(1, len(r0["step_s"]))]
        at_phase = {k: _median([sum(e["seconds"] for e in r0["events"] if e["step"] == st and e["phase"] == k)
                                for st in range(1, len(r0["step_s"]))]) for k in phases}
        host_phase = {k: _median([sum(e["host_s"] for e in r0["events"] if e["step"] == st and e["phase"] == k)
                                  for st in range(1, len(r0["step_s"]))]) for k in phases}
        out[label] = {"step_s": _spread(r0["step_s"][1:]),
                      "exposed_transfer_s_per_step": _spread(per_round), "exposed_s_per_phase": phases,
                      "exposed_s_per_phase_per_round": [
                          {k: a[k] - b[k] for k in a} for a, b in zip(r0["phase_s"][1:], base["phase_s"][1:])],
                      "transfer_at_calls_s_per_step": _spread(at_calls), "transfer_at_calls_s_per_phase": at_phase,
                      "host_s_in_calls_per_phase": host_phase}
    out["attribution"] = ("exposed_s_per_phase (the phase less the resident's of the same round) beside "
                          "transfer_at_calls_s_per_phase (the phase's FSDPEngine.to seconds, as transfer_at_calls) and "
                          "host_s_in_calls_per_phase (the host's seconds inside those calls): where the first exceeds "
                          "the second, the phase waited on transfers after its calls returned (a layer-wise reload's "
                          "units, optimizer_at_step's state) or ran slower beside them")
    out["transfer_at_calls"] = ("per round after the first: the sum of the step's FSDPEngine.to seconds (an offload "
                                "until its copies are complete, a reload until the compute stream may go on); what a "
                                "layer-wise reload's units or optimizer.step() wait for later is not in it")
    for key, ratio in (("exposed_transfer_s_per_step", "over_verl"), ("transfer_at_calls_s_per_step",
                                                                       "at_calls_over_verl")):
        v = out["verl"][key]["median"]
        for label in out:
            if isinstance(out[label], dict) and key in out[label] and label != "verl":
                t = out[label][key]["median"]
                out[label][ratio] = t / v if v and t is not None and v > 0 else None
    return out


def report(runs: dict, command: str | None = None) -> dict:
    """The ``torchferry.verl-step/1`` JSON from a run's records (:func:`cmd_run`)."""
    labels = [s["label"] for s in runs["strategies"]]
    kinds = {s["label"]: s["kind"] for s in runs["strategies"]}
    views = {label: _view(runs, label) for label in labels}
    world = runs["env"]["world_size"]

    def summary(label: str) -> dict:
        r0 = views[label]["per_rank"][0]
        sizes = r0["state_bytes"]
        tr = _transfers(r0)
        state = sizes["params"] + sizes["optimizer"]
        spec = next(s for s in runs["strategies"] if s["label"] == label)
        pools = r0["torchferry_pool_bytes"]["pinned"]
        return {
            "kind": kinds[label], **tr,
            "offload_GBps_steady": state / tr["offload_s"]["steady"] / 1e9 if tr["offload_s"]["steady"] else None,
            "reload_GBps_steady": state / tr["reload_s"]["steady"] / 1e9 if tr["reload_s"]["steady"] else None,
            "state_bytes": sizes,
            "pinned_host_bytes": pools + (runs["per_rank"][0]["caching_host_allocator_pinned_bytes"][label]
                                          if kinds[label] == "verl" else 0),
            "pinned_host_bytes_detail": {"torchferry_pools": pools, "torchferry_pool_bytes":
                                         r0["torchferry_pool_bytes"]["host"], "ferries": r0["ferries"]},
            "peak_gpu_allocated_bytes": max(r0["peak_gpu_allocated"]) if r0["peak_gpu_allocated"] else None,
            "gpu_allocated_at_step_start_bytes": _median(r0["gpu_allocated_at_start"]),
            "losses": r0["losses"], "grad_norms": r0["grad_norms"], "log_prob_sum": r0["log_prob_sum"],
            "step_s": r0["step_s"], "phase_s": r0["phase_s"], "order_in_round": r0["order"],
            "bytes_moved_per_step": _bytes_per_step(r0) if "dock" not in r0 else _dock_bytes_per_step(r0),
            "peak_own_gpu_bytes": max(r0["peak_own_gpu_bytes"]) if r0.get("peak_own_gpu_bytes") else None,
            "weight_sync_bytes": r0.get("weight_sync_bytes", 0),  # the last sync's bf16 rollout bytes
            "weight_sync_bytes_per_step": r0.get("weight_sync_bytes_per_step", []),
            "torchferry_settings": spec["settings"] if kinds[label] == "torchferry" else {},
            "build_s": r0["build_s"], "patched": spec["patched"],
            "per_rank": [{"rank": x["rank"], **_transfers(x), "state_bytes": x["state_bytes"]}
                         for x in views[label]["per_rank"]],
        }

    compared = {label: identical(views["verl"], views[label]) for label in labels if label != "verl"}
    ferried = [label for label in labels if kinds[label] == "torchferry"]
    env = dict(runs["env"])
    env["command"] = command or "bash benchmarks/verl_actor.sh"
    env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env["ray"] = runs["ray"]
    env["torchferry_commit"] = os.environ.get("TORCHFERRY_COMMIT")
    r0 = views["verl"]["per_rank"][0]
    out = {
        "schema": SCHEMA,
        "env": env,
        "verl_code": VERL_CODE,
        "model": runs["config"]["model"],
        "config": {**{k: v for k, v in runs["config"].items() if k not in ("model", "model_dir")},
                   "strategies": runs["strategies"], "interleaved": (
                       "one process per strategy ([Note: one process per strategy] in benchmarks/verl_isolate.py), "
                       "taking turns: " if runs["config"].get("processes", 1) > 1 else
                       "one process, one actor per strategy; ") + "each round runs every strategy's step, the order "
                   "rotated by one each round"},
        "units": "seconds; offload_s: from the call of verl's FSDPEngine.to until its copies are complete "
                 "(synchronised); reload_s: from the call until the compute stream may go on (CUDA events: "
                 "a reload left to the forward or to optimizer.step() counts only its call); bytes per rank; "
                 "GB/s = 1e9 B/s; offload/reload_s are update_actor's (parameters + AdamW state), first = "
                 "step 1, steady = median of the later steps; model_only_* are compute_log_prob's",
        "runs": {label: summary(label) for label in labels},
        "bit_identical": all(all(same.values()) for same, _ in compared.values()),
        "bit_identical_to_verl": {label: all(same.values()) for label, (same, _) in compared.items()},
        "bit_identical_detail": {
            label: {**same, "differing": diff} for label, (same, diff) in compared.items()},
        "compared": {"steps": len(r0["losses"]), "ranks": world,
                     "parameter_shards": sum(x["against_verl"]["compared"]["params"] for x in views["verl"]["per_rank"]),
                     "optimizer_state_tensors": sum(x["against_verl"]["compared"]["optimizer_state"]
                                                    for x in views["verl"]["per_rank"]),
                     "weight_sync_tensors": r0["against_verl"]["compared"]["weight_sync"]},
        "torchferry_strategies": ferried,
    }
    if "resident" in labels:
        out["exposed"] = _exposed(views)
    out["strategies"] = {}
    for label in labels:  # per strategy, what the issue of the dock asks for: its peak against its budget
        ranks = views[label]["per_rank"]
        peaks = [max(x["peak_own_gpu_bytes"]) for x in ranks if x.get("peak_own_gpu_bytes")]
        entry: dict = {"kind": kinds[label], "peak_gpu_bytes": max(peaks) if peaks else None,
                       "bytes_moved_per_step": out["runs"][label]["bytes_moved_per_step"], **_memory(ranks[0])}
        ex = out.get("exposed", {}).get(label)
        if isinstance(ex, dict):
            entry["exposed_transfer_s_per_step"] = ex["exposed_transfer_s_per_step"]["median"]
            entry["exposed_over_verl"] = ex.get("over_verl")
        dock = ranks[0].get("dock")
        if dock:
            entry.update(budget_bytes=dock["budget_bytes"], budget=dock["budget"],
                         within_budget=entry["peak_gpu_bytes"] is not None and all(
                             p <= x["dock"]["budget_bytes"] for p, x in zip(peaks, ranks, strict=True)),
                         dock_stats=dock["stats"], dock_phase_log=dock["phase_log"],
                         dock_steps=ranks[0]["dock_steps"])
        out["strategies"][label] = entry
    out["strategies_what"] = ("peak_gpu_bytes: the largest over the steps and ranks of the device's peak allocated "
                              "bytes in the strategy's step (its own: its process's, or, in one process, less the "
                              "other strategies' bytes at its start); phase_peak_gpu_bytes: per phase, the median over "
                              "the rounds after the first of that phase's peak allocated bytes (rank 0); "
                              "free_at_rollout_wake_bytes: the median over the rounds after the first, at the start of "
                              "the step before the rollout's KV cache is allocated, of the device's bytes less what "
                              "the strategy's process holds (the caching allocator's reserved bytes and its CUDA "
                              "context, NVML): what a rollout engine allocating outside PyTorch's allocator finds "
                              "free beside this strategy alone; device_free_at_rollout_wake_bytes: "
                              "torch.cuda.mem_get_info()'s free bytes then (other processes' bytes included); "
                              "probe_per_step: the allocator's retries, the garbage collector's seconds, the "
                              "process's CPU seconds and the SM clock per step; budget_bytes: the dock's budget "
                              "(TORCHFERRY_VERL_DOCK); dock_steps: per step, the dock's moves (issued at at_s after "
                              "the step's start) and bytes")
    out["bars"] = bars(out)
    return out


def _memory(r0: dict) -> dict:
    """A strategy's device memory per phase and at the rollout's wake (rank 0, rounds after the first)."""
    later = r0.get("phase_peak_gpu_bytes", [])[1:]
    wakes = r0.get("at_rollout_wake", [])[1:]
    alone = [w["free_alone_bytes"] for w in wakes if w.get("free_alone_bytes") is not None]
    return {"phase_peak_gpu_bytes": {k: int(statistics.median([p[k] for p in later if k in p]))
                                     for k in (later[0] if later else {})},
            "phase_peak_gpu_bytes_per_round": r0.get("phase_peak_gpu_bytes", []),
            "free_at_rollout_wake_bytes": int(statistics.median(alone)) if alone else None,
            "device_free_at_rollout_wake_bytes": int(statistics.median([w["device_free_bytes"] for w in wakes]))
            if wakes else None,
            "at_rollout_wake_per_round": r0.get("at_rollout_wake", []), "context_bytes": r0.get("context_bytes"),
            "probe_per_step": r0.get("probe", [])}


def bars(out: dict) -> dict:
    """The verl step's bars, decided from this run alone: the resident step's spread (max - min over the median,
    <= 0.05), each strategy's exposed transfer over verl's (median, and its worst round against verl's best),
    and its device memory against verl's (free at the rollout's wake >= verl's; no phase's peak above verl's
    by more than 1%). ``None`` where the run lacks what a bar needs."""
    ex, st = out.get("exposed") or {}, out["strategies"]
    res: dict = {"resident_step_spread": ex.get("resident_step_spread")}
    v = ex.get("verl", {}).get("exposed_transfer_s_per_step") if ex else None
    vmem = st.get("verl", {})
    for label, entry in st.items():
        if label in ("verl", "resident"):
            continue
        e = ex.get(label, {}).get("exposed_transfer_s_per_step") if ex else None
        row: dict = {}
        if e and v and v["median"] and v["min"]:
            row["exposed_over_verl"] = e["median"] / v["median"]
            row["worst_round_over_verl_best"] = e["max"] / v["min"] if v["min"] > 0 else None
        free, vfree = entry.get("free_at_rollout_wake_bytes"), vmem.get("free_at_rollout_wake_bytes")
        row["free_at_wake_ge_verl"] = None if free is None or vfree is None else free >= vfree
        peaks, vpeaks = entry.get("phase_peak_gpu_bytes") or {}, vmem.get("phase_peak_gpu_bytes") or {}
        row["phase_peak_over_verl"] = {k: peaks[k] / vpeaks[k] for k in peaks if vpeaks.get(k)}
        row["no_phase_above_verl_by_1pct"] = all(x <= 1.01 for x in row["phase_peak_over_verl"].values()) \
            if row["phase_peak_over_verl"] else None
        res[label] = row
    return res


def result_name(out: dict) -> str:
    """``verl_step_<preset>_<strategy>-<full|lora>-<shape>_<gpu>x<n>_<date>.json``."""
    c, env = out["config"], out["env"]
    gpu = (env["gpu"] or "cpu").split()[-1].lower()
    mode = f"{c.get('strategy', 'fsdp2')}-{'lora' if c.get('lora') else 'full'}-{c.get('shape', 'small')}"
    return f"verl_step_{out['model']['preset']}_{mode}_{gpu}x{env['world_size']}_{env['date'][:10]}.json"


def per_dock(out: dict) -> dict[str, dict]:
    """One result per dock strategy of a run (``config.docks``): the run's JSON with that strategy as
    ``strategies["torchferry+dock"]`` (the other dock strategies left out of ``strategies``) and its
    budget as ``config.budget`` (tight / roomy), ``config.budget_bytes``, ``config.budget_why``; keyed by
    the file-name suffix ``dock-<budget>``."""
    docks = out["config"].get("docks") or {}
    results = {}
    for label, d in docks.items():
        def one(table: dict, label: str = label) -> dict:  # this dock strategy as torchferry+dock, no other
            return {("torchferry+dock" if k == label else k): v for k, v in table.items()
                    if k == label or k not in docks}

        config = {**out["config"], "budget": d["budget"], "budget_why": d["budget_why"],
                  "budget_bytes": out["strategies"][label].get("budget_bytes"), "dock_strategy": label}
        res = {**out, "config": config}
        for key in ("strategies", "runs", "bit_identical_to_verl", "bit_identical_detail", "exposed"):
            if key in out:
                res[key] = one(out[key])
        results[f"dock-{d['budget'] or d['TORCHFERRY_VERL_DOCK']}"] = res
    return results


def cmd_report(args) -> None:
    runs = merge_runs([json.loads(Path(p).read_text()) for p in args.runs])
    if len(args.runs) > 1:  # the merged records beside the result, as one process writes them
        (Path(args.out_dir) / "runs.json").write_text(json.dumps(runs, indent=1))
    out = report(runs, args.command)
    path = Path(args.out_dir) / result_name(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    for suffix, one in per_dock(out).items():
        name = result_name(out).replace(".json", f"_{suffix}.json")
        (Path(args.out_dir) / name).write_text(json.dumps(one, indent=1))

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    print(f"{'':12} {'offload s first/steady':>24} {'reload s first/steady':>24} {'pinned host GB':>15}  losses")
    for k, s in out["runs"].items():
        print(f"{k:12} {f(s['offload_s']['first']) + ' / ' + f(s['offload_s']['steady']):>24} "
              f"{f(s['reload_s']['first']) + ' / ' + f(s['reload_s']['steady']):>24} "
              f"{s['pinned_host_bytes'] / 1e9:>15.2f}  {s['losses']}")
    print(f"bit_identical: {out['bit_identical']} (to verl: {out['bit_identical_to_verl']})")
    if "exposed" in out:
        ex = out["exposed"]
        print("exposed s/step (median [min, max]): " + ", ".join(
            f"{k} {f(v['exposed_transfer_s_per_step']['median'])} [{f(v['exposed_transfer_s_per_step']['min'])}, "
            f"{f(v['exposed_transfer_s_per_step']['max'])}]" + (f" = {f(v['over_verl'])}x verl" if "over_verl" in v
                                                                else "")
            for k, v in ex.items() if isinstance(v, dict) and "exposed_transfer_s_per_step" in v))
        print("transfer at FSDPEngine.to s/step (median [min, max]): " + ", ".join(
            f"{k} {f(v['transfer_at_calls_s_per_step']['median'])} [{f(v['transfer_at_calls_s_per_step']['min'])}, "
            f"{f(v['transfer_at_calls_s_per_step']['max'])}]" + (f" = {f(v['at_calls_over_verl'])}x verl"
                                                                 if "at_calls_over_verl" in v else "")
            for k, v in ex.items() if isinstance(v, dict) and "transfer_at_calls_s_per_step" in v))
        for k, v in ex.items():
            if isinstance(v, dict) and "exposed_s_per_phase" in v:
                print(f"  {k} per phase: " + ", ".join(f"{p} {f(x)}" for p, x in v["exposed_s_per_phase"].items()))
    print(f"wrote {path}")


def cmd_timeline(args) -> None:
    """A PNG of what a dock strategy moved and when: per result (``..._dock-<budget>.json``), its last step's
    phases (from ``dock_steps[-1].marks_s``) and the dock's moves issued in it (loads H2D, evictions D2H;
    the marker at the issue time, the label the set and its GB, "bg" for a prefetch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(Path(p).read_text()) for p in args.results]
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.3 * len(results)), squeeze=False)
    colors = {"rollout": "#bbbbbb", "log_prob": "#9ecae1", "ref": "#c6dbef", "update": "#6baed6",
              "weight_sync": "#fdae6b"}
    for ax, res in zip(axes[:, 0], results, strict=True):
        st = res["strategies"]["torchferry+dock"]["dock_steps"][-1]
        prev = 0.0
        for phase, end in st["marks_s"].items():
            ax.barh(2, end - prev, left=prev, color=colors.get(phase, "#dddddd"), edgecolor="white")
            if end - prev > 0.15:
                ax.text((prev + end) / 2, 2, phase, ha="center", va="center", fontsize=8)
            prev = end
        for m in st["moves"]:
            if m["kind"] not in ("load", "evict"):
                continue
            row = 1 if m["kind"] == "load" else 0
            ax.plot(m["at_s"], row, marker=">" if row else "<", color="tab:blue" if row else "tab:orange")
            ax.text(m["at_s"], row + 0.28, f"{m['name'].split('.', 1)[1]} {m['bytes'] / 1e9:.1f} GB"
                    + (" bg" if m["background"] else ""), fontsize=7, ha="left")
        if not any(m["kind"] in ("load", "evict") for m in st["moves"]):
            ax.text(0.02, 0.5, "no state moved", fontsize=8)
        c = res["config"]
        ax.set_yticks([0, 1, 2], ["D2H (evict)", "H2D (load)", "phase"])
        ax.set_ylim(-0.6, 2.6)
        ax.set_title(f"{c['budget']} budget, {c['budget_bytes'] / 1e9:.1f} GB: moves issued in the last step "
                     f"(step {len(res['strategies']['torchferry+dock']['dock_steps']) - 1})", fontsize=9)
    axes[-1, 0].set_xlabel("seconds from the step's start")
    fig.suptitle(f"verl under a Dock ({results[0]['model']['preset']}, {results[0]['env']['gpu']}, commit "
                 f"{results[0]['env'].get('torchferry_commit')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


# --------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write a random-init Qwen2 checkpoint folder")
    p.add_argument("--preset", default="qwen2.5-1.5b", help="a torchferry.bench preset (default: %(default)s)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("run", help="every strategy's actor in one process under torchrun, rounds interleaved")
    p.add_argument("--strategies", nargs="+", default=["resident", "verl", "torchferry"],
                   help="resident (offload off), verl (its own helpers), torchferry (patch() defaults), "
                        "LABEL:K=V[,K=V] (torchferry under these settings); default: %(default)s")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True, help="the runs' records (JSON; `report` turns them into the result)")
    p.add_argument("--steps", type=int, default=4, help="rounds: each strategy's steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--tiny", action="store_true", help="small batches (the CPU check)")
    p.add_argument("--shape", choices=SHAPES, default="small", help="the batch per step (default: %(default)s)")
    p.add_argument("--strategy", choices=["fsdp", "fsdp2"], default="fsdp2", help="verl's actor strategy")
    p.add_argument("--lora-rank", type=int, default=0, help="verl's lora_rank (0: full fine-tuning)")
    p.add_argument("--micro-batch", type=int, nargs=2, default=None, metavar=("TRAIN", "INFER"),
                   help="sequences per micro-batch in update_actor and in the log-prob phases (default: the shape's)")
    p.add_argument("--rollout-gb", type=float, default=0.0, help="rollout stand-in: KV-cache GB held")
    p.add_argument("--rollout-matmuls", type=int, default=0, help="rollout stand-in: bf16 8192^3 matmuls")
    p.add_argument("--weight-sync", action="store_true", help="verl's weight sync after update_actor, as update_weights does it (see _weight_sync)")
    p.add_argument("--cublas-workspace", default=None,
                   help="CUBLAS_WORKSPACE_CONFIG after verl's full_determinism set its own (:16:8), before the "
                        "first matmul (e.g. :4096:8, also deterministic)")
    p.add_argument("--logprobs", choices=["chunked", "verl"], default="chunked",
                   help="log-probs in verl's FSDP engine: chunked (the bench's, one log_softmax per 2048 rows) or "
                        "verl (its fallback without flash-attn: one per token, host-bound); default: %(default)s")
    p.add_argument("--max-round-seconds", type=float, default=0.0,
                   help="start no round after this many seconds of rounds (at least 2 run; 0: all --steps)")
    p.add_argument("--own", default=None, metavar="LABEL",
                   help="build and step this strategy alone, taking turns with the other strategies' processes "
                        "through --turns ([Note: one process per strategy]); default: every strategy here")
    p.add_argument("--turns", default=None, metavar="DIR", help="the folder the processes take turns through")
    p.add_argument("--settle-seconds", type=float, default=0.0,
                   help="seconds to wait before each step (after the turn came), outside its timing (default: 0)")
    p.add_argument("--cpu-slot", type=int, nargs=2, default=None, metavar=("I", "N"),
                   help="run on share I of N equal shares of this process's CPUs (split again among the node's "
                        "ranks), so that the strategies' processes never share a core")
    p = sub.add_parser("report", help="a run's records -> the torchferry.verl-step/1 JSON")
    p.add_argument("runs", nargs="+", help="the run's records: one file per process (run --own), or one")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--command", default=None, help="the command to record in env.command")
    p = sub.add_parser("timeline", help="a PNG of a dock strategy's moves in its last step")
    p.add_argument("results", nargs="+", help="the per-budget results (..._dock-<budget>.json)")
    p.add_argument("--out", required=True, help="the PNG")
    args = ap.parse_args(argv)
    {"prepare": cmd_prepare, "run": cmd_run, "report": cmd_report, "timeline": cmd_timeline}[args.cmd](args)


if __name__ == "__main__":
    main()
