"""torchferry.integrations.skyrl (patch()/unpatch(), SkyRL's seed quirks) against the real SkyRL 0.4.0 package
(CPU; FSDP2 over gloo on 2 ranks).

SkyRL installs without its dependencies (``pip install --no-deps --ignore-requires-python skyrl==0.4.0``) plus
what importing its ``fsdp_utils`` needs (``skyrl-gym``, ``loguru``); on Python 3.11 ``skyrl_import.apply``
skips the Tinker backend's package ``__init__`` (see there). Skipped, with the reason, where SkyRL's
``fsdp_utils`` does not import."""

import ast
import functools
import copy
import importlib.util
import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.cpu.skyrl_import import FSDP_STRATEGY, FSDP_UTILS, import_fsdp_utils

fsdp_utils = import_fsdp_utils()

import torchferry.integrations.skyrl as tf_skyrl  # noqa: E402
import torchferry.integrations.verl as tf_verl  # noqa: E402
from torchferry.integrations import _base as _helpers  # noqa: E402
from tests.helpers import IDS, Mixed, build_uneven, cpu_mesh, identities, snapshot, train_step, trained  # noqa: E402
from tests.spawn import run_spawned  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ("offload_fsdp2_model_to_cpu", "load_fsdp2_model_to_gpu", "offload_fsdp_optimizer", "load_fsdp_optimizer")


@pytest.fixture(autouse=True)
def _unpatched():
    yield
    tf_skyrl.unpatch()


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _bound_like_fsdp_strategy(name: str) -> types.ModuleType:
    """A stand-in SkyRL module that runs the real ``from ...fsdp_utils import (...)`` statement of the installed
    ``fsdp_strategy.py`` (which itself needs flash_attn; see test_fsdp_strategy_offloads_through_torchferry)."""
    spec = importlib.util.find_spec("skyrl")
    path = Path(list(spec.submodule_search_locations)[0], "backends/skyrl_train/distributed/fsdp_strategy.py")
    tree = ast.parse(path.read_text())
    [stmt] = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == FSDP_UTILS]
    assert set(HELPERS) <= {a.name for a in stmt.names}  # fsdp_strategy binds all four by name
    module = types.ModuleType(name)
    exec(compile(ast.Module(body=[stmt], type_ignores=[]), str(path), "exec"), module.__dict__)
    sys.modules[name] = module
    return module


# ------------------------------------------------------------------ FSDP2 round trips (2 gloo ranks)
def _round_trip_on_fsdp2(rank, world):
    mesh = cpu_mesh(world)
    names = tf_skyrl.patch()
    assert {f"{FSDP_UTILS}.{h}" for h in HELPERS} <= set(names)
    m, opt = build_uneven(mesh)
    ref, ref_opt = build_uneven(mesh)
    torch.manual_seed(1)
    xs = [torch.randn(4, 16) for _ in range(3)]
    for model, o in ((m, opt), (ref, ref_opt)):
        train_step(model, o, xs[0])
    before, ids = snapshot(m, opt), identities(m, opt)
    for step in (1, 2):
        # SkyRL's FSDPStrategy.offload_to_cpu / backload_to_gpu, through SkyRL's module attributes:
        fsdp_utils.offload_fsdp2_model_to_cpu(m, empty_cache=True)
        fsdp_utils.offload_fsdp_optimizer(opt)
        assert tf_skyrl.ferry_for(m).residency.on_host and tf_skyrl.ferry_for(opt).residency.on_host
        fsdp_utils.load_fsdp2_model_to_gpu(m)
        fsdp_utils.load_fsdp_optimizer(opt, "cpu")  # SkyRL passes torch.cuda.current_device(): the state's device
        if step == 1:
            _assert_equal(before, snapshot(m, opt))
        assert identities(m, opt) == ids  # every parameter, grad and optimizer-state object kept
        train_step(m, opt, xs[step])
        train_step(ref, ref_opt, xs[step])
        _assert_equal(snapshot(ref, ref_opt), snapshot(m, opt))  # training goes on as if never offloaded
    tf_skyrl.unpatch()
    assert not any(hasattr(getattr(fsdp_utils, h), "__torchferry_original__") for h in HELPERS)


