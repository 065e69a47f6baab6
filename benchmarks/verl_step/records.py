"""What a step records of the state: exact fingerprints, hashes and byte counts."""

from __future__ import annotations

import hashlib

from verl_isolate import fingerprint


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
