"""The workload's model: transformers' Qwen2 at the published Qwen2.5 sizes (``presets``), random init."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from .presets import PRESETS

__all__ = ["PRESETS", "build_model"]


def build_model(preset: str | None, device: torch.device, *, path: str | None = None,
                layers: int | None = None, seed: int = 0) -> nn.Module:
    """Builds ``Qwen2ForCausalLM`` in fp32 on ``device``, random init (or from a local checkpoint).

    Args:
        preset: a key of :data:`PRESETS` (ignored when ``path`` is given).
        device: where to build the model.
        path: a local Hugging Face checkpoint folder (``config.json`` and weights).
        layers: override the number of decoder layers (for quick runs).
        seed: RNG seed for the random init.

    Raises:
        ValueError: unknown preset, or ``path`` is not a checkpoint folder.
    """
    import transformers

    torch.manual_seed(seed)
    if path is not None:
        p = Path(path)
        if not (p / "config.json").is_file():
            raise ValueError(f"--model {path}: not a Hugging Face checkpoint folder (no config.json)")
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = transformers.AutoModelForCausalLM.from_pretrained(p, torch_dtype=torch.float32)
        return model.to(device)  # pyright: ignore[reportArgumentType]  # transformers' from_pretrained return type is mis-inferred; it is an nn.Module
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    sizes = dataclasses.asdict(PRESETS[preset])
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    cfg = transformers.Qwen2Config(**sizes, max_position_embeddings=4096)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(cfg)
    return model.float()
