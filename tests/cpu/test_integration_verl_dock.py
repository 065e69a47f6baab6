"""``torchferry.integrations.verl.patch(dock=...)`` against verl 0.9.1: the budget read and checked at
``patch()`` (nothing replaced on an error), the Ray hook passing it on, and verl's own actor (its
TrainingWorker / FSDP2 engine, param and optimizer offload on) under a dock in the bench's colocated
step (``benchmarks/verl_actor.sh``, tiny model, 2 gloo ranks): bit-identical to verl's own helpers, the
order of moves in a step under a tight budget, none under a roomy one. ``check_dock_run`` is also
the GPU test's (tests/gpu/test_verl_dock_cuda.py), where the peak is measured too."""

import asyncio
import gc
import json
import os
import types
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl.workers.engine_workers", reason="verl's actor code and what it imports are not installed")
pytest.importorskip("hydra")

import torchferry.integrations.verl as tf_verl  # noqa: E402
from torchferry import Residency  # noqa: E402
from torchferry.integrations import _base as compat  # noqa: E402
from torchferry.integrations.verl import _dock  # noqa: E402
from torchferry.integrations._base import DOCK_ENV, REGISTRY, parse_budget  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import verl_actor  # noqa: E402

from verl.workers import engine_workers  # noqa: E402
from verl.workers.engine import base  # noqa: E402


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(DOCK_ENV, raising=False)
    tf_verl.unpatch()
    REGISTRY.kept.clear()  # each test's docks its own
    yield
    tf_verl.unpatch()
    REGISTRY.kept.clear()


def _originals():
    return (base.BaseEngineCtx.__dict__["__enter__"], base.BaseEngineCtx.__dict__["__exit__"],
            engine_workers.ActorRolloutRefWorker.__dict__["init_model"])


@pytest.mark.parametrize("value,expected", [
    (None, None), (0, None), ("", None), ("0", None), (0.0, None), ("0.0", None), (2**21, 2**21),
    ("2097152", 2**21), (0.5, 0.5), ("0.25", 0.25), (1.0, 1.0), (40e9, 40 * 10**9), ("40e9", 40 * 10**9),
    (np.int64(2**30), 2**30), (np.float32(0.5), 0.5)])
def test_a_budget_is_bytes_or_a_fraction_of_the_device(value, expected):
    got = parse_budget(value, "x")
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("value", [True, -1, 1, "1", 12345, 1.5, 2.5e9 + 0.5, float("nan"), float("inf"), "lots",
                                   "-3", [1], b"5"])
def test_a_bad_budget_fails_at_patch_with_nothing_replaced(value):
    before = _originals()
    with pytest.raises(ValueError, match="dock budget|give bytes") as e:
        tf_verl.patch(dock=value)
    assert "\n" not in str(e.value)
    assert _originals() == before and not tf_verl.is_patched() and _dock.docked() is None


def test_a_bad_budget_in_the_environment_fails_at_patch_naming_it(monkeypatch):
    monkeypatch.setenv(DOCK_ENV, "half")
    with pytest.raises(ValueError, match=DOCK_ENV):
        tf_verl.patch()
    assert not tf_verl.is_patched() and _dock.docked() is None


def test_an_unknown_verl_version_fails_at_patch_with_nothing_replaced(monkeypatch):
    import verl

    monkeypatch.setattr(verl, "__version__", "0.10.0")
    before = _originals()
    with pytest.raises(RuntimeError, match="verl 0.9.x, this is verl 0.10.0"):
        tf_verl.patch(dock=10**9)
    assert _originals() == before and not tf_verl.is_patched()


def test_a_changed_engine_context_fails_at_patch(monkeypatch):
    monkeypatch.setattr(base.BaseEngineCtx, "__exit__", lambda self, a, b: None)
    with pytest.raises(RuntimeError, match=r"BaseEngineCtx.__exit__\('self', 'a', 'b'\) does not have the parameters"):
        tf_verl.patch(dock=10**9)
    assert not tf_verl.is_patched()


