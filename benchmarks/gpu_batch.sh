#!/usr/bin/env bash
# Device calls that re-verify the GPU tiers and re-measure, for the `device` tool's
# nvidia-h200-x2 machine (PYTHONPATH=src; writes under $OUT, which returns at most
# 8 files: logs and results are bundled in one tarball per stage). Each stage fits
# one device call (600 s).
#   bash benchmarks/gpu_batch.sh tests   # GPU tiers on 2 and 1 GPUs, the 7B engine run, verl's actor: ~8 min
#   bash benchmarks/gpu_batch.sh final   # GPU tier on 2 GPUs, verl's actor (0.5B), GPU tier on 1 GPU: ~9 min
#   bash benchmarks/gpu_batch.sh final2  # GPU tier on 2 GPUs, bench-lora at 7B, the hash probe (~9 min)
#   bash benchmarks/gpu_batch.sh lora2   # GPU tier on 2 GPUs, bench-lora at 7B on 2 GPUs (~8 min)
#   bash benchmarks/gpu_batch.sh lora    # bench-lora at 7B on 2 GPUs (~3 min)
#   bash benchmarks/gpu_batch.sh moved   # Triton bf16 codec probe, LoRA offload profile (1 GPU), bench-lora at 7B (~6 min)
#   bash benchmarks/gpu_batch.sh check   # GPU tier on 2 GPUs, the LoRA offload profile, bench-pin (~5 min)
#   bash benchmarks/gpu_batch.sh phases  # host time by phase: LoRA offload, small tensors' reload (1 GPU, ~2 min)
#   bash benchmarks/gpu_batch.sh final1  # GPU tier on 1 GPU, the compression probe (~4 min)
#   bash benchmarks/gpu_batch.sh bench   # the 7B engine run and the 7B bench: ~6 min
#   bash benchmarks/gpu_batch.sh round   # the compute-rich 7B bench (~3 min), GPU tiers on 2 and 1 GPUs (>3 min, ~70 s)
#   bash benchmarks/gpu_batch.sh close   # last call on 2 GPUs: GPU tier, the default 7B bench (~7 min)
#   bash benchmarks/gpu_batch.sh close1  # last call on 1 GPU: GPU tier, bench-pin, the small reload by phase (~3 min)
#   bash benchmarks/gpu_batch.sh small   # host us per small storage, the small reload by phase, bench-pin (1 GPU, ~2 min)
#   bash benchmarks/gpu_batch.sh pin     # torchferry bench-pin on one GPU (~1 min)
#   bash benchmarks/gpu_batch.sh diag    # probe + the compute-rich bench traced, phases compared (~6 min)
#   bash benchmarks/gpu_batch.sh probe   # do H2D copies slow NCCL all-gathers or matmuls here? (~1 min)
# The device's copy of .git may be older than the tree it runs: set TORCHFERRY_COMMIT to say which commit ran.
set -u
stage=${1:-tests}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# Work under /tmp; only the tarball goes to $OUT (the device tool returns at most 8 files from there).
out=/tmp/torchferry-work; mkdir -p "$out/r"
export TORCHFERRY_RESULTS_DIR=$out/r
day=$(date -u +%F)
run() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; timeout "$limit" "$@" > "$out/r/$name.log" 2>&1; echo "   rc=$? $(tail -1 "$out/r/$name.log")"; }
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv > "$out/r/gpus.csv" 2>&1
grep -h "AnonHugePages\|HugePages_Total" /proc/meminfo > "$out/r/host_thp.txt" 2>&1
cat /sys/kernel/mm/transparent_hugepage/enabled >> "$out/r/host_thp.txt" 2>&1
tiers() {  # the GPU tests on 2 GPUs, then on 1
  run pytest_gpu_x2 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
  CUDA_VISIBLE_DEVICES=0 run pytest_gpu_x1 110 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
}
engine() {  # $1: file name suffix
  run engine_x2 110 torchrun --nproc_per_node 2 benchmarks/engine_fsdp2.py --preset qwen2.5-7b --seed-cycles 0 \
      --json "$out/r/engine_fsdp2_qwen2.5-7b_h200x2_$day$1.json"
}
if [ "$stage" = round ]; then
  run bench_cr 210 torchrun --nproc_per_node 2 -m torchferry bench --preset qwen2.5-7b --workload compute-rich \
      --strategies torchferry,torchferry+prefetch --steps 3 --no-swap \
      --json "$out/r/bench_qwen2.5-7b_h200x2_compute-rich_$day.json" \
      --plot "$out/r/bench_qwen2.5-7b_h200x2_compute-rich_$day.png"
  run pytest_gpu_x2 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
  CUDA_VISIBLE_DEVICES=0 run pytest_gpu_x1 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
