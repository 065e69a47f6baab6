#!/usr/bin/env bash
# Device calls that re-verify the GPU tiers and re-measure, for the `device` tool's
# nvidia-h200-x2 machine (PYTHONPATH=src; writes under $OUT, which returns at most
# 8 files: logs and results are bundled in one tarball per stage).
#   bash benchmarks/gpu_batch.sh tests   # GPU tiers on 2 and 1 GPUs, engine run, bench-pin: ~5 min
#   bash benchmarks/gpu_batch.sh bench   # qwen2.5-7b bench on 2 GPUs: prefetch, swap, trace: ~4 min
#   bash benchmarks/gpu_batch.sh final   # both, shortened (no seed, no 1-GPU engine): ~7.5 min
set -u
stage=${1:-tests}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:-/tmp/torchferry-out}; mkdir -p "$out/r"
export TORCHFERRY_RESULTS_DIR=$out/r
day=$(date -u +%F)
run() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; timeout "$limit" "$@" > "$out/r/$name.log" 2>&1; echo "   rc=$? $(tail -1 "$out/r/$name.log")"; }
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv > "$out/r/gpus.csv" 2>&1
verify() {  # the GPU tiers on 2 and 1 GPUs, the engine run and bench-pin; $1: file name suffix
  run pytest_gpu_x2 170 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu
  CUDA_VISIBLE_DEVICES=0 run pytest_gpu_x1 80 python3 -m pytest -q -p no:cacheprovider tests/gpu
  run engine_x2 120 torchrun --nproc_per_node 2 benchmarks/engine_fsdp2.py --preset qwen2.5-7b --seed-cycles 0 \
      --json "$out/r/engine_fsdp2_qwen2.5-7b_h200x2_$day$1.json"
  CUDA_VISIBLE_DEVICES=0 run bench_pin 120 python3 -m torchferry bench-pin --json "$out/r/bench-pin_h200_$day$1.json"
}
if [ "$stage" = tests ]; then
  verify ""
elif [ "$stage" = final ]; then
  verify _final
  run bench_x2 240 torchrun --nproc_per_node 2 -m torchferry bench --preset qwen2.5-7b \
      --strategies torchferry,torchferry+prefetch --seq-len 3584 --batch-size 2 --micro-batches 2 --steps 3 --no-swap \
      --json "$out/r/bench_qwen2.5-7b_h200x2_prefetch_${day}_final.json" \
      --plot "$out/r/bench_qwen2.5-7b_h200x2_prefetch_${day}_final.png" --trace "$out/r/trace_qwen2.5-7b_h200x2_${day}_final"
  rm -f "$out"/r/*.json.gz  # the full traces are too large to bring back with the rest; summaries stay
else
  run bench_x2 420 torchrun --nproc_per_node 2 -m torchferry bench --preset qwen2.5-7b \
      --strategies torchferry,torchferry+prefetch --seq-len 2048 --batch-size 2 --micro-batches 4 --steps 3 \
      --json "$out/r/bench_qwen2.5-7b_h200x2_prefetch_$day.json" --plot "$out/r/bench_qwen2.5-7b_h200x2_prefetch_$day.png" \
      --trace "$out/r/trace_qwen2.5-7b_h200x2_$day"
fi
tar -czf "$out/results_$stage.tar.gz" -C "$out/r" .
grep -h "passed\|failed" "$out"/r/pytest_*.log 2>/dev/null | tail -4