def test_patch_replaces_the_context_and_unpatch_puts_it_back():
    before = _originals()
    names = tf_verl.patch(dock=10**9)
    assert "verl.workers.engine.base.BaseEngineCtx.__enter__" in names
    assert _originals() != before and _dock.docked() is not None
    assert REGISTRY.patched["verl"].helpers.router is _dock.docked()
    assert _dock.docked().budget == 10**9
    assert compat.patch_choices("verl")[DOCK_ENV] == str(10**9)  # what the Ray hook passes on
    kept = _dock.docked()
    tf_verl.unpatch()
    assert _originals() == before and _dock.docked() is None and compat.helpers_of("verl").router is None
    tf_verl.patch(dock=10**9)  # the same budget: the same dock, its sets where it left them
    assert _dock.docked() is kept
    tf_verl.unpatch()
    tf_verl.patch(dock=2 * 10**9)  # another budget: its own dock; the first is kept for its budget
    assert _dock.docked() is not kept and _dock.docked().budget == 2 * 10**9 and kept in _dock.docks()


def test_without_a_dock_nothing_of_it_is_replaced():
    before = _originals()
    tf_verl.patch()
    assert _originals() == before and _dock.docked() is None and DOCK_ENV not in compat.patch_choices("verl")


def test_the_ray_hook_forwards_the_budget():
    from torchferry.integrations._base import FORWARDED_SETTINGS

    assert DOCK_ENV in FORWARDED_SETTINGS


def test_dock_rollout_checks_its_arguments():
    class Rollout:
        async def resume(self, tags):
            return tags

        async def release(self):
            return None

    with pytest.raises(ValueError, match="weights_bytes must be an int >= 0"):
        tf_verl.dock_rollout(Rollout(), -1, 0)
    with pytest.raises(TypeError, match="no resume"):
        tf_verl.dock_rollout(object(), 1, 1)
    r = Rollout()
    assert tf_verl.dock_rollout(r, 1, 1) is r and tf_verl.dock_rollout(r, 1, 1) is r  # once


def test_the_bench_budgets_are_what_they_say():
    n, world, kv, w = 1000, 2, 10**6, 2400
    p, o = 4 * n // world, 8 * n // world
    tight = verl_actor.dock_budget("tight", n, world, kv, w)
    assert tight == kv + w + p // 2 + o
    assert tight < kv + w + p + o  # the rollout does not fit with all the state: a set must leave
    assert verl_actor.dock_budget("roomy", n, world, kv, w) == 2 * (kv + w + 2 * p + o)
    with pytest.raises(ValueError, match="none of"):
        verl_actor.dock_budget("loose", n, world, kv, w)
    # LoRA: the gradients and AdamW's moments are the adapters' only, so a tight budget stays too small
    t = 100
    g, o = 4 * t // world, 8 * t // world
    tight = verl_actor.dock_budget("tight", n, world, kv, w, t)
    assert tight == kv + w + p // 2 + o and tight < kv + w + p + o
    assert verl_actor.dock_budget("roomy", n, world, kv, w, t) == 2 * (kv + w + p + g + o)
    from verl_step.strategies import lora_trainable

    qwen = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
            "num_key_value_heads": 2}  # Qwen2.5-1.5B: AdamW's state for rank 64 was 590,874,144 bytes, 1,568 of
    assert 8 * lora_trainable(qwen, 64) == 590_874_144 - 1_568  # them the 392 step counters (728fc68's JSON)


