"""The strategies a run compares and the Dock budgets."""

from __future__ import annotations

import dataclasses
import os

BUDGETS = {
    "tight": "too small to hold everything at once: the rollout (weights and KV cache) with the optimizer state and "
             "half of the parameters' bytes (so a set must leave for the rollout: the dock evicts the parameters, "
             "the fewest bytes to bring back), and update_actor's phase (parameters, optimizer state, gradients and "
             "activations)",
    "roomy": "twice everything at once (the rollout, parameters, gradients and optimizer state): nothing need move",
}


def dock_budget(kind: str, params: int, world: int, kv_bytes: int, weights_bytes: int,
                trainable: int | None = None) -> int:
    """The dock strategy's budget on each rank (bytes), from the model's parameter count and the rollout
    stand-in's KV cache (see :data:`BUDGETS`): fp32 parameters (4 bytes a parameter, sharded over ``world``
    ranks), fp32 gradients and AdamW's two fp32 moments (4 and 8 bytes a trainable parameter: ``trainable``,
    LoRA's adapters, else every parameter), the rollout's bf16 weights (``weights_bytes``, whole on each rank).
    Tight: KV + weights + half the parameters + the optimizer state; roomy: twice the sum of all.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in BUDGETS:
        raise ValueError(f"budget kind {kind!r} is none of {sorted(BUDGETS)}")
    t = params if trainable is None else trainable
    p, g, o, w = 4 * params // world, 4 * t // world, 8 * t // world, weights_bytes
    if kind == "tight":
        return kv_bytes + w + p // 2 + o
    return 2 * (kv_bytes + w + p + g + o)


def lora_trainable(hf_config: dict, rank: int) -> int:
    """Parameters of rank-``rank`` LoRA adapters on every linear layer of a Llama-style decoder (Qwen2: the
    bench's ``target_modules: all-linear``, which leaves the LM head out): ``rank * (in + out)`` for each of
    q, k, v, o, gate, up and down in every layer, from the model's ``config.json``."""
    h, inter, layers = hf_config["hidden_size"], hf_config["intermediate_size"], hf_config["num_hidden_layers"]
    kv = hf_config.get("num_key_value_heads", hf_config["num_attention_heads"]) * (
        hf_config.get("head_dim") or h // hf_config["num_attention_heads"])
    per_layer = 2 * h + 2 * (h + kv) + 2 * h + 3 * (h + inter)  # q, k, v, o, gate, up, down
    return rank * per_layer * layers


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
