#!/usr/bin/env python3
"""verl 0.9.1's own actor (FSDP2 or FSDP1, ``param_offload`` and ``optimizer_offload`` on) in a
colocated step: resident (offload off), verl's own helpers (the seed) and torchferry's, each in
a process of its own (or all in one), rounds interleaved, on the same seeds and data: bit-identity, bytes moved and the
transfer each strategy leaves exposed in the step.

One command runs it all (the run, then the report)::

    bash benchmarks/verl_actor.sh OUT [NPROC] [PRESET] [STEPS]

or by hand::

    python benchmarks/verl_actor.py prepare --preset qwen2.5-1.5b --model-dir /tmp/verl_actor_model
    torchrun --standalone --nproc_per_node 2 benchmarks/verl_actor.py run --model-dir /tmp/verl_actor_model \\
        --strategies resident verl torchferry plain:TORCHFERRY_LAYERWISE_RELOAD=0 --out OUT/runs.json
    python benchmarks/verl_actor.py report OUT/runs.json --out-dir OUT

Each strategy has its own actor, built with its helpers in place (``patch()`` under its settings
for a torchferry strategy, verl's own helpers otherwise); each round runs one step of every
strategy, the order rotated by one each round, so drift of the machine falls on all alike. While
one strategy runs, the others' state sits where their last phase left it (offloaded, or on the
GPU for ``resident``), as the roles of a colocated worker share one GPU.

What of verl runs (verl 0.9.1, unmodified; see ``VERL_CODE`` below, also written into the JSON):

* the actor is built as ``ActorRolloutRefWorker.init_model`` builds it (its "actor" branch):
  the config from verl's own ``trainer/config/_generated_ppo_trainer.yaml`` with Hydra-style
  overrides (``actor_rollout_ref.actor.strategy=fsdp2``, ``...fsdp_config.param_offload=True``,
  ``...fsdp_config.optimizer_offload=True``, ...), turned into dataclasses by
  ``verl.utils.config.omega_conf_to_dataclass``, a ``verl.workers.engine_workers.TrainingWorker``
  (whose engine is ``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead``: the model
  from the checkpoint folder, ``apply_fsdp2``, ``fsdp2_load_full_state_dict``, AdamW), ``reset()``
  and ``set_loss_fn(partial(ppo_loss, config=actor_config))``;
* each step does what verl's PPO trainer does around the rollout (no rollout engine here: the
  "responses" are seeded random tokens, and the advantages seeded random scores):
  ``left_right_2_no_padding``, then ``TrainingWorker.infer_batch`` (what
  ``ActorRolloutRefWorker.compute_log_prob`` calls: old log-probs and entropy), then
  ``TrainingWorker.train_mini_batch`` (what ``ActorRolloutRefWorker.update_actor`` calls: PPO
  mini-batches, ``ppo_loss``, clip, AdamW); with LoRA, between them, the reference log-probs as
  verl's trainer computes them with ``ref_in_actor`` (``infer_batch`` with ``no_lora_adapter``:
  the actor with its adapters off). All enter verl's ``engine.eval_mode()`` /
  ``engine.train_mode()``, whose ``BaseEngineCtx`` calls ``FSDPEngine.to(...)``, which calls
  ``load_fsdp_model_to_gpu`` / ``load_fsdp_optimizer`` on entry and ``offload_fsdp_model_to_cpu``
  / ``offload_fsdp_optimizer`` on exit: verl's own offload helpers (PR #7347's
  ``model.to(..., non_blocking=True)``) for the ``verl`` strategy, torchferry's after
  ``torchferry.integrations.verl.patch()`` for a torchferry one;
* the process group is set up as verl's SFT trainer (``run_sft``) sets it up under torchrun
  (``verl.utils.distributed.initialize_global_process_group``), and ``TrainingWorker`` is used
  in that SPMD mode, as ``verl.trainer.sft_trainer.SFTTrainer`` uses it.

Measured around verl's code, not inside it: ``FSDPEngine.to`` is timed (synchronised before the
call, a phase boundary; an offload until its copies are complete, synchronised; a reload from the
call until the compute stream may go on, by CUDA events, with no synchronisation after it, so a
reload left to the forward overlaps it as in verl's trainer), and after the last round each rank
compares every local parameter shard, optimizer-state tensor and weight-sync buffer of each
strategy with verl's, byte for byte, in the process (log-probs by sha256 per step). The
``resident`` strategy (verl with ``param_offload`` and ``optimizer_offload`` off) is the baseline
of ``exposed``: per round, each strategy's step seconds less the resident step of the same round,
which is what offloading costs a step even where its copies hide behind compute.

Not verl: where ``ray`` is not installed (it is large; verl imports it at module level but this
SPMD path never talks to a Ray cluster), ``benchmarks/verl_raystub`` stands in for it (see its
docstring; recorded in the JSON). On a machine without CUDA (a check that the script runs end to
end, gloo), a CPU platform is registered through verl's own ``verl.plugin.platform.set_platform``
and ``FSDPEngine.to`` is told the direction it is asked for (on the CPU the device's name and
"cpu" are the same, so verl would load on both sides); neither happens on a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The parts, by concern (benchmarks/verl_step/); the names below are the ones callers and tests use.
from verl_step.config import SHAPES  # noqa: E402
from verl_step.environment import cmd_prepare  # noqa: E402
from verl_step.logprobs import LOGPROB_ROWS, _logprobs_chunked  # noqa: E402, F401
from verl_step.records import against, fingerprints  # noqa: E402, F401
from verl_step.report import _view, bars, cmd_report, cmd_timeline, identical, merge_runs, report  # noqa: E402, F401
from verl_step.run import cmd_run  # noqa: E402
from verl_step.strategies import BUDGETS, Strategy, dock_budget, parse_strategies  # noqa: E402, F401


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write a random-init Qwen2 checkpoint folder")
    p.add_argument("--preset", default="qwen2.5-1.5b", help="a torchferry.bench preset (default: %(default)s)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("run", help="every strategy's actor in one process under torchrun, rounds interleaved")
    p.add_argument("--strategies", nargs="+", default=["resident", "verl", "torchferry"],
                   help="resident (offload off), verl (its own helpers), torchferry (patch() defaults), "
                        "LABEL:K=V[,K=V] (torchferry under these settings); default: %(default)s")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True, help="the runs' records (JSON; `report` turns them into the result)")
    p.add_argument("--steps", type=int, default=4, help="rounds: each strategy's steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--tiny", action="store_true", help="small batches (the CPU check)")
    p.add_argument("--shape", choices=SHAPES, default="small", help="the batch per step (default: %(default)s)")
    p.add_argument("--strategy", choices=["fsdp", "fsdp2"], default="fsdp2", help="verl's actor strategy")
    p.add_argument("--lora-rank", type=int, default=0, help="verl's lora_rank (0: full fine-tuning)")
    p.add_argument("--micro-batch", type=int, nargs=2, default=None, metavar=("TRAIN", "INFER"),
                   help="sequences per micro-batch in update_actor and in the log-prob phases (default: the shape's)")
    p.add_argument("--rollout-gb", type=float, default=0.0, help="rollout stand-in: KV-cache GB held")
    p.add_argument("--rollout-matmuls", type=int, default=0, help="rollout stand-in: bf16 8192^3 matmuls")
    p.add_argument("--weight-sync", action="store_true",
                   help="verl's weight sync after update_actor, as update_weights does it (see _weight_sync)")
    p.add_argument("--cublas-workspace", default=None,
                   help="CUBLAS_WORKSPACE_CONFIG after verl's full_determinism set its own (:16:8), before the "
                        "first matmul (e.g. :4096:8, also deterministic)")
    p.add_argument("--logprobs", choices=["chunked", "verl"], default="chunked",
                   help="log-probs in verl's FSDP engine: chunked (the bench's, one log_softmax per 2048 rows) or "
                        "verl (its fallback without flash-attn: one per token, host-bound); default: %(default)s")
    p.add_argument("--max-round-seconds", type=float, default=0.0,
                   help="start no round after this many seconds of rounds (at least 2 run; 0: all --steps)")
    p.add_argument("--own", default=None, metavar="LABEL",
                   help="build and step this strategy alone, taking turns with the other strategies' processes "
                        "through --turns ([Note: one process per strategy]); default: every strategy here")
    p.add_argument("--turns", default=None, metavar="DIR", help="the folder the processes take turns through")
    p.add_argument("--settle-seconds", type=float, default=0.0,
                   help="seconds to wait before each step (after the turn came), outside its timing (default: 0)")
    p.add_argument("--segments-at-wake", nargs=2, default=None, metavar=("DIR", "ROUND"),
                   help="diagnosis: record allocation stacks and write the allocator's segments at ROUND's "
                        "rollout wake to DIR/segments_<label>_rank<r>.json")
    p.add_argument("--blocking-sync", action="store_true",
                   help="diagnosis: a thread waiting on the GPU sleeps instead of spinning, so phase_cpu_s counts the\n"
                        "host's work only (CU_CTX_SCHED_BLOCKING_SYNC; slower synchronisations)")
    p.add_argument("--gpu-busy", action="store_true",
                   help="diagnosis: each step under PyTorch's profiler (CUDA activity only): the seconds the GPU was "
                        "busy per phase in runs.json (strategies[label][\"gpu_busy\"]; verl_step/gpu_busy.py)")
    p.add_argument("--profile-calls", action="store_true",
                   help="diagnosis: each offload/reload call after the first round under cProfile (slower); the "
                        "top functions per phase and direction in runs.json (strategies[label][\"call_profile\"])")
    p.add_argument("--cpu-slot", type=int, nargs=2, default=None, metavar=("I", "N"),
                   help="run on share I of N equal shares of this process's CPUs (split again among the node's "
                        "ranks), so that the strategies' processes never share a core")
    p = sub.add_parser("report", help="a run's records -> the torchferry.verl-step/1 JSON")
    p.add_argument("runs", nargs="+", help="the run's records: one file per process (run --own), or one")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--command", default=None, help="the command to record in env.command")
    p = sub.add_parser("timeline", help="a PNG of a dock strategy's moves in its last step")
    p.add_argument("results", nargs="+", help="the per-budget results (..._dock-<budget>.json)")
    p.add_argument("--out", required=True, help="the PNG")
    args = ap.parse_args(argv)
    {"prepare": cmd_prepare, "run": cmd_run, "report": cmd_report, "timeline": cmd_timeline}[args.cmd](args)


if __name__ == "__main__":
    main()