# ---------------------------------------------------------------------------- verl's actor under the dock
def run_dock_bench(out: Path, nproc: str, preset: str, rollout: str, cpu: bool, **extra: str) -> dict[str, dict]:
    """``benchmarks/verl_actor.sh`` with verl, torchferry and a dock strategy under a tight and a roomy
    budget (``VERL_ACTOR_DOCK="tight roomy"``), 4 rounds, the weight sync on (``extra``: more of the bench's
    variables); returns the per-budget JSONs (``tight``, ``roomy``)."""
    env = {**os.environ, "PYTHON": sys.executable, "VERL_ACTOR_MODEL_DIR": str(out / "model"),
           "OMP_NUM_THREADS": "1", "VERL_ACTOR_RESIDENT": "0", "VERL_ACTOR_WEIGHT_SYNC": "1",
           "VERL_ACTOR_ROLLOUT": rollout, "VERL_ACTOR_DOCK": "tight roomy", **extra}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:  # the tiny model's tight budget leaves 0.3 MB beside the KV cache: verl's 128 KiB cuBLAS workspace
        env["VERL_ACTOR_CUBLAS_WORKSPACE"] = ":16:8"  # fits it, the bench's 32 MiB (:4096:8) does not
    for k in ("TORCHFERRY_LAYERWISE_RELOAD", "TORCHFERRY_OPTIMIZER_AT_STEP", "TORCHFERRY_SKIP_UNCHANGED", DOCK_ENV):
        env.pop(k, None)
    p = subprocess.run(["bash", "benchmarks/verl_actor.sh", str(out), nproc, preset, "4"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    return {kind: json.loads(next(out.glob(f"verl_step_*_dock-{kind}.json")).read_text())
            for kind in ("tight", "roomy")}


def check_dock_run(result: dict, kind: str, gpu: bool) -> None:
    """What a dock run must show: bit-identical to verl; tight: per step after the second, the parameters
    leave once, when the rollout's KV cache wakes (the fewest bytes: the optimizer state is twice theirs),
    and come back once, for old_log_prob, the optimizer state never moves; roomy: nothing moves after the
    first step; on a GPU, the peak within the budget."""
    assert result["bit_identical_to_verl"]["torchferry+dock"] is True, result["bit_identical_detail"]
    s = result["strategies"]["torchferry+dock"]
    assert result["config"]["budget"] == kind and s["budget_bytes"] == result["config"]["budget_bytes"]
    steps = s["dock_steps"]
    assert len(steps) == 4
    p_bytes = result["runs"]["torchferry+dock"]["state_bytes"]["params"]
    for st in steps[2:]:  # the schedule is learnt over the first two
        sets = [m for m in st["moves"] if m["kind"] in ("load", "evict")]
        if kind == "roomy":
            assert sets == [], st["moves"]
            continue
        assert [(m["kind"], m["name"].split(".")[1]) for m in sets] == [("evict", "params"), ("load", "params")]
        evict, load = sets
        assert 0 <= evict["at_s"] <= st["marks_s"]["rollout"]  # the KV cache's wake, before it is allocated
        assert st["marks_s"]["rollout"] <= load["at_s"] <= st["marks_s"]["log_prob"]
        assert st["bytes_loaded"] == st["bytes_evicted"] and 0 < st["bytes_evicted"] <= p_bytes * 1.01
    if gpu:
        assert s["within_budget"] is True and 0 < s["peak_gpu_bytes"] <= s["budget_bytes"], s["peak_gpu_bytes"]


def test_verls_actor_under_the_dock(tmp_path):
    results = run_dock_bench(tmp_path, "2", "tiny", "0.001 2", cpu=True)
    for kind, result in results.items():
        check_dock_run(result, kind, gpu=False)
    assert results["tight"]["config"]["budget_bytes"] < results["roomy"]["config"]["budget_bytes"]
    png = tmp_path / "timeline.png"  # the docs' timeline, from the per-budget results
    files = sorted(str(p) for p in tmp_path.glob("verl_step_*_dock-*.json"))
    subprocess.run([sys.executable, "benchmarks/verl_actor.py", "timeline", *files, "--out", str(png)], cwd=ROOT,
                   check=True, capture_output=True)
    assert png.stat().st_size > 10_000


def test_verls_lora_actor_under_the_dock(tmp_path):
    """LoRA under the dock: the tight budget counts the adapters' gradients and optimizer state only
    (``lora_trainable``), so it is still too small for everything and the parameters leave for the rollout and
    come back for old_log_prob as with full fine-tuning (before, sized for AdamW over every parameter, it held
    everything and nothing moved); bit-identical to verl, the weight sync (the adapters) included."""
    results = run_dock_bench(tmp_path, "2", "tiny", "0.001 2", cpu=True, VERL_ACTOR_LORA_RANK="4")
    for kind, result in results.items():
        assert result["config"]["lora"] is True
        check_dock_run(result, kind, gpu=False)


def test_a_phase_that_cannot_fit_is_refused_before_verls_code_runs():
    import torch

    class Engine:  # what VerlDock reads of verl's FSDPEngine: its module and optimizer
        module = torch.nn.Linear(64, 64)
        optimizer = None

    engine = Engine()
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    vd = _dock.VerlDock(1000)
    with pytest.raises(ValueError, match=r"the eval phase of engine0 does not fit its budget .*'engine0.params'") as e:
        vd.enter(engine, "eval", model=True, optimizer=False)
    assert "\n" not in str(e.value) and vd.dock is not None and not vd.dock.in_use
    assert all(torch.equal(v, engine.module.state_dict()[k]) for k, v in before.items())
    vd.leave(engine, "eval")  # verl's __exit__ after a refused __enter__ does not run; a stray one is a no-op


def _engine():
    """What the patched context reads of verl's FSDPEngine, on the CPU: its module, optimizer and offload flags."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    e = object.__new__(FSDPEngine)
    e.module = torch.nn.Linear(64, 64)
    e.optimizer = torch.optim.AdamW(e.module.parameters())
    e._is_offload_param = e._is_offload_optimizer = True
    e.mode = None
    e.engine_config = types.SimpleNamespace(forward_only=False)
    return e


def _train_step(e):
    e.module(torch.ones(2, 64)).sum().backward()
    e.optimizer.step()


def test_a_first_step_whose_optimizer_state_cannot_fit_is_refused_before_it_runs():
    tf_verl.patch(dock=2**21)  # the parameters fit, AdamW's two moments beside them do not
    e = _engine()
    e.module = torch.nn.Linear(512, 512)
    e.optimizer = torch.optim.AdamW(e.module.parameters())
    before = {k: v.clone() for k, v in e.module.state_dict().items()}
    with pytest.raises(ValueError, match=r"engine0.optimizer would hold about 2101256 bytes after the first step "
                                         r"\(AdamW's state as its first step makes it\)"):
        with base.BaseEngineCtx(e, "train"):
            _train_step(e)
    assert all(torch.equal(v, e.module.state_dict()[k]) for k, v in before.items())  # verl's step never ran
    assert not tf_verl.docked().dock.in_use and e.mode is None


def test_nested_contexts_of_a_mode_release_everything_at_the_outer_exit():
    tf_verl.patch(dock=10**8)
    e = _engine()
    with base.BaseEngineCtx(e, "eval"):
        with base.BaseEngineCtx(e, "eval"):
            pass
        assert tf_verl.docked().dock.in_use
    assert not tf_verl.docked().dock.in_use


def test_engine_names_are_not_reused_and_a_collected_engines_sets_leave():
    tf_verl.patch(dock=10**8)
    vd = tf_verl.docked()
    e0, e1 = _engine(), _engine()
    for e in (e0, e1):
        with base.BaseEngineCtx(e, "eval"):
            pass
    del e0
    gc.collect()
    e2 = _engine()
    with base.BaseEngineCtx(e2, "eval"):
        pass
    assert vd.engines[e2].params == "engine2.params" and vd.engines[e1].params == "engine1.params"
    assert vd.dock.ferry("engine2.params") is not vd.dock.ferry("engine1.params")
    with pytest.raises(ValueError):
        vd.dock.ferry("engine0.params")  # gone with its engine


def test_unpatch_inside_a_phase_leaves_nothing_in_use():
    tf_verl.patch(dock=10**8)
    vd, e = tf_verl.docked(), _engine()
    ctx = base.BaseEngineCtx(e, "eval")
    ctx.__enter__()
    tf_verl.unpatch()
    assert not vd.dock.in_use


def test_patching_another_budget_takes_that_budgets_dock_and_zero_switches_it_off():
    tf_verl.patch(dock=0.5)
    half = tf_verl.docked()
    tf_verl.patch(dock=0.7)
    assert tf_verl.docked() is not half and tf_verl.docked().budget == 0.7
    assert compat.patch_choices("verl")[DOCK_ENV] == "0.7"
    tf_verl.unpatch()
    tf_verl.patch(dock=0.5)
    assert tf_verl.docked() is half and half.budget == 0.5
    tf_verl.patch(dock=2**21)
    tf_verl.patch(dock=1.0)
    assert tf_verl.docked().budget == 1.0 and isinstance(tf_verl.docked().budget, float)
    tf_verl.patch(dock=0)
    assert tf_verl.docked() is None and compat.patch_choices("verl")[DOCK_ENV] == "0"
    assert base.BaseEngineCtx.__dict__["__enter__"] is _originals()[0]


def test_dock_rollout_refuses_a_synchronous_rollout_and_a_str_of_tags():
    class Sync:
        def resume(self, tags):
            return tags

        def release(self):
            return None

    with pytest.raises(TypeError, match="must be async"):
        tf_verl.dock_rollout(Sync(), 1, 1)

    class Rollout:
        async def resume(self, tags):
            return tags

        async def release(self):
            return None

    r = tf_verl.dock_rollout(Rollout(), 1, 1)
    with pytest.raises(TypeError, match="tags is a list of str"):
        asyncio.run(r.resume("weights"))
    tf_verl.dock_rollout(r, 5, 7)  # again: the new byte counts
    assert r._torchferry_dock_bytes == {"weights": 5, "kv_cache": 7}


def _evicted_by_the_dock():
    """Two engines under a 1 MiB dock: the second's first eval phase takes the rest of the budget, so
    the dock evicts the first's parameters (its set engine0.params)."""
    tf_verl.patch(dock=2**20)
    vd, e1, e2 = tf_verl.docked(), _engine(), _engine()
    with base.BaseEngineCtx(e1, "eval"):
        pass
    before = {k: v.clone() for k, v in e1.module.state_dict().items()}
    with base.BaseEngineCtx(e2, "eval"):
        pass
    ferry = vd.dock.ferry("engine0.params")
    assert not vd.dock.is_resident("engine0.params") and ferry.residency.on_host
    return vd, (e1, e2), ferry, before  # e2 kept alive: a collected engine's sets leave the dock


def test_unpatch_brings_back_what_the_dock_evicted(monkeypatch):
    """[Note: unpatch() brings the state back]: a set the dock evicted is in torchferry's pool, which verl's
    own helpers cannot reload; unpatch() brings it back, and keeps it in the dock for a later patch(dock=...)
    of the budget."""
    from verl.utils import fsdp_utils

    monkeypatch.setattr(fsdp_utils, "get_device_id", lambda: "cpu")  # verl's own load, on the CPU
    vd, (e1, _), ferry, before = _evicted_by_the_dock()
    tf_verl.unpatch()
    assert not tf_verl.is_patched() and _dock.docked() is None
    assert base.BaseEngineCtx.__dict__["__enter__"].__module__ == "verl.workers.engine.base"  # verl's own
    assert ferry.residency is Residency.DEVICE and vd.dock.is_resident("engine0.params")
    after = e1.module.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(v, after[k]) for k, v in before.items())
    assert all(p.device == torch.device("cpu") for p in e1.module.parameters())
    fsdp_utils.offload_fsdp_model_to_cpu(e1.module)  # verl's own helpers round-trip it
    fsdp_utils.load_fsdp_model_to_gpu(e1.module)
    e1.module(torch.ones(2, 64))
    assert all(torch.equal(v, e1.module.state_dict()[k]) for k, v in before.items())
    tf_verl.patch(dock=2**20)  # the same budget: the same dock, the set where unpatch() left it
    assert tf_verl.docked() is vd and vd.dock.ferry("engine0.params") is ferry


def test_unpatch_that_cannot_bring_back_an_evicted_set_raises_and_stays_docked(monkeypatch):
    vd, (e1, _), ferry, before = _evicted_by_the_dock()
    enter = base.BaseEngineCtx.__dict__["__enter__"]

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(ferry, "reload", out_of_memory)
    with pytest.raises(RuntimeError, match=r"could not bring verl dock set engine0.params \(model Linear \(\d+ bytes\)\) "
                                           r"back to cpu \(RuntimeError: CUDA out of memory.*nothing was unpatched"):
        tf_verl.unpatch()
    assert tf_verl.is_patched() and tf_verl.docked() is vd and base.BaseEngineCtx.__dict__["__enter__"] is enter
    assert ferry.residency.on_host and not vd.dock.is_resident("engine0.params")
    monkeypatch.undo()
    with base.BaseEngineCtx(e1, "eval"):  # the dock still brings it in
        after = e1.module.state_dict()
        assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_an_engine_collected_while_the_dock_learns_the_step_leaves_the_order_learnt_again():
    """Phases recorded with an engine's sets, then that engine collected before the step's order was
    planned: the order learnt so far named sets no longer in the dock; it is learnt again without
    them, and the next phases plan and run."""
    tf_verl.patch(dock=10**8)
    vd, e1, e2 = tf_verl.docked(), _engine(), _engine()
    with base.BaseEngineCtx(e1, "eval"):
        pass
    with base.BaseEngineCtx(e2, "eval"):
        pass
    assert not vd.planned and len(vd.cycle) == 2
    del e2
    gc.collect()
    for _ in range(3):  # eval, train, eval, ...: a cycle closes and is planned
        with base.BaseEngineCtx(e1, "eval"):
            pass
        with base.BaseEngineCtx(e1, "train"):
            _train_step(e1)
    assert vd.planned and all("engine1" not in n for phase in vd.cycle for n in phase)
