"""What every part of the verl step bench shares: paths, the schema, the verl code it runs."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
ROOT = HERE.parent
SCHEMA = "torchferry.verl-step/1"
ATTENTION = "eager"

VERL_CODE = [
    "verl.utils.config.omega_conf_to_dataclass (verl/trainer/config/_generated_ppo_trainer.yaml + overrides)",
    "verl.utils.distributed.initialize_global_process_group (as verl.trainer.sft_trainer.run_sft)",
    "verl.workers.engine_workers.TrainingWorker: __init__, reset, set_loss_fn, infer_batch, train_mini_batch, "
    "train_batch (as ActorRolloutRefWorker.init_model / compute_log_prob / update_actor use it)",
    "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead: initialize (apply_fsdp2, "
    "fsdp2_load_full_state_dict, build_optimizer), eval_mode/train_mode, infer_batch/train_batch, optimizer_step",
    "verl.workers.engine.base.BaseEngineCtx._context_switch -> FSDPEngine.to -> load_fsdp_model_to_gpu, "
    "load_fsdp_optimizer, offload_fsdp_model_to_cpu, offload_fsdp_optimizer",
    "verl.workers.utils.losses.ppo_loss (vanilla policy loss, token-mean)",
    "verl.workers.utils.padding.left_right_2_no_padding / no_padding_2_padding",
]
