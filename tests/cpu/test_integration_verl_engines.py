"""verl's VeOmni and Automodel engine helpers through ``torchferry.integrations.verl.patch()``
([Note: the VeOmni and Automodel helpers] in ``docs/integrations.md``), against
verl 0.9.1's own ``verl/workers/engine/{veomni,automodel}/utils.py`` on the CPU.

Neither engine's framework (``veomni``, ``nemo_automodel``) is installed here, and each engine's
package imports it: the tests load verl's real ``utils.py`` files under their own module names
beneath a stand-in for the package (whose ``__init__`` would import the framework), plus a
stand-in ``transformer_impl`` that binds the helpers by name as verl's does."""

import functools
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl.workers.engine", reason="verl not installed")

import torchferry.integrations.verl as tf_verl  # noqa: E402
from tests.helpers import Mixed, assert_same, cpu_mesh, identities, snapshot, three_units, train_step  # noqa: E402
from tests.spawn import run_spawned  # noqa: E402
from torchferry.integrations.verl import ferry_for  # noqa: E402

ENGINES = ("veomni", "automodel")
IDS = torch.tensor([[1, 2, 3]])


def _helpers(engine):
    return (f"offload_{engine}_model_to_cpu", f"load_{engine}_model_to_gpu", f"offload_{engine}_optimizer",
            f"load_{engine}_optimizer")


def _load_engines() -> dict[str, types.ModuleType]:
    """verl's real helper modules of both engines, importable without their frameworks."""
    import verl.workers.engine as engine_pkg

    out = {}
    for engine in ENGINES:
        pkg_name = f"verl.workers.engine.{engine}"
        if f"{pkg_name}.utils" not in sys.modules:
            pkg = types.ModuleType(pkg_name)
            pkg.__path__ = [str(Path(engine_pkg.__file__).parent / engine)]
            sys.modules[pkg_name] = pkg
            __import__(f"{pkg_name}.utils")
            impl = types.ModuleType(f"{pkg_name}.transformer_impl")  # binds the helpers by name
            for name in _helpers(engine):
                setattr(impl, name, getattr(sys.modules[f"{pkg_name}.utils"], name))
            sys.modules[impl.__name__] = impl
        out[engine] = sys.modules[f"{pkg_name}.utils"]
    return out


def _drop_engines() -> None:
    for engine in ENGINES:
        for suffix in ("", ".utils", ".transformer_impl"):
            sys.modules.pop(f"verl.workers.engine.{engine}{suffix}", None)


@pytest.fixture
def engines():
    mods = _load_engines()
    yield mods
    tf_verl.unpatch()
    _drop_engines()


def test_patch_replaces_both_engines_helpers_and_unpatch_restores_them(engines):
    originals = {e: {n: getattr(m, n) for n in _helpers(e)} for e, m in engines.items()}
    names = tf_verl.patch(import_engines=False)
    for engine, mod in engines.items():
        impl = sys.modules[f"verl.workers.engine.{engine}.transformer_impl"]
        for name in _helpers(engine):
            assert f"verl.workers.engine.{engine}.utils.{name}" in names
            assert f"verl.workers.engine.{engine}.transformer_impl.{name}" in names
            assert getattr(mod, name) is not originals[engine][name]
            assert getattr(impl, name) is getattr(mod, name)
            assert getattr(mod, name).__torchferry_original__ is originals[engine][name]
    assert tf_verl.patch(import_engines=False) == names  # idempotent
    tf_verl.unpatch()
    for engine, mod in engines.items():
        impl = sys.modules[f"verl.workers.engine.{engine}.transformer_impl"]
        for name in _helpers(engine):
            assert getattr(mod, name) is originals[engine][name]
            assert getattr(impl, name) is originals[engine][name]


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_helpers_round_trip_a_module_and_a_multi_optimizer_bit_exact(engines, engine):
    mod = engines[engine]
    tf_verl.patch(import_engines=False)
    torch.manual_seed(0)
    m, extra = Mixed(), torch.nn.Parameter(torch.randn(4, 3))
    opt_a = torch.optim.AdamW(m.parameters())
    opt_b = torch.optim.SGD([extra], lr=0.1, momentum=0.9)
    m(IDS).backward()
    extra.grad = torch.ones_like(extra)
    opt_a.step()
    opt_b.step()
    multi = types.SimpleNamespace(_is_multi_optimizer=True, optimizers_dict={"dense": opt_a, "experts": opt_b})
    before, ids = snapshot(m, opt_a), identities(m, opt_a)
    before_b = {k: v.clone() for k, v in opt_b.state[extra].items()}
    getattr(mod, f"offload_{engine}_model_to_cpu")(m, empty_cache=False)
    getattr(mod, f"offload_{engine}_optimizer")(multi if engine == "veomni" else opt_a)
    if engine == "automodel":  # Automodel's helpers take one optimizer
        getattr(mod, f"offload_{engine}_optimizer")(opt_b)
    assert ferry_for(m).residency.on_host and ferry_for(opt_a).residency.on_host
    assert ferry_for(opt_b).residency.on_host
    getattr(mod, f"load_{engine}_model_to_gpu")(m)
    getattr(mod, f"load_{engine}_optimizer")(multi if engine == "veomni" else opt_a, "cpu")
    if engine == "automodel":
        getattr(mod, f"load_{engine}_optimizer")(opt_b, "cpu")
    assert not ferry_for(m).residency.on_host and not ferry_for(opt_b).residency.on_host
    assert_same(before, snapshot(m, opt_a))
    assert identities(m, opt_a) == ids
    assert all(torch.equal(v, before_b[k]) for k, v in opt_b.state[extra].items())


