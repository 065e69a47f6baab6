"""[Note: optimizer state waited for at step()] in ``docs/integrations.md``: with
``optimizer_at_step`` on, ``load_fsdp_optimizer`` leaves the state's copies to ``optimizer.step()``
(the state stays host tensors until then), the steps are bit-identical to a run that never
offloaded; off by default; the setting from ``patch()`` of the verl and SkyRL integrations, else
``TORCHFERRY_OPTIMIZER_AT_STEP``, bad values refused before anything moves or is replaced."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchferry import Residency
from torchferry.integrations import _base as _helpers
from torchferry.integrations._base import REGISTRY, PatchState, SeedHelpers, Settings


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv(_helpers.OPTIMIZER_AT_STEP_ENV, raising=False)
    yield


def _model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt


def _step(m, opt, x) -> None:
    m(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("at_step", [False, True])
def test_the_state_waits_for_step_only_when_switched_on_and_the_steps_stay_bit_identical(at_step, monkeypatch):
    m, opt = _model_and_opt()
    ref_m, ref_opt = copy.deepcopy(m), None
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    _step(m, opt, xs[0])
    _step(ref_m, ref_opt, xs[0])
    monkeypatch.setenv(_helpers.OPTIMIZER_AT_STEP_ENV, "1" if at_step else "0")
    for x in xs[1:]:
        _helpers.offload_fsdp2_model_to_cpu(m)
        _helpers.offload_fsdp_optimizer(opt)
        _helpers.load_fsdp2_model_to_gpu(m)
        _helpers.load_fsdp_optimizer(opt, "cpu")
        ferry = _helpers.ferry_for(opt)
        assert ferry is not None
        assert ferry.residency is (Residency.PREFETCHING if at_step else Residency.DEVICE)
        m(x).square().mean().backward()  # forward and backward before the state is back
        assert ferry.residency is (Residency.PREFETCHING if at_step else Residency.DEVICE)
        opt.step()  # the step pre-hook brings it back first
        opt.zero_grad(set_to_none=True)
        assert ferry.residency is Residency.DEVICE
        _step(ref_m, ref_opt, x)
        for p, q in zip(m.parameters(), ref_m.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=0, rtol=0)
        for a, b in zip(opt.state.values(), ref_opt.state.values(), strict=True):
            for k in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


def test_a_state_dict_before_the_step_completes_the_reload(monkeypatch):
    m, opt = _model_and_opt()
    _step(m, opt, torch.randn(4, 32))
    want = copy.deepcopy(opt.state_dict())
    monkeypatch.setenv(_helpers.OPTIMIZER_AT_STEP_ENV, "1")
    _helpers.offload_fsdp_optimizer(opt)
    _helpers.load_fsdp_optimizer(opt, "cpu")
    got = opt.state_dict()  # waits for the state ([Note: prefetch reload])
    assert _helpers.ferry_for(opt).residency is Residency.DEVICE
    for k, st in want["state"].items():
        for name, t in st.items():
            torch.testing.assert_close(got["state"][k][name], t, atol=0, rtol=0)


def test_a_checkpoint_loaded_before_the_step_completes_the_reload_and_is_what_the_step_reads(monkeypatch):
    """verl's load_checkpoint calls load_fsdp_optimizer, then optimizer.load_state_dict(): the
    reload completes first, and the loaded state is the one the step uses."""
    m, opt = _model_and_opt()
    _step(m, opt, torch.randn(4, 32))
    saved = copy.deepcopy(opt.state_dict())
    ref_m = copy.deepcopy(m)
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(saved))  # its own tensors: load_state_dict keeps the ones it is given
    _step(m, opt, torch.randn(4, 32))  # the state moves on; the checkpoint brings it back
    monkeypatch.setenv(_helpers.OPTIMIZER_AT_STEP_ENV, "1")
    _helpers.offload_fsdp_optimizer(opt)
    _helpers.load_fsdp_optimizer(opt, "cpu")
    assert _helpers.ferry_for(opt).residency is Residency.PREFETCHING
    m.load_state_dict(ref_m.state_dict())
    opt.load_state_dict(saved)
    assert _helpers.ferry_for(opt).residency is Residency.DEVICE
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
    _step(m, opt, x)
    _step(ref_m, ref_opt, x)
    for p, q in zip(m.parameters(), ref_m.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_the_setting_comes_from_the_environment_and_a_bad_value_moves_nothing(monkeypatch):
    assert not _helpers.read_switch("optimizer_at_step")  # off by default
    monkeypatch.setenv(_helpers.OPTIMIZER_AT_STEP_ENV, "1")
    assert _helpers.read_switch("optimizer_at_step")
    chosen = SeedHelpers(REGISTRY, "verl", Settings.read({"optimizer_at_step": False}))
    assert not chosen.switch("optimizer_at_step")  # the integration's setting over the environment
    monkeypatch.setenv(_helpers.OPTIMIZER_AT_STEP_ENV, "1")
    m, opt = _model_and_opt()
    _step(m, opt, torch.randn(4, 32))
    _helpers.offload_fsdp_optimizer(opt)
    monkeypatch.setenv(_helpers.OPTIMIZER_AT_STEP_ENV, "maybe")
    with pytest.raises(ValueError, match="TORCHFERRY_OPTIMIZER_AT_STEP must be on .* got 'maybe'"):
        _helpers.load_fsdp_optimizer(opt, "cpu")
    assert _helpers.ferry_for(opt).residency is Residency.HOST  # nothing moved
    monkeypatch.setenv(_helpers.OPTIMIZER_AT_STEP_ENV, "0")
    _helpers.load_fsdp_optimizer(opt, "cpu")
    assert _helpers.ferry_for(opt).residency is Residency.DEVICE
    with pytest.raises(TypeError, match="optimizer_at_step must be True, False or None, got int 1"):
        Settings.read({"optimizer_at_step": 1})  # type: ignore[dict-item]


def _verls(name: str) -> bool:
    """A setting as verl's replacements read it ([Note: each integration's settings])."""
    return _helpers.settings_of("verl")[name]


def test_verl_and_skyrl_patched_in_one_process_keep_their_own_settings(monkeypatch):
    """[Note: each integration's settings]: verl's defaults do not reach SkyRL's helpers, each
    integration's choices stay its own, one's unpatch() leaves the other's, each Ray hook forwards
    its own, and a replacement reads its integration's settings while it runs."""
    pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")
    import torchferry.integrations.verl as tf_verl
    from verl.utils import fsdp_utils

    for env in (_helpers.LAYERWISE_ENV, _helpers.SKIP_ENV):
        monkeypatch.delenv(env, raising=False)
    tf_verl.unpatch()
    try:
        tf_verl.patch(import_engines=False, skip_unchanged=False, fsdp1=False)
        REGISTRY.patched["skyrl"] = PatchState(name="skyrl", settings=Settings.read(  # as SkyRL's patch(layerwise_reload=True)
            {"skip_unchanged": None, "optimizer_at_step": None, "layerwise_reload": True}))
        assert _helpers.settings_of("verl") == {"skip_unchanged": False, "optimizer_at_step": True,
                                                "layerwise_reload": True}
        assert _helpers.settings_of("skyrl") == {"skip_unchanged": True, "optimizer_at_step": False,
                                                 "layerwise_reload": True}
        assert not _helpers.read_switch("optimizer_at_step") and _helpers.read_switch("skip_unchanged")  # outside both
        m, opt = _model_and_opt()
        _step(m, opt, torch.randn(4, 32))
        for load, at_step in ((fsdp_utils.load_fsdp_optimizer, True), (_helpers.load_fsdp_optimizer, False)):
            _helpers.offload_fsdp_optimizer(opt)
            load(opt, "cpu")  # verl's replacement: verl's default; the helper called directly: off
            assert _helpers.ferry_for(opt).residency is (Residency.PREFETCHING if at_step else Residency.DEVICE)
            _step(m, opt, torch.randn(4, 32))
        env = tf_verl.with_worker_setup({})["env_vars"]
        assert env[_helpers.SKIP_ENV] == "0" and env["TORCHFERRY_VERL_FSDP1"] == "0"
        assert _helpers.LAYERWISE_ENV not in env
        assert _helpers.patch_choices("skyrl") == {_helpers.LAYERWISE_ENV: "1"}  # not verl's fsdp1 either
        tf_verl.unpatch()
        assert _helpers.settings_of("skyrl")["layerwise_reload"] and not _verls("layerwise_reload")
        assert _verls("skip_unchanged")
    finally:
        tf_verl.unpatch()
        REGISTRY.patched.pop("skyrl", None)


def test_verl_patch_sets_it_refuses_bad_values_and_unpatch_resets_it(monkeypatch):
    pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")
    import torchferry.integrations.verl as tf_verl

    tf_verl.unpatch()
    try:
        with pytest.raises(TypeError, match="optimizer_at_step must be True, False or None, got str 'on'"):
            tf_verl.patch(import_engines=False, optimizer_at_step="on")  # type: ignore[arg-type]
        assert not tf_verl.is_patched()
        monkeypatch.setenv(_helpers.OPTIMIZER_AT_STEP_ENV, "2")
        with pytest.raises(ValueError, match="TORCHFERRY_OPTIMIZER_AT_STEP must be on .* got '2'"):
            tf_verl.patch(import_engines=False)
        assert not tf_verl.is_patched()
        monkeypatch.delenv(_helpers.OPTIMIZER_AT_STEP_ENV)
        tf_verl.patch(import_engines=False, optimizer_at_step=True)
        assert _verls("optimizer_at_step")
        tf_verl.patch(import_engines=False)  # idempotent: the choice stays
        assert _verls("optimizer_at_step")
        tf_verl.unpatch()
        assert not _verls("optimizer_at_step")
    finally:
        tf_verl.unpatch()


@pytest.mark.parametrize("name, env", [("optimizer_at_step", _helpers.OPTIMIZER_AT_STEP_ENV),
                                       ("layerwise_reload", _helpers.LAYERWISE_ENV)])
def test_verls_patch_turns_each_on_by_default_and_one_switch_turns_it_off(monkeypatch, name, env):
    """[Note: verl's defaults]: on under verl's ``patch()`` where neither its argument nor the
    environment says; ``patch(<name>=False)`` or ``<env>=0`` turns it off; ``unpatch()`` (and the
    SkyRL integration, which has no such default) leaves torchferry's own default, off."""
    pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")
    import torchferry.integrations.verl as tf_verl

    def get() -> bool:
        return _verls(name)

    monkeypatch.delenv(env, raising=False)
    tf_verl.unpatch()
    try:
        assert not get()  # torchferry's own default
        tf_verl.patch(import_engines=False)
        assert get()  # verl's
        tf_verl.unpatch()
        assert not get()
        tf_verl.patch(import_engines=False, **{name: False})
        assert not get()
        tf_verl.unpatch()
        monkeypatch.setenv(env, "0")
        tf_verl.patch(import_engines=False)
        assert not get()
        tf_verl.unpatch()
        monkeypatch.setenv(env, "1")
        assert get()
    finally:
        tf_verl.unpatch()


def test_the_ray_hook_passes_a_drivers_patch_arguments_on(monkeypatch):
    """A driver's ``patch(layerwise_reload=False, ...)`` reaches the workers as the environment
    variables they read, over the driver's own environment; a runtime_env's own env_vars win."""
    pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")
    import torchferry.integrations.verl as tf_verl

    monkeypatch.setenv(_helpers.LAYERWISE_ENV, "1")
    tf_verl.unpatch()
    try:
        tf_verl.patch(import_engines=False, layerwise_reload=False, optimizer_at_step=False, fsdp1=False)
        env = tf_verl.with_worker_setup({})["env_vars"]
        assert env[_helpers.LAYERWISE_ENV] == "0" and env[_helpers.OPTIMIZER_AT_STEP_ENV] == "0"
        assert env["TORCHFERRY_VERL_FSDP1"] == "0" and _helpers.SKIP_ENV not in env
        env = tf_verl.with_worker_setup({"env_vars": {_helpers.LAYERWISE_ENV: "1"}})["env_vars"]
        assert env[_helpers.LAYERWISE_ENV] == "1"
        tf_verl.unpatch()
        assert tf_verl.with_worker_setup({})["env_vars"][_helpers.LAYERWISE_ENV] == "1"  # the environment's
        assert "TORCHFERRY_VERL_FSDP1" not in tf_verl.with_worker_setup({})["env_vars"]
    finally:
        tf_verl.unpatch()


def test_the_ray_hooks_pass_the_settings_on():
    from torchferry.integrations._base import FORWARDED_SETTINGS

    assert _helpers.OPTIMIZER_AT_STEP_ENV in FORWARDED_SETTINGS and _helpers.LAYERWISE_ENV in FORWARDED_SETTINGS


def test_the_layerwise_setting_comes_from_patch_else_the_environment(monkeypatch):
    """[Note: the helpers' layer-wise reload]: off by default (verl's ``patch()`` aside),
    ``TORCHFERRY_LAYERWISE_RELOAD`` or ``patch(layerwise_reload=...)``, bad values refused with
    nothing replaced, reset by unpatch()."""
    pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")
    import torchferry.integrations.verl as tf_verl

    monkeypatch.delenv(_helpers.LAYERWISE_ENV, raising=False)
    tf_verl.unpatch()
    try:
        assert not _verls("layerwise_reload")
        monkeypatch.setenv(_helpers.LAYERWISE_ENV, "1")
        assert _verls("layerwise_reload")
        monkeypatch.setenv(_helpers.LAYERWISE_ENV, "sometimes")
        with pytest.raises(ValueError, match="TORCHFERRY_LAYERWISE_RELOAD must be on .* got 'sometimes'"):
            tf_verl.patch(import_engines=False)
        assert not tf_verl.is_patched()
        monkeypatch.delenv(_helpers.LAYERWISE_ENV)
        with pytest.raises(TypeError, match="layerwise_reload must be True, False or None, got int 1"):
            tf_verl.patch(import_engines=False, layerwise_reload=1)  # type: ignore[arg-type]
        assert not tf_verl.is_patched()
        tf_verl.patch(import_engines=False, layerwise_reload=True)
        assert _verls("layerwise_reload")
        tf_verl.unpatch()
        assert not _verls("layerwise_reload")
    finally:
        tf_verl.unpatch()


def test_the_layerwise_reload_of_a_module_without_fsdp_units_is_whole(monkeypatch):
    """Without FSDP2 units there is nothing to bring back unit by unit: the reload is whole."""
    m, opt = _model_and_opt()
    _step(m, opt, torch.randn(4, 32))
    monkeypatch.setenv(_helpers.LAYERWISE_ENV, "1")
    want = [p.detach().clone() for p in m.parameters()]
    _helpers.offload_fsdp2_model_to_cpu(m)
    _helpers.load_fsdp2_model_to_gpu(m)
    assert _helpers.ferry_for(m).residency is Residency.DEVICE
    for p, w in zip(m.parameters(), want, strict=True):
        torch.testing.assert_close(p, w, atol=0, rtol=0)