def test_patched_helpers_round_trip_fsdp2_state_bit_exact_and_keep_identities():
    run_spawned(_round_trip_on_fsdp2)


def _native_cpu_offload_stays_with_skyrl(rank, world):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = cpu_mesh(world)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(16, 11), nn.ReLU(), nn.Linear(11, 3))
    sd = copy.deepcopy(full.state_dict())
    policy = CPUOffloadPolicy(pin_memory=False)  # SkyRL's fsdp_config.cpu_offload=true (pinned on a GPU)
    for layer in (full[0], full[2]):
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(full, mesh=mesh, offload_policy=policy)
    tf_skyrl.patch()
    # SkyRL's own loader calls the (patched) offload_fsdp2_model_to_cpu global for such a model:
    fsdp_utils.fsdp2_load_full_state_dict(full, sd if rank == 0 else {}, policy)
    assert tf_skyrl.ferry_for(full) is None  # FSDP2 keeps its shards on the host itself: SkyRL's helper ran
    full(torch.randn(2, 16)).sum().backward()  # usable at once (torchferry's would have left it offloaded)
    tf_skyrl.unpatch()


def test_a_model_fsdp2_offloads_itself_stays_with_skyrls_helper():
    """SkyRL's fsdp2_load_full_state_dict offloads a CPUOffloadPolicy model through the module-global helper
    ([Note: what stays with SkyRL's own helpers])."""
    run_spawned(_native_cpu_offload_stays_with_skyrl)


# ------------------------------------------------------------------ patch / unpatch (this process)
def test_patch_is_idempotent_and_unpatch_restores_every_binding():
    originals = {h: getattr(fsdp_utils, h) for h in HELPERS}
    strategy = _bound_like_fsdp_strategy("skyrl._tf_test_strategy")
    try:
        names = tf_skyrl.patch(import_call_sites=False)
        assert {f"{mod}.{h}" for mod in (FSDP_UTILS, strategy.__name__) for h in HELPERS} <= set(names)
        assert tf_skyrl.patch() == names and tf_skyrl.is_patched()  # idempotent
        late = types.ModuleType("skyrl._tf_test_late")  # a SkyRL module imported after patch()
        exec(f"from {FSDP_UTILS} import offload_fsdp2_model_to_cpu, load_fsdp_optimizer", late.__dict__)
        sys.modules[late.__name__] = late
        for h in HELPERS:
            fn = getattr(fsdp_utils, h)
            assert getattr(strategy, h) is fn and fn.__torchferry_original__ is originals[h]
        assert fsdp_utils.offload_fsdp_optimizer.__wrapped__ is _helpers.offload_fsdp_optimizer
        # one set of drop-ins for both frameworks (SkyRL's helpers are verl's under the same names):
        assert all(getattr(tf_skyrl, h) is getattr(tf_verl, h) is getattr(_helpers, h) for h in HELPERS)
        tf_skyrl.unpatch()
        assert not tf_skyrl.is_patched()
        for mod in (fsdp_utils, strategy):
            assert all(getattr(mod, h) is originals[h] for h in HELPERS), mod.__name__
        assert late.offload_fsdp2_model_to_cpu is originals["offload_fsdp2_model_to_cpu"]
        assert late.load_fsdp_optimizer is originals["load_fsdp_optimizer"]
        assert 'model.to("cpu", non_blocking=True)' in inspect.getsource(originals["offload_fsdp2_model_to_cpu"])
        tf_skyrl.unpatch()  # idempotent
        assert all(getattr(fsdp_utils, h) is originals[h] for h in HELPERS)
    finally:
        sys.modules.pop("skyrl._tf_test_strategy", None)
        sys.modules.pop("skyrl._tf_test_late", None)