elif [ "$stage" = diag ]; then  # where prefetch's exposed time goes (issue 17): contention probe, traced bench
  NCCL_DEBUG=INFO run probe_contention 120 torchrun --nproc_per_node 2 benchmarks/probe_contention.py \
      "$out/r/probe_contention_h200x2_$day.json"
  grep -h "via\|Channel 00" "$out/r/probe_contention.log" | head -20 > "$out/r/nccl_transport.txt"
  run bench_cr 300 torchrun --nproc_per_node 2 -m torchferry bench --preset qwen2.5-7b --workload compute-rich \
      --strategies torchferry,torchferry+prefetch --steps 2 --no-swap --trace "$out/t/trace_cr" \
      --json "$out/r/bench_qwen2.5-7b_h200x2_compute-rich_diag_$day.json"
  cp "$out"/t/*.summary.json "$out"/t/*.png "$out/r/" 2>/dev/null
  python3 benchmarks/compare_phases.py "$out/t/trace_cr" "$out/r/phases_compute-rich_$day.json"
elif [ "$stage" = probe ]; then  # what slows the compute while prefetch copies run (issue 17)
  NCCL_DEBUG=INFO run probe_contention 120 torchrun --nproc_per_node 2 benchmarks/probe_contention.py \
      "$out/r/probe_contention_h200x2_$day.json"
  grep -h "via\|Channel 00" "$out/r/probe_contention.log" | head -20 > "$out/r/nccl_transport.txt"
elif [ "$stage" = close ]; then  # last call on 2 GPUs: GPU tier, the default 7B bench (line rate, huge pages in env) (~7 min)
  run pytest_gpu_x2 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
  run bench_x2 300 torchrun --nproc_per_node 2 -m torchferry bench --preset qwen2.5-7b \
      --strategies torchferry,torchferry+prefetch --steps 3 --no-swap \
      --json "$out/r/bench_qwen2.5-7b_h200x2_${day}_close.json"
elif [ "$stage" = close1 ]; then  # last call on 1 GPU: GPU tier, bench-pin, the small reload by phase (~3 min)
  CUDA_VISIBLE_DEVICES=0 run pytest_gpu_x1 110 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
  CUDA_VISIBLE_DEVICES=0 run bench_pin 90 python3 -m torchferry bench-pin --json "$out/r/bench-pin_h200_${day}_close.json"
  CUDA_VISIBLE_DEVICES=0 run profile_small 60 python3 benchmarks/profile_small_reload.py \
      "$out/r/profile_small_reload_h200_${day}_close.json"
  CUDA_VISIBLE_DEVICES=0 run probe_small 60 python3 benchmarks/probe_small_host.py "$out/r/probe_small_host_h200_${day}_close.json"
elif [ "$stage" = small ]; then  # host microseconds per small storage, the small reload by phase, bench-pin (1 GPU, ~2 min)
  CUDA_VISIBLE_DEVICES=0 run probe_small 60 python3 benchmarks/probe_small_host.py "$out/r/probe_small_host_h200_$day.json"
  CUDA_VISIBLE_DEVICES=0 run profile_small 60 python3 benchmarks/profile_small_reload.py \
      "$out/r/profile_small_reload_h200_$day.json"
  CUDA_VISIBLE_DEVICES=0 run bench_pin 90 python3 -m torchferry bench-pin --json "$out/r/bench-pin_h200_$day.json"
elif [ "$stage" = pin ]; then
  CUDA_VISIBLE_DEVICES=0 run bench_pin 90 python3 -m torchferry bench-pin --json "$out/r/bench-pin_h200_$day.json"
elif [ "$stage" = tests ]; then
  tiers
  engine _run6
  run verl_actor 150 bash benchmarks/verl_actor.sh "$out/r" 2 qwen2.5-0.5b 4
elif [ "$stage" = final2 ]; then  # the last call on 2 GPUs: GPU tier, the LoRA scenario (issue 16), the hash's rate
  run pytest_gpu_x2 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
  run bench_lora 230 torchrun --nproc_per_node 2 -m torchferry bench-lora --preset qwen2.5-7b --steps 3 \
      --json "$out/r/bench-lora_qwen2.5-7b_h200x2_$day.json"
  CUDA_VISIBLE_DEVICES=0 run probe_hash 80 python3 benchmarks/probe_hash.py "$out/r/probe_hash_h200_$day.json" --gib 4
elif [ "$stage" = lora2 ]; then  # GPU tier on 2 GPUs, then the full 7B LoRA scenario on 2 GPUs (issue 16), ~8 min
  run pytest_gpu_x2 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
  run bench_lora 280 torchrun --nproc_per_node 2 -m torchferry bench-lora --preset qwen2.5-7b --steps 4 \
      --json "$out/r/bench-lora_qwen2.5-7b_h200x2_$day.json"
elif [ "$stage" = lora ]; then  # the full 7B LoRA scenario on 2 GPUs (issue 16), ~3 min
  run bench_lora 280 torchrun --nproc_per_node 2 -m torchferry bench-lora --preset qwen2.5-7b --steps 4 \
      --json "$out/r/bench-lora_qwen2.5-7b_h200x2_$day.json"
elif [ "$stage" = moved ]; then  # issue 16: the Triton bf16 codec measured, an offload's host time, bench-lora at 7B (~6 min)
  CUDA_VISIBLE_DEVICES=0 run probe_codec 170 python3 benchmarks/probe_compress.py "$out/r/probe_compress_triton_h200_$day.json" \
      --codecs triton,bytesplit-raw --train-seconds 40
  CUDA_VISIBLE_DEVICES=0 run profile_lora 120 torchrun --nproc_per_node 1 benchmarks/profile_lora_offload.py \
      "$out/r/profile_lora_offload_h200_$day"
  run bench_lora 200 torchrun --nproc_per_node 2 -m torchferry bench-lora --preset qwen2.5-7b --steps 4 \
      --json "$out/r/bench-lora_qwen2.5-7b_h200x2_$day.json"
elif [ "$stage" = check ]; then  # GPU tier on 2 GPUs, an offload's host time (1 GPU), bench-pin (1 GPU): ~5 min
  run pytest_gpu_x2 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
  CUDA_VISIBLE_DEVICES=0 run profile_lora 120 torchrun --nproc_per_node 1 benchmarks/profile_lora_offload.py \
      "$out/r/profile_lora_offload_h200_$day"
  CUDA_VISIBLE_DEVICES=0 run bench_pin 90 python3 -m torchferry bench-pin --json "$out/r/bench-pin_h200_$day.json"
elif [ "$stage" = phases ]; then  # host time by phase: the LoRA offload copying nothing, 4096 small tensors' reload (1 GPU, ~2 min)
  CUDA_VISIBLE_DEVICES=0 run profile_lora 120 torchrun --nproc_per_node 1 benchmarks/profile_lora_offload.py \
      "$out/r/profile_lora_offload_h200_${day}_phases" --profiled 1
  CUDA_VISIBLE_DEVICES=0 run profile_small 60 python3 benchmarks/profile_small_reload.py \
      "$out/r/profile_small_reload_h200_$day.json"
elif [ "$stage" = final1 ]; then  # the last call on 1 GPU: GPU tier, the compression measurement (issue 16)
  CUDA_VISIBLE_DEVICES=0 run pytest_gpu_x1 110 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
  CUDA_VISIBLE_DEVICES=0 run probe_compress 120 python3 benchmarks/probe_compress.py "$out/r/probe_compress_h200_$day.json"
  # The 7B LoRA run on 2 GPUs outran 230 s; 8 of its 28 layers on one GPU here.
  CUDA_VISIBLE_DEVICES=0 run bench_lora 150 python3 -m torchferry bench-lora --preset qwen2.5-7b --layers 8 --steps 3 \
      --json "$out/r/bench-lora_qwen2.5-7b-8layers_h200x1_$day.json"
elif [ "$stage" = final ]; then
  run pytest_gpu_x2 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
  run verl_actor 240 bash benchmarks/verl_actor.sh "$out/r" 2 qwen2.5-0.5b 4
  CUDA_VISIBLE_DEVICES=0 run pytest_gpu_x1 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu
else
  engine _bench
  run bench_x2 240 torchrun --nproc_per_node 2 -m torchferry bench --preset qwen2.5-7b \
      --strategies torchferry,torchferry+prefetch --seq-len 3584 --batch-size 2 --micro-batches 2 --steps 3 --no-swap \
      --json "$out/r/bench_qwen2.5-7b_h200x2_${day}_final.json" \
      --plot "$out/r/bench_qwen2.5-7b_h200x2_${day}_final.png"
fi
mkdir -p "${OUT:-/tmp/torchferry-out}"
tar -czf "${OUT:-/tmp/torchferry-out}/results_$stage.tar.gz" -C "$out/r" .
grep -h "passed\|failed" "$out"/r/pytest_*.log 2>/dev/null | tail -4
