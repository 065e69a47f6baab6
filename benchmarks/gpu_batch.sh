#!/usr/bin/env bash
# One device call that re-verifies the GPU tiers and re-measures, for the `device`
# tool's nvidia-h200-x2 machine (PYTHONPATH=src; writes under $OUT, which returns at
# most 8 files: logs and results are bundled in one tarball).
#   bash benchmarks/gpu_batch.sh            # about 8 minutes
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/torchferry-out}; mkdir -p "$out/r"
day=$(date -u +%F)
run() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; timeout "$limit" "$@" > "$out/r/$name.log" 2>&1; echo "   rc=$? $(tail -1 "$out/r/$name.log")"; }
run pytest_gpu_x2 150 python3 -m pytest -q -p no:cacheprovider tests/gpu
CUDA_VISIBLE_DEVICES=0 run pytest_gpu_x1 70 python3 -m pytest -q -p no:cacheprovider tests/gpu
run engine_x2 110 torchrun --nproc_per_node 2 benchmarks/engine_fsdp2.py --preset qwen2.5-7b --seed-cycles 2 \
    --json "$out/r/engine_fsdp2_qwen2.5-7b_h200x2_$day.json"
run bench_x2 230 torchrun --nproc_per_node 2 -m torchferry bench --preset qwen2.5-7b \
    --strategies seed,torchferry,torchferry+prefetch --seq-len 2048 --batch-size 2 --micro-batches 2 \
    --json "$out/r/bench_qwen2.5-7b_h200x2_$day.json" --plot "$out/r/bench_qwen2.5-7b_h200x2_$day.png"
tar -czf "$out/results.tar.gz" -C "$out/r" .
grep -h "passed\|failed" "$out"/r/pytest_*.log | tail -4
