"""The workload's model: transformers' Qwen2 at the published Qwen2.5 sizes, under FSDP2."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

__all__ = ["PRESETS", "Preset", "build_model"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """Qwen2 architecture sizes.

    The ``qwen2.5-*`` values are those of the published Hugging Face configs
    (``Qwen/Qwen2.5-0.5B``, ``-1.5B``, ``-7B``: ``config.json``); ``tiny`` is a
    small stand-in that runs on a CPU.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 176, 2, 4, 2, 1000, False),
    "qwen2.5-0.5b": Preset(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": Preset(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": Preset(3584, 18944, 28, 28, 4, 152064, False),
}


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
