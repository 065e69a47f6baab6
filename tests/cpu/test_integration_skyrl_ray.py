"""torchferry switched on for SkyRL's Ray workers (CPU, a real local Ray, SkyRL 0.4.0's own ``initialize_ray``).

SkyRL's FSDP workers are Ray actors and its training loop a Ray task, each its own process; ``patch()`` in the
driver does not reach them. These tests start Ray through SkyRL's ``initialize_ray`` (see skyrl_ray_probe.py)
and ask each process whether SkyRL's helpers are torchferry's."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu.skyrl_import import import_fsdp_utils

import_fsdp_utils()  # skips the module, with the reason, where SkyRL's fsdp_utils does not import

from torchferry.integrations.skyrl import HOOK_PATH, ray_worker_setup, with_worker_setup  # noqa: E402

PROBE = Path(__file__).with_name("skyrl_ray_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def test_hook_path_names_the_hook():
    module, _, name = HOOK_PATH.rpartition(".")
    assert getattr(importlib.import_module(module), name) is ray_worker_setup


def test_with_worker_setup_adds_the_hook_and_keeps_skyrls_env_vars_and_the_users_hook(monkeypatch):
    for k in [k for k in os.environ if k.startswith("TORCHFERRY_")]:
        monkeypatch.delenv(k)
    env = with_worker_setup({"env_vars": {"NCCL_CUMEM_ENABLE": "0"}})  # what SkyRL's initialize_ray passes
    assert env == {"env_vars": {"NCCL_CUMEM_ENABLE": "0", "TORCHFERRY_SKYRL": "1"},
                   "worker_process_setup_hook": HOOK_PATH}
    env = with_worker_setup({"worker_process_setup_hook": "my.module.setup"})
    assert env["worker_process_setup_hook"] == HOOK_PATH
    assert env["env_vars"]["TORCHFERRY_SKYRL_NEXT_HOOK"] == "my.module.setup"
    env = with_worker_setup({"worker_process_setup_hook": lambda: None})
    assert callable(env["worker_process_setup_hook"]) and env["worker_process_setup_hook"] is not ray_worker_setup
    once = with_worker_setup({})
    assert with_worker_setup(once) == once


def test_with_worker_setup_passes_the_drivers_torchferry_settings_on(monkeypatch):
    """``TORCHFERRY_SKIP_UNCHANGED=0`` set where the driver runs reaches the workers (Ray passes a
    runtime_env's env_vars, not the driver's environment); the job's own env_vars win."""
    monkeypatch.setenv("TORCHFERRY_SKIP_UNCHANGED", "0")
    monkeypatch.setenv("TORCHFERRY_SKYRL", "0")  # the hook's own flag is never taken from the driver
    for node_local in ("TORCHFERRY_LEDGER_DIR", "TORCHFERRY_HOST_BUDGET_BYTES", "TORCHFERRY_VERIFY_SKIPS",
                       "TORCHFERRY_VERL_NEXT_HOOK"):  # other nodes' own, tests', the other integration's
        monkeypatch.setenv(node_local, "1")
    env = with_worker_setup({"env_vars": {"TORCHFERRY_SWITCH_BYTES": "0"}})
    assert env["env_vars"]["TORCHFERRY_SKIP_UNCHANGED"] == "0"
    assert env["env_vars"]["TORCHFERRY_SKYRL"] == "1"
    assert set(env["env_vars"]) == {"TORCHFERRY_SKIP_UNCHANGED", "TORCHFERRY_SKYRL", "TORCHFERRY_SWITCH_BYTES"}
    monkeypatch.setenv("TORCHFERRY_SWITCH_BYTES", "1048576")
    assert with_worker_setup({"env_vars": {"TORCHFERRY_SWITCH_BYTES": "0"}})["env_vars"]["TORCHFERRY_SWITCH_BYTES"] == "0"


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **env})


FSDP_UTILS = "skyrl.backends.skyrl_train.distributed.fsdp_utils"


def test_hook_patches_right_after_skyrl_imports_fsdp_utils_and_not_before():
    code = (
        "import sys\n"
        "from tests.cpu.skyrl_import import apply\n"
        "from torchferry.integrations.skyrl import ray_worker_setup, is_patched\n"
        "from torchferry.integrations import skyrl as _helpers\n"
        "ray_worker_setup(); apply()\n"
        f"assert '{FSDP_UTILS}' not in sys.modules and not is_patched()  # nothing imported for it\n"
        f"from {FSDP_UTILS} import offload_fsdp_optimizer  # as SkyRL's fsdp_strategy does\n"
        f"import {FSDP_UTILS} as fu\n"
        "assert is_patched()\n"
        "assert fu.offload_fsdp2_model_to_cpu.__torchferry_original__ is not None\n"
        "assert offload_fsdp_optimizer.__wrapped__ is _helpers.offload_fsdp_optimizer  # bound by name\n"
        "print('ok')\n"
    )
    p = _fresh(code)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_hook_does_nothing_when_switched_off_and_still_runs_the_users_hook():
    code = (
        "from torchferry.integrations.skyrl import ray_worker_setup, is_patched\n"
        "ray_worker_setup()  # TORCHFERRY_SKYRL=0; the next hook (skyrl_import.apply) still runs\n"
        f"import {FSDP_UTILS}\n"
        "assert not is_patched(); print('ok')\n"
    )
    p = _fresh(code, TORCHFERRY_SKYRL="0", TORCHFERRY_SKYRL_NEXT_HOOK="tests.cpu.skyrl_import.apply")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


@pytest.mark.parametrize("mode, patched", [("hook", True), ("launcher", True), ("off", False)])
def test_ray_processes_started_by_skyrls_initialize_ray_see_the_patched_helpers(mode, patched, tmp_path):
    """hook: initialize_ray inside ray_init_with_hook(); launcher: torchferry.integrations.skyrl.main_base as
    SkyRL's trainer.override_entrypoint; off: initialize_ray alone (the probe sees no torchferry there)."""
    pytest.importorskip("ray")
    out = tmp_path / "probe.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "SKYRL_DUMP_INFRA_LOG_TO_STDOUT": "1"}
    p = subprocess.run([sys.executable, str(PROBE), mode, str(out)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    seen = json.loads(out.read_text())
    for where in ("entrypoint", "worker"):  # a task (SkyRL's skyrl_entrypoint) and an actor (an FSDP worker)
        s = seen[where]
        assert s["pid"] != seen["driver_pid"]
        assert (s["is_patched"], s["fsdp_utils"]) == (patched, patched), (where, s)
        assert s["TORCHFERRY_SKYRL"] == ("1" if patched else None)
        assert s["NCCL_CUMEM_ENABLE"] == "0"  # the env_vars SkyRL's initialize_ray sets were kept
    assert seen["worker"]["pid"] != seen["entrypoint"]["pid"]
    if mode == "launcher":
        assert seen["argv"] == ["trainer.epochs=1"]  # SkyRL's hand-over override dropped, the rest passed on