def test_a_model_no_ferry_offloaded_is_loaded_by_verls_own_helper(engines):
    mod = engines["veomni"]
    calls = []

    def load_veomni_model_to_gpu(model):  # verl's signature; stands in for model.to(device)
        calls.append(model)

    mod.load_veomni_model_to_gpu = load_veomni_model_to_gpu
    tf_verl.patch(import_engines=False)
    m = Mixed()
    mod.load_veomni_model_to_gpu(m)  # built on the host, never offloaded through a ferry
    assert calls == [m] and ferry_for(m) is None


def test_a_changed_engine_helper_refuses_the_whole_patch(engines):
    mod = engines["automodel"]

    def offload_automodel_optimizer(optimizer, empty_cache):  # another signature than verl 0.9.1's
        pass

    mod.offload_automodel_optimizer = offload_automodel_optimizer
    import verl.utils.fsdp_utils as fsdp_utils

    original = fsdp_utils.offload_fsdp_model_to_cpu
    with pytest.raises(RuntimeError, match=r"offload_automodel_optimizer\('optimizer', 'empty_cache'\) does not "
                                           r"have the parameters \('optimizer',\)"):
        tf_verl.patch(import_engines=False)
    assert not tf_verl.is_patched() and fsdp_utils.offload_fsdp_model_to_cpu is original
    assert engines["veomni"].offload_veomni_model_to_cpu.__module__ == "verl.workers.engine.veomni.utils"


def test_engines_not_importable_are_skipped():
    _drop_engines()
    names = tf_verl.patch(import_engines=False)
    try:
        assert names and not any(".veomni." in n or ".automodel." in n for n in names)
    finally:
        tf_verl.unpatch()


def _fsdp2_round_trip(rank, world, engine):
    mod = _load_engines()[engine]
    tf_verl.patch(import_engines=False)
    m, opt = three_units(cpu_mesh(world), opt="adamw")
    ref, ref_opt = three_units(cpu_mesh(world), opt="adamw")
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, 16, generator=g)
        train_step(m, opt, x, set_to_none=True)
        train_step(ref, ref_opt, x, set_to_none=True)
        m(x)  # a forward-only phase after the step, as old_log_prob
        getattr(mod, f"offload_{engine}_model_to_cpu")(m, empty_cache=False)
        getattr(mod, f"offload_{engine}_optimizer")(opt)
        assert ferry_for(m).residency.on_host and ferry_for(opt).residency.on_host
        getattr(mod, f"load_{engine}_model_to_gpu")(m)
        getattr(mod, f"load_{engine}_optimizer")(opt, "cpu")
    a, b = snapshot(ref, ref_opt), snapshot(m, opt)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tf_verl.unpatch()


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_helpers_round_trip_fsdp2_over_gloo_bit_exact(engine):
    run_spawned(functools.partial(_fsdp2_round_trip, engine=engine))
