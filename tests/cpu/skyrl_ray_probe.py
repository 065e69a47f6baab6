"""Run by tests/cpu/test_integration_skyrl_ray.py in a fresh process: SkyRL's own ``initialize_ray`` on a real
local Ray (CPU only), then a task and an actor standing in for SkyRL's ``skyrl_entrypoint`` task and one of
its FSDP workers, each reporting whether SkyRL's helpers are torchferry's in its process.

    python tests/cpu/skyrl_ray_probe.py hook|launcher|off OUT.json

``hook``: ``initialize_ray(cfg)`` inside ``torchferry.integrations.skyrl.ray_init_with_hook()``;
``launcher``: ``torchferry.integrations.skyrl.main_base.main(...)`` with SkyRL's ``main_base`` replaced by a
stand-in whose ``main()`` does what SkyRL's does after parsing its config (``initialize_ray(cfg)``, then
the entrypoint task; the real one needs a model, and on Python 3.11 its Tinker imports fail); ``off``:
``initialize_ray(cfg)`` alone.
"""

import json
import os
import sys
import types

from tests.cpu.skyrl_import import apply

apply()

import ray  # noqa: E402
from skyrl.train.config import SkyRLTrainConfig  # noqa: E402
from skyrl.train.utils.utils import initialize_ray  # noqa: E402


def _state() -> dict:
    """What this process sees after importing SkyRL's FSDP helpers, as SkyRL's FSDP worker module does."""
    from tests.cpu.skyrl_import import apply

    apply()  # this worker's Python may be 3.11 too
    from skyrl.backends.skyrl_train.distributed import fsdp_utils

    from torchferry.integrations import skyrl as _helpers  # the public helper: the same function object
    from torchferry.integrations.skyrl import is_patched

    return {
        "pid": os.getpid(),
        "is_patched": is_patched(),
        "fsdp_utils": getattr(fsdp_utils.offload_fsdp_optimizer, "__wrapped__", None) is _helpers.offload_fsdp_optimizer
        and hasattr(fsdp_utils.load_fsdp2_model_to_gpu, "__torchferry_original__"),
        "TORCHFERRY_SKYRL": os.environ.get("TORCHFERRY_SKYRL"),
        "NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE"),  # one of the env_vars SkyRL sets
    }


@ray.remote(num_cpus=0)
class ProbeWorker:
    def probe(self):
        return _state()


@ray.remote(num_cpus=0)
def probe_entrypoint():
    """Stands in for SkyRL's ``skyrl_entrypoint`` task, which builds the trainer and its worker actors."""
    worker = ProbeWorker.remote()
    return {"entrypoint": _state(), "worker": ray.get(worker.probe.remote())}


def _config(log_path: str) -> SkyRLTrainConfig:
    cfg = SkyRLTrainConfig()
    cfg.trainer.log_path = log_path
    return cfg


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    log_path = os.path.join(os.path.dirname(os.path.abspath(out)), "skyrl-logs")
    result: dict = {}
    if mode == "launcher":
        stand_in = types.ModuleType("skyrl.train.entrypoints.main_base")

        def stand_in_main() -> None:
            result["argv"] = sys.argv[1:]
            initialize_ray(_config(log_path))
            result.update(ray.get(probe_entrypoint.remote()))

        stand_in.main = stand_in_main  # type: ignore[attr-defined]
        sys.modules[stand_in.__name__] = stand_in
        import skyrl.train.entrypoints

        skyrl.train.entrypoints.main_base = stand_in  # type: ignore[attr-defined]
        from torchferry.integrations.skyrl.main_base import main as launcher

        sys.argv = [sys.argv[0], "trainer.override_entrypoint=torchferry.integrations.skyrl.main_base",
                    "trainer.epochs=1"]
        launcher()
    else:
        if mode == "hook":
            from torchferry.integrations.skyrl import ray_init_with_hook

            with ray_init_with_hook():
                initialize_ray(_config(log_path))
        else:
            initialize_ray(_config(log_path))
        result.update(ray.get(probe_entrypoint.remote()))
    result["driver_pid"] = os.getpid()
    with open(out, "w") as f:
        json.dump(result, f)
    ray.shutdown()


if __name__ == "__main__":
    main()
