"""verl's actor importable and runnable here: the Ray stand-in, a CPU platform, the model folder."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

from verl_step.common import HERE, ROOT


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
