#!/usr/bin/env bash
# verl 0.9.1's own actor (param_offload + optimizer_offload) on N GPUs in a colocated step: resident
# (offload off: the baseline of "exposed"), verl's own helpers (the seed) and torchferry's, one actor
# each in one process, rounds interleaved, same seeds and data; then the report.
#
#   bash benchmarks/verl_actor.sh OUT [NPROC] [PRESET] [STEPS]
#
# OUT gets: verl_step_<preset>_<strategy>-<full|lora>-<shape>_<gpu>x<N>_<date>.json (schema
# torchferry.verl-step/1; bit_identical compares losses, old and reference log-probs, every parameter
# shard, optimizer-state tensor and weight-sync buffer exactly, against verl's), runs.json (the
# records it is made from) and log.txt. NPROC defaults to the number of GPUs (1 on the CPU), PRESET to
# qwen2.5-1.5b (random init, no download; tiny on a machine without a GPU), STEPS (rounds) to 4.
#
# What the step holds, from the environment (defaults: verl's FSDP2 actor, small batches):
#   VERL_ACTOR_SHAPE=small|compute-rich   compute-rich: 16,384 tokens per rank and phase
#   VERL_ACTOR_STRATEGY=fsdp2|fsdp        verl's actor strategy (fsdp: FSDP1, verl's default)
#   VERL_ACTOR_LORA_RANK=N                verl's lora_rank (0: full fine-tuning); adds the reference phase
#   VERL_ACTOR_MICRO="TRAIN INFER"        sequences per micro-batch in update_actor / the log-prob phases
#   VERL_ACTOR_ROLLOUT="GB MATMULS"       a rollout stand-in before each step's old_log_prob
#   VERL_ACTOR_WEIGHT_SYNC=1              verl's weight sync after each update_actor, as update_weights:
#                                         get_per_tensor_param(base_sync_done=True) (LoRA: the adapters; the
#                                         base on the first sync only) into device buffers
#   VERL_ACTOR_RESIDENT=0                 no resident strategy (no exposed step time then)
#   VERL_ACTOR_VARIANTS="LABEL:K=V,K=V ..." more torchferry strategies, each under these settings
#                                         (e.g. "plain:TORCHFERRY_LAYERWISE_RELOAD=0,TORCHFERRY_OPTIMIZER_AT_STEP=0")
#   VERL_ACTOR_CUBLAS_WORKSPACE=:4096:8   CUBLAS_WORKSPACE_CONFIG set after verl's full_determinism set its
#                                         :16:8 (the default here, also deterministic; empty: verl's :16:8)
#   VERL_ACTOR_MAX_ROUND_S=S              start no round after S seconds of rounds (at least 2 run)
#   VERL_ACTOR_DOCK="tight roomy"         adds torchferry+dock-<budget> for each budget (tight, roomy: from the
#                                         model's and the rollout's sizes, see dock_budget; or bytes):
#                                         patch(dock=...) under it; the report also writes one JSON per budget
#                                         (..._dock-<budget>.json, that strategy as strategies["torchferry+dock"])
#   VERL_ACTOR_ISOLATE=1|0                1 (default): each strategy in a process of its own, the processes taking
#                                         turns step by step (benchmarks/verl_isolate.py); 0: all in one process
#   VERL_ACTOR_SETTLE_S=S                 wait S seconds before each step, outside its timing (default 0)
#   VERL_ACTOR_PIN_CPUS=1|0               1 (default, with ISOLATE=1): each strategy's process on its own equal
#                                         share of the CPUs (run --cpu-slot), so no two ever share a core
#   VERL_ACTOR_SEGMENTS=ROUND             diagnosis: allocation stacks recorded (slower), and at ROUND's rollout
#                                         wake each strategy's allocator segments to OUT/segments_<label>_rank<r>.json
#   VERL_ACTOR_PROFILE=1                  diagnosis: the offload/reload calls after the first round under cProfile
#                                         (slower): the top functions per phase in runs.json (call_profile)
#   VERL_ACTOR_BLOCKING_SYNC=1            diagnosis: a thread waiting on the GPU sleeps instead of spinning, so each
#                                         phase's CPU seconds (phase_cpu_s in runs.json) are the host's work only
#   VERL_ACTOR_GPU_BUSY=1                 diagnosis: each step under PyTorch's profiler (CUDA activity): the GPU's
#                                         busy seconds per phase (gpu_busy in runs.json, gpu_busy_per_step)
#   VERL_ACTOR_LOGPROBS=chunked|verl      log-probs in verl's engine: chunked (default: one log_softmax per
#                                         2048 rows) or verl's own fallback without flash-attn (one per token:
#                                         host-bound, a step's time spread by seconds; see _logprobs_chunked)
#
# verl and what its actor code imports must be importable (pip install -e '.[test]', then
# pip install --no-deps verl==0.9.1). On a machine without network, TFDEPS_WHEELS=DIR names a folder of
# their wheels that you bring, installed with --no-deps into /tmp/tfdeps; ray need not be among them
# (too large): benchmarks/verl_raystub stands in for it when it is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash benchmarks/verl_actor.sh OUT [NPROC] [PRESET] [STEPS]}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Deterministic kernels and collectives for every run (verl's full_determinism sets them too, later:
# CUBLAS_WORKSPACE_CONFIG=:16:8 in verl/workers/engine/utils.py, whatever is set here; under it a
# compute-rich update_actor of Qwen2.5-1.5B took 7.0-11.3 s on an H200 after the first step:
# benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-full-compute-rich_h200x1_2026-12-02.json).
export CUBLAS_WORKSPACE_CONFIG=:16:8 NCCL_ALGO=Ring NCCL_PROTO=Simple NCCL_DETERMINISTIC=1 FLASH_ATTENTION_DETERMINISTIC=1