def test_unpatch_leaves_the_other_integrations_names_alone():
    pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")
    import verl.utils.fsdp_utils as verl_fsdp_utils

    tf_verl.patch(import_engines=False)
    try:
        tf_skyrl.patch(import_call_sites=False)
        tf_skyrl.unpatch()
        assert hasattr(verl_fsdp_utils.offload_fsdp2_model_to_cpu, "__torchferry_original__")
    finally:
        tf_verl.unpatch()


def test_changed_helper_is_refused_and_nothing_patched(monkeypatch):
    def load_fsdp_optimizer(optimizer):  # SkyRL changed the signature
        pass

    monkeypatch.setattr(fsdp_utils, "load_fsdp_optimizer", load_fsdp_optimizer)
    before = {h: getattr(fsdp_utils, h) for h in HELPERS}
    strategy = _bound_like_fsdp_strategy("skyrl._tf_test_strategy2")
    try:
        bound = {h: getattr(strategy, h) for h in HELPERS}
        with pytest.raises(RuntimeError, match=r"^torchferry\.integrations\.skyrl: skyrl\.backends\.skyrl_train\."
                           r"distributed\.fsdp_utils\.load_fsdp_optimizer\('optimizer',\) does not have the "
                           r"parameters \('optimizer', 'device_id'\) this integration was written for; skyrl changed"):
            tf_skyrl.patch()
        assert not tf_skyrl.is_patched()
        assert {h: getattr(fsdp_utils, h) for h in HELPERS} == before
        assert {h: getattr(strategy, h) for h in HELPERS} == bound
    finally:
        sys.modules.pop("skyrl._tf_test_strategy2", None)


def test_missing_helper_is_refused(monkeypatch):
    monkeypatch.delattr(fsdp_utils, "offload_fsdp_optimizer")
    with pytest.raises(RuntimeError, match=r"fsdp_utils\.offload_fsdp_optimizer is missing; skyrl changed"):
        tf_skyrl.patch()
    assert not tf_skyrl.is_patched()


def test_skyrl_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, FSDP_UTILS, None)
    with pytest.raises(RuntimeError, match=r"^torchferry\.integrations\.skyrl: skyrl is not importable"):
        tf_skyrl.patch()


# ------------------------------------------------------------------ SkyRL's seed quirks
def test_meta_buffers_are_materialised_as_skyrls_helper_does():
    torch.manual_seed(0)
    m = Mixed()
    m.register_buffer("inv_freq", torch.empty(4, dtype=torch.float16, device="meta"), persistent=False)
    theirs = copy.deepcopy(m)
    opt = torch.optim.AdamW(m.parameters())
    m(IDS).backward()
    opt.step()
    before = snapshot(m, opt)
    tf_skyrl.patch(import_call_sites=False)
    fsdp_utils.offload_fsdp2_model_to_cpu(m)
    assert tf_skyrl.ferry_for(m).residency.on_host
    fsdp_utils.load_fsdp2_model_to_gpu(m)
    tf_skyrl.unpatch()
    fsdp_utils.offload_fsdp2_model_to_cpu(theirs, empty_cache=False)  # SkyRL's own, for comparison
    for b in (m.inv_freq, theirs.inv_freq):
        assert (b.device.type, b.shape, b.dtype) == ("cpu", torch.Size([4]), torch.float16)
    after = snapshot(m, opt)
    del after["buf.inv_freq"], before["buf.inv_freq"]  # uninitialised (torch.empty), as in SkyRL
    _assert_equal(before, after)


