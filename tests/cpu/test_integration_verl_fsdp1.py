"""FSDP1 models through verl's patched helpers ([Note: FSDP1 models through torchferry] in
``docs/integrations.md``), against the real verl 0.9.1 on the CPU: FSDP1
(``FullyShardedDataParallel``) over gloo on 2 ranks, ``use_orig_params`` both ways. On by
default; with ``patch(fsdp1=False)``, and for a model that offloads its own flat parameters,
verl's own code."""

import functools

import pytest
import torch
from torch import nn

verl_fsdp_utils = pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")

import torchferry.integrations.verl as tf_verl  # noqa: E402
from torchferry.integrations.verl import _patch as verl_patch  # noqa: E402
from torchferry.integrations._base import FSDP1_ENV  # noqa: E402
from tests.helpers import identities, snapshot, train_step  # noqa: E402
from tests.spawn import run_spawned  # noqa: E402


@pytest.fixture(autouse=True)
def _unpatched():
    yield
    tf_verl.unpatch()


def _fsdp1(orig: bool, cpu_offload: bool = False):
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 11), nn.ReLU(), nn.Linear(11, 5))
    wrapped = FSDP(m, device_id=torch.device("cpu"), use_orig_params=orig,
                   cpu_offload=CPUOffload(offload_params=True) if cpu_offload else None)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _round_trips(rank, world, orig):
    from torchferry.integrations.verl import ferry_for

    tf_verl.patch(fsdp1=True, import_engines=False)
    m, opt = _fsdp1(orig)
    ref, ref_opt = _fsdp1(orig)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 16, generator=g) for _ in range(4)]
    verl_fsdp_utils.offload_fsdp_model_to_cpu(m)  # as verl does right after building: before any forward
    assert ferry_for(m) is not None and ferry_for(m).residency.on_host
    verl_fsdp_utils.load_fsdp_model_to_gpu(m)
    for step, x in enumerate(xs):
        train_step(m, opt, x, set_to_none=True)
        train_step(ref, ref_opt, x, set_to_none=True)
        before, ids = snapshot(m, opt), identities(m, opt)
        verl_fsdp_utils.offload_fsdp_model_to_cpu(m)
        verl_fsdp_utils.offload_fsdp_optimizer(opt)
        assert ferry_for(m).residency.on_host and ferry_for(opt).residency.on_host, step
        verl_fsdp_utils.load_fsdp_model_to_gpu(m)
        verl_fsdp_utils.load_fsdp_optimizer(opt, "cpu")
        _same(before, snapshot(m, opt))
        assert identities(m, opt) == ids
        _same(snapshot(ref, ref_opt), snapshot(m, opt))  # training goes on as if never offloaded
    with torch.no_grad():
        assert torch.equal(m(xs[0]), ref(xs[0]))


@pytest.mark.parametrize("orig", [False, True], ids=["flat_params", "use_orig_params"])
def test_fsdp1_models_round_trip_bit_exact_through_torchferry(orig):
    run_spawned(functools.partial(_round_trips, orig=orig))


def _stays_with_verl(rank, world):
    from torchferry.integrations.verl import ferry_for

    tf_verl.patch(fsdp1=False, import_engines=False)
    m, _ = _fsdp1(orig=False)
    verl_fsdp_utils.offload_fsdp_model_to_cpu(m)
    assert ferry_for(m) is None  # verl's own FSDP1 code ran
    # A model whose units keep their flat parameters on the host is verl's (its offload, and
    # FSDP1's own lazy init, pin memory: not on a CPU-only build, so only the decision here).
    from torchferry._core._state.fsdp1 import fsdp1_offloads_params

    own, _ = _fsdp1(orig=False, cpu_offload=True)
    assert fsdp1_offloads_params(own) and not fsdp1_offloads_params(m)


def test_fsdp1_models_stay_with_verls_code_when_switched_off_and_when_they_offload_themselves():
    run_spawned(_stays_with_verl)


