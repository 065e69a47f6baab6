"""GRPO-like colocated step under a GPU budget: verl-style offload (torchferry) against torchferry.Dock.

    torchrun --nproc_per_node 2 benchmarks/grpo_dock.py --preset qwen2.5-7b --json OUT.json --plot OUT.png
    python benchmarks/grpo_dock.py --preset tiny --json OUT.json --plot OUT.png        # CPU, end to end

rollout (KV-cache claimant) -> reference log-prob -> actor old_log_prob ->
update_actor, both strategies in the same run, steps interleaved; see
``torchferry.bench._grpo`` for what is measured and ``docs/dock.md`` for the
dock. Rank 0 prints a summary and writes the JSON (``torchferry.bench-grpo/1``)
and the PNG timeline (phases, compute, both copy engines).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts


def _gb(x: str) -> int:
    return int(float(x) * 1e9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help="qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b or tiny "
                    "[default: qwen2.5-1.5b on a GPU, tiny on the CPU]")
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--strategies", default="torchferry,torchferry+dock", help="comma-separated")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per strategy (medians)")
    ap.add_argument("--warmup-steps", type=int, default=1, help="untimed first steps per strategy")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence [512; tiny: 32]")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--rollout-s", type=float, default=0.0, help="seconds the rollout holds its KV cache")
    ap.add_argument("--kv-gb", type=_gb, default=None, help="KV cache per rank, GB [actor params + AdamW]")
    ap.add_argument("--budget-gb", type=_gb, default=None,
                    help="GPU budget per rank, GB [actor + max(KV, update workspace) + half the reference]")
    ap.add_argument("--phase-gap-s", type=float, default=0.0, help="untimed host seconds between phases")
    ap.add_argument("--no-deterministic", action="store_true", help="SDPA attention, no deterministic kernels")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results JSON here (rank 0)")
    ap.add_argument("--plot", default=None, help="write the PNG timeline here (rank 0)")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from torchferry.bench._grpo import GrpoConfig, plot_grpo, run_grpo, summary_lines
    from torchferry.bench._report import write_json

    try:
        config = GrpoConfig(
            preset=args.preset, layers=args.layers,
            strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
            steps=args.steps, warmup_steps=args.warmup_steps, seq_len=args.seq_len, batch_size=args.batch_size,
            micro_batches=args.micro_batches, rollout_s=args.rollout_s, kv_bytes=args.kv_gb,
            budget_bytes=args.budget_gb, phase_gap_s=args.phase_gap_s, deterministic=not args.no_deterministic,
        )
        result = run_grpo(config, on_progress=lambda msg, frac: print(f"[{frac:4.0%}] {msg}", file=sys.stderr))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if dist.get_rank() == 0:
            for line in summary_lines(result):
                print(line)
            for note in result["notes"]:
                print(f"note: {note}", file=sys.stderr)
            if args.json_path:
                write_json(result, args.json_path)
            if args.plot:
                plot_grpo(result, args.plot)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