DEPS=${TFDEPS:-/tmp/tfdeps}
WHEELS=${TFDEPS_WHEELS:-}
# What verl's actor code imports beyond torch/transformers/peft/pandas/pyarrow (see the wheels' list).
NEEDED="verl hydra tensordict omegaconf codetiming datasets dill orjson pyvers fastapi starlette uvicorn pydantic"
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" $NEEDED; then
  if [ -z "$WHEELS" ] || ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "error: verl 0.9.1 or what its actor code imports is not importable: pip install -e '.[test]' &&" \
         "pip install --no-deps verl==0.9.1 (offline: TFDEPS_WHEELS=DIR, a folder of their wheels${WHEELS:+; none in $WHEELS})" >&2
    exit 2
  fi
  if [ ! -d "$DEPS/verl" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$DEPS" "$WHEELS"/*.whl
  fi
  export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('ray') is None)"; then
  echo "ray is not installed: benchmarks/verl_raystub stands in for it (verl imports it; this path never uses it)"
  export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks/verl_raystub"
fi

NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
NPROC=${2:-$(( NGPU > 0 ? NGPU : 1 ))}
PRESET=${3:-$( [ "$NGPU" = 0 ] && echo tiny || echo qwen2.5-1.5b )}
STEPS=${4:-4}
EXTRA=(--shape "${VERL_ACTOR_SHAPE:-small}" --strategy "${VERL_ACTOR_STRATEGY:-fsdp2}"
       --lora-rank "${VERL_ACTOR_LORA_RANK:-0}")
if [ "$NGPU" = 0 ]; then EXTRA+=(--tiny); fi
if [ -n "${VERL_ACTOR_ROLLOUT:-}" ]; then
  read -r GB MM <<<"$VERL_ACTOR_ROLLOUT"
  EXTRA+=(--rollout-gb "$GB" --rollout-matmuls "${MM:-0}")
