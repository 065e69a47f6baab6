"""Run by tests/cpu/test_integration_verl_ray.py in a fresh process: verl's own entry point and worker groups
on a real local Ray (CPU only), reporting whether each process routes verl's helpers through
torchferry.

    python tests/cpu/verl_ray_probe.py launcher|hydra|off OUT.json

``launcher``: ``torchferry.integrations.verl.main_ppo.main(...)``; ``hydra``: verl's own
``verl.trainer.main_ppo.main()`` with the hook as a Hydra override; ``off``: verl's own, no hook.
Everything of verl runs as in a training job (Hydra config, ``run_ppo`` and its ``ray.init``, a
TaskRunner actor, a ``RayWorkerGroup`` of ``Worker`` actors on a ``RayResourcePool``), except
that the TaskRunner is a probe that builds one worker group instead of a trainer, and verl's
``validate_config`` (which loads the model's files) is skipped.
"""

import json
import os
import sys

import ray
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


def _state() -> dict:
    """What this process sees, after importing verl's FSDP engine as verl's TrainingWorker does."""
    from verl.utils import fsdp_utils
    from verl.workers.engine.fsdp import transformer_impl

    import torchferry.integrations.verl as helpers
    from torchferry.integrations.verl import is_patched

    return {
        "pid": os.getpid(),
        "is_patched": is_patched(),
        "fsdp_utils": getattr(fsdp_utils.offload_fsdp2_model_to_cpu, "__wrapped__", None)
        is helpers.offload_fsdp2_model_to_cpu,
        "engine": hasattr(transformer_impl.offload_fsdp_model_to_cpu, "__torchferry_original__")
        and hasattr(transformer_impl.load_fsdp_optimizer, "__torchferry_original__"),  # both replaced
        "TORCHFERRY_VERL": os.environ.get("TORCHFERRY_VERL"),
        "RANK": os.environ.get("RANK"),
    }


class ProbeWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def probe(self):
        return _state()


@ray.remote
class ProbeTaskRunner:
    """Stands in for verl's TaskRunnerV1: builds a worker group as verl's trainer does."""

    def run(self, config):
        pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(ProbeWorker)))
        out = {"task_runner": _state(), "worker": group.probe()[0]}
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(out, f)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    os.environ["PROBE_OUT"] = out  # local Ray workers inherit the driver's environment
    from verl.trainer import main_ppo

    main_ppo.TaskRunnerV1 = ProbeTaskRunner  # verl's main() calls run_ppo(config, TaskRunnerV1)
    main_ppo.validate_config = lambda **kwargs: None  # it loads the model's files; there is no model here
    args = ["ray_kwargs.ray_init.num_cpus=2", "trainer.use_v1=True"]
    if mode == "launcher":
        from torchferry.integrations.verl.main_ppo import main as launcher

        launcher(args)
    else:
        if mode == "hydra":
            args.append("+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook="
                        "torchferry.integrations.verl.ray_worker_setup")
        sys.argv = [sys.argv[0], *args]
        main_ppo.main()
    ray.shutdown()


if __name__ == "__main__":
    main()