def test_reloading_what_torchferry_never_offloaded_is_skyrls_business(monkeypatch):
    calls = []

    def load_fsdp2_model_to_gpu(model):
        calls.append(("model", model))

    def load_fsdp_optimizer(optimizer, device_id):
        calls.append(("optimizer", optimizer, device_id))

    monkeypatch.setattr(fsdp_utils, "load_fsdp2_model_to_gpu", load_fsdp2_model_to_gpu)  # stand for SkyRL's own
    monkeypatch.setattr(fsdp_utils, "load_fsdp_optimizer", load_fsdp_optimizer)
    m, opt = trained()
    tf_skyrl.patch(import_call_sites=False)
    fsdp_utils.load_fsdp2_model_to_gpu(m)
    fsdp_utils.load_fsdp_optimizer(opt, 0)
    assert calls == [("model", m), ("optimizer", opt, 0)]
    fsdp_utils.offload_fsdp2_model_to_cpu(m)
    fsdp_utils.offload_fsdp_optimizer(opt)
    fsdp_utils.load_fsdp2_model_to_gpu(m)  # torchferry's now: it offloaded them
    fsdp_utils.load_fsdp_optimizer(opt, "cpu")
    assert len(calls) == 2 and not tf_skyrl.ferry_for(m).residency.on_host


# ------------------------------------------------------------------ SkyRL's FSDPStrategy itself (fresh process)
STRATEGY_CODE = f"""
import sys, types, torch
from tests.cpu.skyrl_import import apply, stub_flash_attn
from tests.helpers import identities, snapshot, trained
apply(); stub_flash_attn()
try:
    from skyrl.backends.skyrl_train.distributed import fsdp_strategy as fs
except ImportError as e:
    print(f"SKIP {{type(e).__name__}}: {{e}}"); sys.exit(3)
from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy
import torchferry.integrations.skyrl as tf_skyrl
names = tf_skyrl.patch()  # replaces the names fsdp_strategy bound by `from ...fsdp_utils import (...)`
assert "{FSDP_STRATEGY}.offload_fsdp2_model_to_cpu" in names, names
assert fs.load_fsdp_optimizer.__torchferry_original__ is not None
# The GPU calls FSDPStrategy makes around the helpers, on this CPU build:
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
strategy = types.SimpleNamespace(manual_offload=True, manual_offload_optimizer=True)
m, opt = trained()
before, ids = snapshot(m, opt), identities(m, opt)
FSDPStrategy.offload_to_cpu(strategy, m, opt)
assert tf_skyrl.ferry_for(m).residency.on_host and tf_skyrl.ferry_for(opt).residency.on_host
FSDPStrategy.backload_to_gpu(strategy, m, opt)
after = snapshot(m, opt)
assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
assert identities(m, opt) == ids
originals = [fs.offload_fsdp2_model_to_cpu.__torchferry_original__, fs.load_fsdp_optimizer.__torchferry_original__]
tf_skyrl.unpatch()
assert [fs.offload_fsdp2_model_to_cpu, fs.load_fsdp_optimizer] == originals
assert not hasattr(fs.offload_fsdp_optimizer, "__torchferry_original__")
print("ok")
"""


