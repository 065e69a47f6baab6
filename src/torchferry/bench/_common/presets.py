"""The workload's model sizes: transformers' Qwen2 at the published Qwen2.5 sizes (no torch import here)."""

from __future__ import annotations

import dataclasses

__all__ = ["PRESETS", "Preset"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """Qwen2 architecture sizes.

    The ``qwen2.5-*`` values are those of the published Hugging Face configs
    (``Qwen/Qwen2.5-0.5B``, ``-1.5B``, ``-3B``, ``-7B``: ``config.json``); ``tiny`` is a
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
    "qwen2.5-3b": Preset(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": Preset(3584, 18944, 28, 28, 4, 152064, False),
}