fi
if [ "${VERL_ACTOR_WEIGHT_SYNC:-0}" = 1 ]; then EXTRA+=(--weight-sync); fi
if [ -n "${VERL_ACTOR_MICRO:-}" ]; then read -r MT MI <<<"$VERL_ACTOR_MICRO"; EXTRA+=(--micro-batch "$MT" "${MI:-$MT}"); fi
MODEL=${VERL_ACTOR_MODEL_DIR:-/tmp/verl_actor_model_$PRESET}
export TORCHFERRY_COMMIT=${TORCHFERRY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

LOG="$OUT/log.txt"
"$PY" -c 'import torch, transformers, verl, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "verl", verl.__version__, "gpus", torch.cuda.device_count())' 2>&1 | grep -v -i warn | tee "$LOG"
if [ ! -f "$MODEL/torchferry_prepare.json" ]; then
  "$PY" benchmarks/verl_actor.py prepare --preset "$PRESET" --model-dir "$MODEL" 2>&1 | tee -a "$LOG"
fi
STRATEGIES=(verl torchferry)
if [ "${VERL_ACTOR_RESIDENT:-1}" = 1 ]; then STRATEGIES=(resident "${STRATEGIES[@]}"); fi
for v in ${VERL_ACTOR_VARIANTS:-}; do STRATEGIES+=("$v"); done
for b in ${VERL_ACTOR_DOCK:-}; do STRATEGIES+=("torchferry+dock-$b:TORCHFERRY_VERL_DOCK=$b"); done
CUBLAS=${VERL_ACTOR_CUBLAS_WORKSPACE-:4096:8}
if [ -n "$CUBLAS" ]; then EXTRA+=(--cublas-workspace "$CUBLAS"); fi
if [ -n "${VERL_ACTOR_MAX_ROUND_S:-}" ]; then EXTRA+=(--max-round-seconds "$VERL_ACTOR_MAX_ROUND_S"); fi
if [ -n "${VERL_ACTOR_LOGPROBS:-}" ]; then EXTRA+=(--logprobs "$VERL_ACTOR_LOGPROBS"); fi
if [ -n "${VERL_ACTOR_SETTLE_S:-}" ]; then EXTRA+=(--settle-seconds "$VERL_ACTOR_SETTLE_S"); fi
if [ "${VERL_ACTOR_PROFILE:-0}" = 1 ]; then EXTRA+=(--profile-calls); fi
if [ "${VERL_ACTOR_BLOCKING_SYNC:-0}" = 1 ]; then EXTRA+=(--blocking-sync); fi
if [ "${VERL_ACTOR_GPU_BUSY:-0}" = 1 ]; then EXTRA+=(--gpu-busy); fi
if [ -n "${VERL_ACTOR_SEGMENTS:-}" ]; then EXTRA+=(--segments-at-wake "$OUT" "$VERL_ACTOR_SEGMENTS"); fi
RUN=(benchmarks/verl_actor.py run --strategies "${STRATEGIES[@]}" --model-dir "$MODEL" --steps "$STEPS" "${EXTRA[@]}")
if [ "${VERL_ACTOR_ISOLATE:-1}" = 1 ]; then
  # One process (group) per strategy, taking turns through $TURNS ([Note: one process per strategy]).
  TURNS=$(mktemp -d)  # the turn file and each process's records (merged into OUT/runs.json by the report)
  pids=(); parts=()
  for i in "${!STRATEGIES[@]}"; do
    label=${STRATEGIES[$i]%%:*}
    PIN=(); if [ "${VERL_ACTOR_PIN_CPUS:-1}" = 1 ]; then PIN=(--cpu-slot "$i" "${#STRATEGIES[@]}"); fi
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" "${RUN[@]}" --own "$label" "${PIN[@]}" \
        --turns "$TURNS" --out "$TURNS/runs.$i.json" > >(sed -u "s/^/[$label] /" | tee -a "$LOG") 2>&1 &
    pids+=($!); parts+=("$TURNS/runs.$i.json")
  done
  failed=0
  while [ "${#pids[@]}" -gt 0 ]; do  # as each ends: a failed one stops the others' waiting for their turns
    wait -n -p ended "${pids[@]}" || { failed=1; echo "a strategy's process failed" > "$TURNS/failed"; }
    left=(); for p in "${pids[@]}"; do [ "$p" = "$ended" ] || left+=("$p"); done; pids=("${left[@]}")
  done
  if [ "$failed" = 1 ]; then echo "error: a strategy's process failed (see $LOG)" >&2; exit 1; fi
else
  "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" "${RUN[@]}" --out "$OUT/runs.json" \
      2>&1 | tee -a "$LOG"
  parts=("$OUT/runs.json")
fi
CMD="bash benchmarks/verl_actor.sh OUT $NPROC $PRESET $STEPS"
for k in VERL_ACTOR_SHAPE VERL_ACTOR_STRATEGY VERL_ACTOR_LORA_RANK VERL_ACTOR_MICRO VERL_ACTOR_ROLLOUT VERL_ACTOR_WEIGHT_SYNC \
         VERL_ACTOR_RESIDENT VERL_ACTOR_VARIANTS VERL_ACTOR_CUBLAS_WORKSPACE VERL_ACTOR_MAX_ROUND_S VERL_ACTOR_LOGPROBS \
         VERL_ACTOR_DOCK VERL_ACTOR_ISOLATE VERL_ACTOR_SETTLE_S VERL_ACTOR_PIN_CPUS VERL_ACTOR_PROFILE \
         VERL_ACTOR_BLOCKING_SYNC; do
  if [ -n "${!k:-}" ]; then CMD="$k='${!k}' $CMD"; fi
done
"$PY" benchmarks/verl_actor.py report "${parts[@]}" --out-dir "$OUT" --command "$CMD" 2>&1 | tee -a "$LOG"
