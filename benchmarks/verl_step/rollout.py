"""The rollout stand-in, verl's weight sync into it, and the allocator diagnosis around its wake."""

from __future__ import annotations

import json
from pathlib import Path

from verl_step.records import _local


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
    first use and kept, as the rollout's weights; verl hands the adapters over on the host). With LoRA
    that yields the adapters only, and on the ``first``
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


def _write_segments(path: Path, device) -> None:
    """The caching allocator's segments as the rollout would find them: each segment's bytes, its live
    bytes and stream, and each live block's size with the innermost frames of the Python code that
    allocated it (from ``torch.cuda.memory._snapshot()``; ``--segments-at-wake`` records the stacks).
    A segment with any live block stays reserved through ``empty_cache()``."""
    import torch

    segs = []
    for seg in torch.cuda.memory._snapshot(device)["segments"]:
        live = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
        segs.append({"total_bytes": seg["total_size"], "live_bytes": sum(b["size"] for b in live),
                     "stream": seg["stream"], "pool": seg.get("segment_pool_id"), "live": [
                         {"bytes": b["size"], "frames": [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
                                                         for f in b.get("frames", [])
                                                         if f["filename"].endswith(".py")][:8]}
                         for b in sorted(live, key=lambda b: -b["size"])[:12]]})
    segs.sort(key=lambda x: -(x["total_bytes"] - x["live_bytes"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"reserved_bytes": sum(x["total_bytes"] for x in segs),
                                "live_bytes": sum(x["live_bytes"] for x in segs), "segments": segs}, indent=1))


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