def test_the_fsdp1_setting_comes_from_patch_else_the_environment(monkeypatch):
    monkeypatch.delenv(FSDP1_ENV, raising=False)
    tf_verl.patch(import_engines=False)
    assert verl_patch.fsdp1_through_torchferry()  # on by default
    monkeypatch.setenv(FSDP1_ENV, "0")
    assert verl_patch.fsdp1_through_torchferry()  # the environment is read by patch() (Settings), not by each call
    tf_verl.patch(import_engines=False)  # read again: no argument chose it
    assert not verl_patch.fsdp1_through_torchferry()
    tf_verl.patch(fsdp1=True, import_engines=False)
    assert verl_patch.fsdp1_through_torchferry()  # patch()'s choice over the environment
    tf_verl.unpatch()
    assert not verl_patch.fsdp1_through_torchferry()
    monkeypatch.setenv(FSDP1_ENV, "sometimes")
    with pytest.raises(ValueError, match="TORCHFERRY_VERL_FSDP1 must be on .* got 'sometimes'"):
        tf_verl.patch(import_engines=False)
    assert not tf_verl.is_patched()
    with pytest.raises(TypeError, match=r"patch\(fsdp1=...\) must be True, False or None, got int 1"):
        tf_verl.patch(fsdp1=1, import_engines=False)  # type: ignore[arg-type]
    assert not tf_verl.is_patched()


def _state_dict_while_offloaded(rank, world, orig):
    import torchferry
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    torch.manual_seed(0)
    inner = FSDP(nn.Sequential(nn.Linear(11, 5)), device_id=torch.device("cpu"), use_orig_params=orig)
    m = FSDP(nn.Sequential(nn.Linear(16, 11), nn.ReLU(), inner), device_id=torch.device("cpu"), use_orig_params=orig)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    train_step(m, opt, x, set_to_none=True)
    kinds = (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT)

    def state(kind):
        with FSDP.state_dict_type(m, kind):
            return {k: (v.local_tensor() if hasattr(v, "local_tensor") else v).clone()
                    for k, v in m.state_dict().items()}

    want = {kind: state(kind) for kind in kinds}
    before = snapshot(m, opt)
    ferry = torchferry.Ferry(m, opt)
    ferry.offload()
    for kind in kinds:
        with FSDP.state_dict_type(m, kind), pytest.raises(RuntimeError) as e:
            m.state_dict()
        assert str(e.value).startswith("torchferry: state_dict() / load_state_dict() of the FSDP1 model "
                                       "FullyShardedDataParallel while its state is offloaded")
        assert "\n" not in str(e.value) and "call ferry.reload()" in str(e.value)
        with FSDP.state_dict_type(m, kind), pytest.raises(RuntimeError, match="^torchferry: state_dict"):
            m.load_state_dict(want[kind])
        with FSDP.state_dict_type(m, kind), pytest.raises(RuntimeError, match="^torchferry: state_dict"):
            inner.state_dict()  # a unit inside the target: its own hooks would do the same
    ferry.reload()
    _same(before, snapshot(m, opt))
    for kind in kinds:  # FSDP1 untouched: every kind works after the reload, and equals what it was
        _same(want[kind], state(kind))
    ferry.offload()  # and once more, a cycle later
    ferry.reload()
    _same(want[kinds[0]], state(kinds[0]))


@pytest.mark.parametrize("orig", [False, True], ids=["flat_params", "use_orig_params"])
def test_an_fsdp1_state_dict_while_offloaded_is_refused_and_fsdp1_stays_usable(orig):
    """FSDP1's own state-dict hooks read the released flat parameters: with ``use_orig_params=True`` a
    ``state_dict()`` while offloaded raised PyTorch's ``setStorage ... storage of size 0`` and left FSDP1 in its
    unshard context, so every later ``state_dict()`` failed, after ``reload()`` too ([Note: FSDP1's state dict
    while offloaded] in ``_core/_ferry/guards.py``). Now refused in one line before FSDP1's hooks run, for every
    state-dict type, ``load_state_dict()`` and a unit inside the target, and exact after the reload (2 gloo
    ranks)."""
    run_spawned(functools.partial(_state_dict_while_offloaded, orig=orig))
