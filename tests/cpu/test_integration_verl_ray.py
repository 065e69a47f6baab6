"""torchferry switched on for verl's Ray workers in one step (CPU, a real local Ray, verl 0.9.1).

verl's FSDP workers are Ray actors, each its own process; ``patch()`` in the driver does not
reach them. These tests start verl's own entry point, TaskRunner actor and worker group (see
verl_ray_probe.py) and ask each process whether verl's helpers are torchferry's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")

from torchferry.integrations.verl import HOOK_PATH, ray_worker_setup, with_worker_setup  # noqa: E402

PROBE = Path(__file__).with_name("verl_ray_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def test_hook_path_names_the_hook():
    import importlib

    module, _, name = HOOK_PATH.rpartition(".")
    assert getattr(importlib.import_module(module), name) is ray_worker_setup


def test_with_worker_setup_adds_the_hook_and_keeps_the_users(monkeypatch):
    for k in [k for k in os.environ if k.startswith("TORCHFERRY_")]:
        monkeypatch.delenv(k)
    env = with_worker_setup({"env_vars": {"A": "1"}, "working_dir": None})
    assert env == {"env_vars": {"A": "1", "TORCHFERRY_VERL": "1"}, "working_dir": None,
                   "worker_process_setup_hook": HOOK_PATH}
    assert with_worker_setup(None) == {"env_vars": {"TORCHFERRY_VERL": "1"}, "worker_process_setup_hook": HOOK_PATH}
    # A hook of the user's own runs after ours: by name...
    env = with_worker_setup({"worker_process_setup_hook": "my.module.setup"})
    assert env["worker_process_setup_hook"] == HOOK_PATH
    assert env["env_vars"]["TORCHFERRY_VERL_NEXT_HOOK"] == "my.module.setup"
    # ... or wrapped, when it is a callable.
    calls = []
    env = with_worker_setup({"worker_process_setup_hook": lambda: calls.append("theirs")})
    assert callable(env["worker_process_setup_hook"]) and env["worker_process_setup_hook"] is not ray_worker_setup
    # Idempotent.
    once = with_worker_setup({})
    assert with_worker_setup(once) == once


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_hook_patches_right_after_verl_imports_fsdp_utils_and_not_before():
    code = (
        "import sys\n"
        "import torchferry.integrations.verl as helpers\n"
        "from torchferry.integrations.verl import ray_worker_setup, is_patched\n"
        "ray_worker_setup()\n"
        "assert 'verl.utils.fsdp_utils' not in sys.modules and not is_patched()  # nothing imported for it\n"
        "from verl.workers.engine.fsdp import transformer_impl as ti  # as verl's TrainingWorker does\n"
        "from verl.utils import fsdp_utils\n"
        "assert is_patched()\n"
        "assert fsdp_utils.offload_fsdp2_model_to_cpu.__wrapped__ is helpers.offload_fsdp2_model_to_cpu\n"
        "assert ti.offload_fsdp_optimizer.__wrapped__ is helpers.offload_fsdp_optimizer  # bound by name\n"
        "assert ti.load_fsdp_model_to_gpu.__torchferry_original__ is not None\n"
        "print('ok')\n"
    )
    p = _fresh(code)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


@pytest.mark.parametrize("off", ["0", " False ", "no", "OFF"])  # before: only "0" switched it off
def test_hook_does_nothing_when_switched_off(off):
    code = (
        f"import os; os.environ['TORCHFERRY_VERL'] = {off!r}\n"
        "from torchferry.integrations.verl import ray_worker_setup, is_patched\n"
        "ray_worker_setup()\n"
        "import verl.utils.fsdp_utils\n"
        "assert not is_patched(); print('ok')\n"
    )
    p = _fresh(code)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_a_bad_dock_budget_fails_every_import_of_verls_helpers():
    """Reproduces: the first import raised, a second one succeeded with verl unpatched. The Ray hook refuses
    the budget itself now, before anything is armed; armed without the hook's check
    (``patch_when_imported()``), every import of verl's helpers fails alike."""
    code = (
        "import os; os.environ['TORCHFERRY_VERL_DOCK'] = 'lots'\n"
        "from torchferry.integrations.verl import ray_worker_setup, is_patched, patch_when_imported\n"
        "try:\n"
        "    ray_worker_setup()\n"
        "except ValueError as e:\n"
        "    assert \"TORCHFERRY_VERL_DOCK: 'lots' is not a dock budget\" in str(e), e\n"
        "else:\n"
        "    raise AssertionError('the hook took the budget')\n"
        "patch_when_imported()\n"
        "for attempt in range(3):\n"
        "    try:\n"
        "        import verl.utils.fsdp_utils\n"
        "    except ValueError as e:\n"
        "        assert \"TORCHFERRY_VERL_DOCK: 'lots' is not a dock budget\" in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(f'import {attempt} succeeded, patched: {is_patched()}')\n"
        "    assert not is_patched()\n"
        "os.environ['TORCHFERRY_VERL_DOCK'] = ''  # the setting fixed: the next import patches\n"
        "import verl.utils.fsdp_utils\n"
        "assert is_patched(); print('ok')\n"
    )
    p = _fresh(code)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


@pytest.mark.parametrize("mode, patched", [("launcher", True), ("hydra", True), ("off", False)])
def test_ray_workers_started_by_verl_see_the_patched_helpers(mode, patched, tmp_path):
    """launcher: python -m torchferry.integrations.verl.main_ppo; hydra: verl's main_ppo with the
    hook as an override; off: verl's main_ppo alone (the probe sees no torchferry there)."""
    pytest.importorskip("ray")
    pytest.importorskip("hydra")
    out = tmp_path / "probe.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(PROBE), mode, str(out)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    seen = json.loads(out.read_text())
    for where in ("task_runner", "worker"):  # verl's TaskRunner actor, and a Worker of a RayWorkerGroup
        s = seen[where]
        assert s["pid"] != os.getpid()
        assert (s["is_patched"], s["fsdp_utils"], s["engine"]) == (patched, patched, patched), (where, s)
        assert s["TORCHFERRY_VERL"] == ("1" if mode == "launcher" else None)
    assert seen["worker"]["RANK"] == "0"  # the env_vars verl's worker group sets were merged, not replaced
    assert seen["worker"]["pid"] != seen["task_runner"]["pid"]
