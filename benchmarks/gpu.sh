#!/usr/bin/env bash
# The GPU test tier and the rows of benchmarks/README.md, on the GPUs this machine has.
#
#   bash benchmarks/gpu.sh [STAGE] [OUT]
#
# STAGE: tests | bench | switchpoints | pin | lora | engine | grpo | verl | frameworks | all (default: all).
# OUT: folder for the logs and results (default: ./gpu-results). Results are named
# <claim>_<gpu>x<n>_<date>.json, as in benchmarks/results/. Rows measured on one GPU run on the
# first visible GPU; rows measured on several run under torchrun on all of them, and only when
# there are at least 2. A failed command is reported and the rest still runs; the exit status
# is 1 if any failed.
set -uo pipefail
stage=${1:-all}
out=${2:-gpu-results}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())') || exit 2
if [ "$ngpu" -lt 1 ]; then echo "no CUDA GPU: nothing to run (the CPU tier is python -m pytest -q tests)" >&2; exit 2; fi
gpu=$("$py" -c 'import torch; print(torch.cuda.get_device_name(0).split()[-1].lower())')
day=$(date -u +%F)
one=${gpu}x1      # hardware of the one-GPU rows
all=${gpu}x$ngpu  # hardware of the multi-GPU rows and the test tier
first=${CUDA_VISIBLE_DEVICES:-0}
on1=(env CUDA_VISIBLE_DEVICES="${first%%,*}" "$py")
onall=("$py" -m torch.distributed.run --standalone --nproc_per_node "$ngpu")
# The commit measured: TORCHFERRY_COMMIT if set (a copy of the tree whose .git is not its own), else git's.
export TORCHFERRY_COMMIT=${TORCHFERRY_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
echo "$TORCHFERRY_COMMIT" > "$out/commit.txt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true

failed=0
run() {  # NAME CMD...: CMD's output to the terminal and to OUT/NAME.log
  echo "== $1: ${*:2}"
  if ! "${@:2}" 2>&1 | tee "$out/$1.log"; then echo "!! $1 failed (see $out/$1.log)"; failed=1; fi
}
multi() {  # as run, when there are at least 2 GPUs
  if [ "$ngpu" -ge 2 ]; then run "$@"; else echo "-- $1: skipped (needs >= 2 GPUs, found $ngpu)"; fi
}

tests() {  # the GPU tier; its soak test writes soak_gpu_1000_cycles.json under TORCHFERRY_RESULTS_DIR
  run "pytest_gpu_${all}_$day" env TORCHFERRY_RESULTS_DIR="$out" "$py" -m pytest -q -p no:cacheprovider -rfE tests/gpu
  if [ -f "$out/soak_gpu_1000_cycles.json" ]; then mv "$out/soak_gpu_1000_cycles.json" "$out/soak_gpu_${all}_$day.json"; fi
}
bench() {
  local n="bench_qwen2.5-1.5b_${one}_$day"
  run "$n" "${on1[@]}" -m torchferry bench --preset qwen2.5-1.5b --steps 2 --json "$out/$n.json" --plot "$out/$n.png"
  for p in qwen2.5-1.5b qwen2.5-3b; do  # layer-wise reload where a unit computes longer than it copies
    n="bench_${p}-compute-rich_${one}_$day"
    run "$n" "${on1[@]}" -m torchferry bench --preset "$p" --workload compute-rich \
        --strategies torchferry,torchferry+prefetch --steps 3 --no-swap --json "$out/$n.json" --plot "$out/$n.png"
  done
  n="bench_qwen2.5-7b_${all}_$day"
  multi "$n" "${onall[@]}" -m torchferry bench --preset qwen2.5-7b --strategies seed,torchferry \
      --json "$out/$n.json" --plot "$out/$n.png"
  n="bench_qwen2.5-7b-swap_${all}_$day"
  multi "$n" "${onall[@]}" -m torchferry bench --preset qwen2.5-7b --strategies torchferry,torchferry+prefetch \
      --seq-len 2048 --batch-size 2 --micro-batches 4 --steps 3 --json "$out/$n.json" --trace "$out/trace_qwen2.5-7b_${all}_$day"
  n="bench_qwen2.5-7b-compute-rich_${all}_$day"
  multi "$n" "${onall[@]}" -m torchferry bench --preset qwen2.5-7b --workload compute-rich \
      --strategies torchferry,torchferry+prefetch --steps 3 --no-swap --json "$out/$n.json" --plot "$out/$n.png"
}
switchpoints() {  # piece size x separator: copy rate and a small copy's wait ([Note: switch points])
  run "switch_points_${one}_$day" "${on1[@]}" benchmarks/switch_points.py --json "$out/switch_points_${one}_$day.json"
}
pin() {  # one run gives the pinning, first-offload and small-tensors rows
  run "bench-pin_${one}_$day" "${on1[@]}" -m torchferry bench-pin --json "$out/bench-pin_${one}_$day.json"
}
lora() {
  local n="bench-lora_qwen2.5-7b-8layers_${one}_$day"
  run "$n" "${on1[@]}" -m torchferry bench-lora --preset qwen2.5-7b --layers 8 --steps 3 --json "$out/$n.json"
  n="bench-lora_qwen2.5-7b_${all}_$day"
  multi "$n" "${onall[@]}" -m torchferry bench-lora --preset qwen2.5-7b --steps 4 --json "$out/$n.json"
}
engine() {
  local n="engine_fsdp2_qwen2.5-7b_${all}_$day"
  multi "$n" "${onall[@]}" benchmarks/engine_fsdp2.py --preset qwen2.5-7b --seed-cycles 0 --json "$out/$n.json"
}
grpo() {
  local n="grpo_dock_qwen2.5-7b_${all}_$day"
  multi "$n" "${onall[@]}" -m torchferry bench-grpo --preset qwen2.5-7b --steps 2 --warmup-steps 1 \
      --json "$out/$n.json" --plot "$out/$n.png"
}
verl() {  # writes verl_qwen2.5-0.5b_<gpu>x<n>_<date>.json and both runs under OUT/verl
  multi "verl_qwen2.5-0.5b_${all}_$day" bash benchmarks/verl_actor.sh "$out/verl" "$ngpu" qwen2.5-0.5b 4
}
frameworks() {  # SkyRL's and AReaL's own offload functions, unpatched and patched, on one GPU
  # Offline: FW_WHEELS, a folder you bring, holds the wheels of skyrl, areal, torch_memory_saver and what
  # their imports need beyond the machine's packages; installed with --no-deps into FW_DEPS (/tmp/tffw).
  local n="frameworks_qwen2.5-1.5b_${one}_$day" pp=$PYTHONPATH
  local wheels=${FW_WHEELS:-} deps=${FW_DEPS:-/tmp/tffw}
  if ! "$py" -c 'import skyrl, areal, torch_memory_saver' 2>/dev/null && ls "$wheels"/*.whl >/dev/null 2>&1; then
    if [ ! -d "$deps/areal" ]; then
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$deps" "$wheels"/*.whl
    fi
    pp=$PYTHONPATH:$deps
  fi
  run "$n" env PYTHONPATH="$pp" "${on1[@]}" benchmarks/frameworks.py --preset qwen2.5-1.5b --json "$out/$n.json"
}

case $stage in
  tests | bench | switchpoints | pin | lora | engine | grpo | verl | frameworks) "$stage" ;;
  all) tests; bench; switchpoints; pin; lora; engine; grpo; verl; frameworks ;;
  *) echo "usage: bash benchmarks/gpu.sh [tests|bench|switchpoints|pin|lora|engine|grpo|verl|frameworks|all] [OUT]" >&2
     exit 2 ;;
esac
echo "results in $out (commit $(cat "$out/commit.txt"))"
exit "$failed"