def test_fsdp_strategy_offloads_through_torchferry():
    """SkyRL's own FSDPStrategy.offload_to_cpu / backload_to_gpu (which call the helpers bound by name in
    fsdp_strategy) move the state through torchferry, bit-exact; unpatch() gives fsdp_strategy its names back."""
    p = subprocess.run([sys.executable, "-c", STRATEGY_CODE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if p.returncode == 3 and p.stdout.startswith("SKIP"):
        pytest.skip(f"SkyRL's fsdp_strategy cannot import here: {p.stdout[5:].strip()}")
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-4000:]


def test_import_loads_neither_skyrl_nor_ray_nor_cuda():
    code = ("import sys, torch, torchferry.integrations.skyrl\n"
            "assert not torch.cuda.is_initialized()\n"
            "assert not {'skyrl', 'ray', 'torch.distributed.fsdp'} & set(sys.modules), 'imported eagerly'\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


# ------------------------------------------------------------------ unchanged storages (the reference's offloads)
def _forward_only_offloads_copy_nothing(rank, world, setting):
    mesh = cpu_mesh(world)
    tf_skyrl.patch(skip_unchanged=setting)
    ref, _ = build_uneven(mesh)  # a reference model: forward only, no optimizer
    before, ids = snapshot(ref), identities(ref)
    fsdp_utils.offload_fsdp2_model_to_cpu(ref, empty_cache=True)
    copied = [tf_skyrl.ferry_for(ref).stats.offload_bytes_copied]
    for _ in range(2):
        fsdp_utils.load_fsdp2_model_to_gpu(ref)
        with torch.no_grad():
            ref(torch.ones(4, 16))
        fsdp_utils.offload_fsdp2_model_to_cpu(ref, empty_cache=True)
        copied.append(tf_skyrl.ferry_for(ref).stats.offload_bytes_copied)
    ferry = tf_skyrl.ferry_for(ref)
    state = ferry.state_bytes
    if setting is False:
        assert copied == [state, state, state]  # every offload copies everything
    else:
        assert copied == [state, 0, 0]  # after the first, each offload releases without a copy
    fsdp_utils.load_fsdp2_model_to_gpu(ref)
    _assert_equal(before, snapshot(ref))
    assert identities(ref) == ids
    tf_skyrl.unpatch()


@pytest.mark.parametrize("setting", [None, False])
def test_forward_only_offloads_copy_nothing_unless_switched_off(setting):
    """[Note: the helpers skip unchanged storages]: SkyRL offloads the reference after every forward."""
    run_spawned(functools.partial(_forward_only_offloads_copy_nothing, setting=setting))


def _skyrls(name: str) -> bool:
    """A setting as SkyRL's replacements read it ([Note: each integration's settings])."""
    return _helpers.settings_of("skyrl")[name]


def test_the_skip_setting_comes_from_patch_else_the_environment(monkeypatch):
    monkeypatch.delenv(_helpers.SKIP_ENV, raising=False)
    assert _skyrls("skip_unchanged")
    monkeypatch.setenv(_helpers.SKIP_ENV, "0")
    assert not _skyrls("skip_unchanged")
    tf_skyrl.patch(skip_unchanged=True)
    assert _skyrls("skip_unchanged")  # patch()'s argument over the environment
    tf_skyrl.unpatch()
    assert not _skyrls("skip_unchanged")
    monkeypatch.setenv(_helpers.SKIP_ENV, "maybe")
    with pytest.raises(ValueError, match="TORCHFERRY_SKIP_UNCHANGED must be on .* got 'maybe'"):
        _skyrls("skip_unchanged")
    m = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="TORCHFERRY_SKIP_UNCHANGED"):
        tf_skyrl.offload_fsdp2_model_to_cpu(m)
    assert m.weight.device.type == "cpu" and tf_skyrl.ferry_for(m) is None  # nothing made, nothing moved


def test_a_bad_skip_setting_is_refused_and_nothing_patched(monkeypatch):
    with pytest.raises(TypeError, match="skip_unchanged must be True, False or None, got str 'no'"):
        tf_skyrl.patch(skip_unchanged="no")  # type: ignore[arg-type]
    monkeypatch.setenv(_helpers.SKIP_ENV, "maybe")
    with pytest.raises(ValueError, match="TORCHFERRY_SKIP_UNCHANGED must be on .* got 'maybe'"):
        tf_skyrl.patch()  # at patch(), not at a model's first offload
    assert not tf_skyrl.is_patched()
    assert not hasattr(fsdp_utils.offload_fsdp2_model_to_cpu, "__torchferry_original__")


def test_a_second_patch_keeps_the_first_ones_skip_choice_and_only_a_patched_integration_resets_it(monkeypatch):
    monkeypatch.delenv(_helpers.SKIP_ENV, raising=False)
    tf_skyrl.patch(skip_unchanged=False)
    tf_skyrl.patch()  # idempotent: the choice stays
    assert not _skyrls("skip_unchanged")
    tf_verl.unpatch()  # verl was never patched: SkyRL's setting stays
    assert not _skyrls("skip_unchanged")
    tf_skyrl.patch(skip_unchanged=True)  # an explicit choice replaces it
    assert _skyrls("skip_unchanged")
    tf_skyrl.unpatch()
    assert _helpers.patch_choices("skyrl") == {} and _skyrls("skip_unchanged")


def test_the_optimizer_at_step_setting_comes_from_patch_and_unpatch_resets_it(monkeypatch):
    """[Note: optimizer state waited for at step()]: SkyRL's own choice, forgotten by its unpatch()."""
    monkeypatch.delenv(_helpers.OPTIMIZER_AT_STEP_ENV, raising=False)
    with pytest.raises(TypeError, match="optimizer_at_step must be True, False or None, got str 'x'"):
        tf_skyrl.patch(optimizer_at_step="x")  # type: ignore[arg-type]
    assert not tf_skyrl.is_patched()
    tf_skyrl.patch(optimizer_at_step=True)
    assert _skyrls("optimizer_at_step")
    tf_skyrl.unpatch()
    assert not _skyrls("optimizer_at_step")


# ------------------------------------------------------------------ unpatch() with state offloaded
def test_unpatch_brings_back_what_its_helpers_hold_offloaded(monkeypatch):
    """[Note: unpatch() brings the state back]. Reproduces: unpatch() while a model and its optimizer were
    offloaded through the patched helpers was silent, and SkyRL's own load helpers then could not bring
    them back (the state stayed in the ferry's pool, guarded)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # SkyRL's own load, on the CPU
    originals = {h: getattr(fsdp_utils, h) for h in HELPERS}
    m, opt = trained()
    before, ids = snapshot(m, opt), identities(m, opt)
    tf_skyrl.patch()
    fsdp_utils.offload_fsdp2_model_to_cpu(m, empty_cache=True)
    fsdp_utils.offload_fsdp_optimizer(opt)
    ferries = tf_skyrl.ferry_for(m), tf_skyrl.ferry_for(opt)
    assert all(f is not None and f.residency.on_host for f in ferries)
    tf_skyrl.unpatch()
    assert not tf_skyrl.is_patched() and {h: getattr(fsdp_utils, h) for h in HELPERS} == originals
    _assert_equal(before, snapshot(m, opt))
    assert identities(m, opt) == ids
    assert all(t.device == torch.device("cpu") for t in snapshot(m, opt).values())  # where they came from
    assert all(not f.residency.on_host for f in ferries)
    assert tf_skyrl.ferry_for(m) is None and tf_skyrl.ferry_for(opt) is None  # closed: their pools returned
    # SkyRL's own helpers round-trip it, and it trains
    fsdp_utils.offload_fsdp2_model_to_cpu(m, empty_cache=True)
    fsdp_utils.offload_fsdp_optimizer(opt)
    fsdp_utils.load_fsdp2_model_to_gpu(m)
    fsdp_utils.load_fsdp_optimizer(opt, "cpu")
    _assert_equal(before, snapshot(m, opt))
    m(IDS).backward()
    opt.step()


def test_unpatch_that_cannot_bring_the_state_back_raises_and_stays_patched(monkeypatch):
    """[Note: unpatch() brings the state back]: a reload that fails leaves SkyRL patched and every ferry
    where it was, in one line naming the cause and what stays offloaded; verl's unpatch() leaves SkyRL's
    ferries alone."""
    m, opt = trained()
    before = snapshot(m, opt)
    tf_skyrl.patch()
    patched = {h: getattr(fsdp_utils, h) for h in HELPERS}
    fsdp_utils.offload_fsdp2_model_to_cpu(m, empty_cache=True)
    fsdp_utils.offload_fsdp_optimizer(opt)
    fm, fo = tf_skyrl.ferry_for(m), tf_skyrl.ferry_for(opt)
    tf_verl.unpatch()  # another integration's: not SkyRL's state
    assert fm.residency.on_host and fo.residency.on_host

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(fo, "reload", out_of_memory)
    with pytest.raises(RuntimeError, match=(
            r"^torchferry.integrations.skyrl: unpatch\(\) could not bring optimizer AdamW \(\d+ bytes\) back to cpu "
            r"\(RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB\); nothing was unpatched: "
            r"model Mixed \(\d+ bytes\), optimizer AdamW \(\d+ bytes\) stay offloaded")):
        tf_skyrl.unpatch()
    assert tf_skyrl.is_patched() and {h: getattr(fsdp_utils, h) for h in HELPERS} == patched
    assert fm.residency.on_host and fo.residency.on_host  # the model's reload undone
    monkeypatch.undo()
    tf_skyrl.unpatch()
    assert not tf_skyrl.is_patched()
    _assert_equal(before, snapshot(m, opt))
    m(IDS).backward()
    opt.step()


# ------------------------------------------------------------------ SkyRL's helpers under a phase dock
def test_skyrls_helpers_leave_their_sets_to_a_phase_dock_and_train_bit_identically():
    """[Note: a trainer under a phase dock] in ``torchferry._core._dock.phase_dock``: the phase dock is not verl's.
    A SkyRL-shaped step (the reference's forward, the policy's train phase) under one whose budget holds the
    policy and its optimizer but not the reference beside them: SkyRL's offload helpers leave a docked set where
    the dock has it, its loads make it resident, the dock evicts what the next phase needs room for and learns
    the step, and the policy trains exactly as without offloading."""
    from torchferry.integrations._base import REGISTRY, PhaseDock

    tf_skyrl.patch()
    state = REGISTRY.patched["skyrl"]
    policy, opt = trained()
    same, same_opt = trained()  # the same policy, never offloaded
    torch.manual_seed(1)
    reference = Mixed()
    opt.zero_grad()
    same_opt.zero_grad()  # the sets' bytes between phases: parameters, buffers, optimizer state
    pf, of, rf = (state.helpers.make(x) for x in (policy, opt, reference))
    pd = state.router = PhaseDock(pf.state_bytes + of.state_bytes + rf.state_bytes // 2, label="skyrl dock")
    cpu = torch.device("cpu")
    for step in range(4):
        ids = (IDS + step) % 33
        fsdp_utils.load_fsdp2_model_to_gpu(policy)  # SkyRL's backload_to_gpu: resident when it returns
        fsdp_utils.load_fsdp_optimizer(opt, "cpu")
        assert not pf.residency.on_host and not of.residency.on_host
        assert rf.residency.on_host or step == 0  # the room made for them (the sets join at their first phase)
        pd.enter(policy, "train", device=cpu, params=pf, optimizer=of)
        for m, o in ((policy, opt), (same, same_opt)):
            m(ids).backward()
            o.step()
            o.zero_grad()
        pd.leave(policy, "train")
        before = pf.residency, of.residency
        fsdp_utils.offload_fsdp2_model_to_cpu(policy, empty_cache=True)  # SkyRL's offload_to_cpu
        fsdp_utils.offload_fsdp_optimizer(opt)
        assert (pf.residency, of.residency) == before  # left to the dock: they leave when the room is needed
        pd.enter(reference, "eval", device=cpu, params=rf)
        with torch.no_grad():
            reference(ids)
        pd.leave(reference, "eval")  # planned: the next phase's sets come in, the reference leaves for them
        before = rf.residency
        fsdp_utils.offload_fsdp2_model_to_cpu(reference, empty_cache=True)
        assert rf.residency is before
    assert pd.planned and pd.dock is not None and pd.dock.stats.evictions >= 4
    _assert_equal(snapshot(same, same_opt), snapshot(policy, opt))
    pd.dock.close()
    state.router = None
    tf_skyrl.unpatch()  # brings back what the dock left offloaded
    assert not rf.residency.on_host and tf_skyrl.ferry_for(reference) is None
