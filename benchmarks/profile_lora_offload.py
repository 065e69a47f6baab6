"""Where the host time of an offload that copies (almost) nothing goes: the 7B LoRA state on one GPU.

``torchferry bench-lora`` on 2 x H200 (commit 0f1e90e) offloaded 7.94 GB of parameters in
0.028 s copying 0 bytes; the hash of those bytes takes about 0.005 s (1723 GB/s,
``benchmarks/results/probe_hash_h200_2026-11-30.json``), so most of it is host work. This
builds the same model (``bench._lora.build_lora``: bf16 base frozen, rank-64 fp32 adapters,
FSDP2, AdamW on the adapters) on one GPU, runs the bench's cycle (reload, forward, reshard,
offload) with ``skip_unchanged=True``, and writes the steady offload's wall seconds (median,
min, max over ``--cycles``), the host milliseconds of its phases over those cycles (wall clock
around each phase's function, no profiler, no syncs added: ``phases_ms``), and a cProfile of
``--profiled`` offloads (cumulative and own time).

    python benchmarks/profile_lora_offload.py OUT_PREFIX [--layers 28] [--cycles 8] [--profiled 3]

Writes ``OUT_PREFIX.json`` and ``OUT_PREFIX.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from torchferry import Ferry
from torchferry._fsdp import reshard
from torchferry.bench._lora import build_lora
from torchferry.bench._setup import env_record, init_distributed


# (module, attribute path) of the functions an offload spends its host time in, timed inclusively.
PHASES = (
    ("torchferry._targets", "Targets.resharded"),
    ("torchferry._unchanged", "UnchangedStorages.take"),
    ("torchferry._unchanged", "hash_storages"),
    ("torchferry._unchanged", "versions"),
    ("torchferry._whole", "fingerprint"),
    ("torchferry._whole", "issue_d2h"),
    ("torchferry._repoint", "Parking.to_host"),
    ("torchferry._guards", "OffloadGuards.install"),
    ("torchferry._ferry", "release"),
    ("torchferry._ferry", "Ferry.offload"),
)


def time_phases(phases=PHASES, outer_path: str = "Ferry.offload") -> dict[str, list[float]]:
    """Wraps each of ``phases`` to record its wall seconds per call made inside ``outer_path``
    (``Ferry.offload``: a reload hashes too); returns the record."""
    import functools
    import importlib

    record: dict[str, list[float]] = {}
    inside = [0]
    for mod_name, path in phases:
        owner = importlib.import_module(mod_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = getattr(owner, name)
        calls = record.setdefault(path, [])

        def wrap(fn=fn, calls=calls, outer=path == outer_path):
            @functools.wraps(fn)
            def timed(*args, **kwargs):
                inside[0] += outer
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if inside[0]:
                        calls.append(time.perf_counter() - t0)
                    inside[0] -= outer
            return timed

        setattr(owner, name, wrap())
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--profiled", type=int, default=3)
    a = ap.parse_args()
    use_cuda = torch.cuda.is_available()
    _, world, device = init_distributed(use_cuda)
    model, opt = build_lora(a.preset if use_cuda else "tiny", device, world, rank=64 if use_cuda else 4,
                            layers=a.layers)
    batch = torch.randint(0, 1000, (1, 64), device=device)
    ferry = Ferry(model, device=device, skip_unchanged=True)

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    def cycle(prof: cProfile.Profile | None = None) -> float:
        ferry.reload()
        with torch.no_grad():
            model(input_ids=batch)
        reshard([model])
        sync()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        ferry.offload()
        sync()
        if prof is not None:
            prof.disable()
        return time.perf_counter() - t0

    ferry.offload()
    for _ in range(3):
        cycle()
    record = time_phases()
    secs = [cycle() for _ in range(a.cycles)]
    phases_ms = {k: 1e3 * sum(v) / a.cycles for k, v in record.items()}
    prof = cProfile.Profile()
    for _ in range(a.profiled):
        cycle(prof)
    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
    n_tensors = sum(1 for _ in model.parameters())
    result = {"env": env_record(device, world), "preset": a.preset, "layers": a.layers, "parameters": n_tensors,
              "state_bytes": ferry.state_bytes, "bytes_copied": ferry.stats.offload_bytes_copied,
              "offload_s": {"median": statistics.median(secs), "min": min(secs), "max": max(secs), "all": secs},
              "phases_ms": phases_ms,
              "profiled_offloads": a.profiled}
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(a.out + ".txt", "w") as f:
        f.write(text.getvalue())
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=1))
    ferry.reload()
    ferry.close()


if __name__ == "__main__":
    main()
