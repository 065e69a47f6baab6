"""torchferry.integrations.verl (patch()/unpatch(), the drop-in helpers) against the real verl package (CPU).

CI installs verl 0.9.1 without its dependencies, plus only what importing
``verl.utils.fsdp_utils`` and the FSDP engine module needs (see .ci/run)."""

import inspect
import sys
import types
from pathlib import Path

import pytest
import torch

verl_fsdp_utils = pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")

import torchferry.integrations.verl as tf_verl  # noqa: E402
from torchferry.compat import verl as compat  # noqa: E402
from torchferry import Residency  # noqa: E402
from torchferry.integrations._base import REGISTRY, marked  # noqa: E402
from tests.helpers import Mixed, assert_same, identities, snapshot, trained  # noqa: E402
from tests.spawn import run_spawned  # noqa: E402

IDS = torch.tensor([[1, 2, 3]])


@pytest.fixture
def patched():
    names = tf_verl.patch()
    yield names
    tf_verl.unpatch()


def test_patch_reaches_verl_call_sites_and_round_trips_bit_exact(patched):
    assert "verl.utils.fsdp_utils.offload_fsdp2_model_to_cpu" in patched
    engine = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    if engine is not None:  # the FSDP engine imports the helpers by name
        assert "verl.workers.engine.fsdp.transformer_impl.offload_fsdp_model_to_cpu" in patched
        assert engine.offload_fsdp_model_to_cpu is verl_fsdp_utils.offload_fsdp_model_to_cpu
    torch.manual_seed(0)
    m = Mixed()
    opt = torch.optim.AdamW(m.parameters())
    m(IDS).backward()
    opt.step()
    before = snapshot(m, opt)
    ids = [id(p) for p in m.parameters()]
    # verl's own dispatcher (fsdp_version(model) == 0 -> the FSDP2 path) reaches torchferry:
    verl_fsdp_utils.offload_fsdp_model_to_cpu(m)
    verl_fsdp_utils.offload_fsdp_optimizer(opt)
    assert compat.ferry_for(m) is not None and compat.ferry_for(m).residency.on_host
    assert compat.ferry_for(opt).residency.on_host
    with pytest.raises(RuntimeError, match=r"load_fsdp_model_to_gpu\(model\)"):
        m(IDS)
    mod = engine or verl_fsdp_utils
    mod.load_fsdp_model_to_gpu(m)
    mod.load_fsdp_optimizer(opt, "cpu")
    assert_same(before, snapshot(m, opt))
    assert [id(p) for p in m.parameters()] == ids
    m(IDS).backward()
    opt.step()


def test_unpatch_restores_verl_and_patch_is_idempotent():
    original = verl_fsdp_utils.offload_fsdp2_model_to_cpu
    first = tf_verl.patch()
    assert tf_verl.patch() == first and tf_verl.is_patched()
    assert verl_fsdp_utils.offload_fsdp2_model_to_cpu.__wrapped__ is compat.offload_fsdp2_model_to_cpu
    tf_verl.unpatch()
    assert verl_fsdp_utils.offload_fsdp2_model_to_cpu is original and not tf_verl.is_patched()
    assert "model.to(\"cpu\", non_blocking=True)" in inspect.getsource(original)


def test_changed_helper_is_refused_and_nothing_patched(monkeypatch):
    monkeypatch.setattr(verl_fsdp_utils, "load_fsdp_optimizer", lambda optimizer: None)
    with pytest.raises(RuntimeError, match=r"load_fsdp_optimizer\('optimizer',\) does not have the parameters"):
        tf_verl.patch()
    assert not tf_verl.is_patched()


def test_verl_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl.utils.fsdp_utils", None)
    with pytest.raises(RuntimeError, match="verl is not importable"):
        tf_verl.patch()


def test_unpatch_also_restores_verl_modules_imported_after_patch(monkeypatch):
    import types

    tf_verl.patch()
    late = types.ModuleType("verl.late_engine")
    late.offload_fsdp2_model_to_cpu = verl_fsdp_utils.offload_fsdp2_model_to_cpu  # bound by name after patch()
    monkeypatch.setitem(sys.modules, "verl.late_engine", late)
    tf_verl.unpatch()
    assert late.offload_fsdp2_model_to_cpu is verl_fsdp_utils.offload_fsdp2_model_to_cpu
    assert not hasattr(late.offload_fsdp2_model_to_cpu, "__torchferry_original__")


def test_unpatch_restores_a_verl_module_that_imported_the_helpers_by_name_after_patch():
    """A regression test of the verl integration (failed before its
    fix): patch() rebinds the helpers in fsdp_utils, so a verl module imported afterwards (e.g.
    verl.workers.engine.torchtitan.transformer_impl, which imports them by name and is not in
    _ENGINE_MODULES) binds torchferry's; unpatch() only restores what patch() itself replaced.
    Simulated with a stand-in verl submodule doing the same `from ... import`."""
    pytest.importorskip("verl.utils.fsdp_utils")
    import torchferry.integrations.verl as tf_verl
    import verl.utils.fsdp_utils as fu

    original = fu.offload_fsdp_model_to_cpu
    tf_verl.patch()
    try:
        probe = types.ModuleType("verl._late_engine_probe")
        exec("from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu", probe.__dict__)
        sys.modules[probe.__name__] = probe
    finally:
        tf_verl.unpatch()
    try:
        assert fu.offload_fsdp_model_to_cpu is original
        assert probe.offload_fsdp_model_to_cpu is original, "late-imported verl module still routed to torchferry"
    finally:
        sys.modules.pop("verl._late_engine_probe", None)


class _Event:
    """Stands in for the D2H event of an offload whose copies are in flight (the CPU copies are
    synchronous); counts host waits."""

    def __init__(self) -> None:
        self.synchronized = 0

    def query(self) -> bool:
        return self.synchronized > 0

    def synchronize(self) -> None:
        self.synchronized += 1


def test_offload_helpers_make_the_current_stream_wait_for_the_copies(patched, monkeypatch):
    """verl reads host copies after synchronising its own stream, which ordered the seed's
    same-stream copies; torchferry's run on its D2H stream, so each offload helper makes the
    caller's current stream wait for their event (no host wait for the optimizer; the model's
    empty_cache=True waits on the host as before). Before this fix the host read
    came earlier than the bytes (a stale host read after offload_fsdp_optimizer, 3 of 3
    trials on one H200)."""
    import torchferry._core._ferry.ferry
    from torchferry._core._api.handle import TransferHandle

    events: list[_Event] = []

    def handle(direction, nbytes, event, *args, **kwargs):
        if direction == "d2h" and event is None and nbytes:
            event = _Event()
            events.append(event)
        return TransferHandle(direction, nbytes, event, *args, **kwargs)

    stream, asked, waited = object(), [], []  # stream: the caller's current stream
    monkeypatch.setattr(torchferry._core._ferry.moves, "TransferHandle", handle)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: asked.append(device) or stream)
    monkeypatch.setattr(TransferHandle, "wait_stream", lambda self, s: waited.append((self.event, s)))
    torch.manual_seed(0)
    m, m2 = Mixed(), Mixed()
    opt = torch.optim.AdamW(m.parameters())
    m(IDS).backward()
    opt.step()
    verl_fsdp_utils.offload_fsdp_optimizer(opt)
    assert waited == [(events[0], stream)] and events[0].synchronized == 0  # ordered, no host sync
    verl_fsdp_utils.offload_fsdp_model_to_cpu(m, empty_cache=False)
    verl_fsdp_utils.offload_fsdp2_model_to_cpu(m2)  # empty_cache=True: also waits on the host
    assert len(events) == 3 and waited == [(e, stream) for e in events]
    assert [e.synchronized for e in events] == [0, 0, 1]
    assert asked == [compat.ferry_for(x).device for x in (opt, m, m2)]
    verl_fsdp_utils.offload_fsdp_optimizer(opt)  # a no-op offload: the same copies again
    assert waited[3:] == [(events[0], stream)]
    verl_fsdp_utils.load_fsdp_optimizer(opt, "cpu")
    verl_fsdp_utils.load_fsdp_model_to_gpu(m)
    verl_fsdp_utils.load_fsdp_model_to_gpu(m2)


# ------------------------------------------------------------------ unpatch() with state offloaded
HELPERS = ("offload_fsdp_model_to_cpu", "load_fsdp_model_to_gpu", "offload_fsdp2_model_to_cpu",
           "load_fsdp2_model_to_gpu", "offload_fsdp_optimizer", "load_fsdp_optimizer")


def _verls_own_helpers_round_trip(m, opt, before) -> None:
    """verl's own helpers (the unpatched module functions) offload and load ``m`` and ``opt``; the state
    comes back bit-exact and trains."""
    assert not any(hasattr(getattr(verl_fsdp_utils, h), "__torchferry_original__") for h in HELPERS)
    verl_fsdp_utils.offload_fsdp_model_to_cpu(m)
    verl_fsdp_utils.offload_fsdp_optimizer(opt)
    verl_fsdp_utils.load_fsdp_model_to_gpu(m)
    verl_fsdp_utils.load_fsdp_optimizer(opt, "cpu")
    assert_same(before, snapshot(m, opt))
    m(IDS).backward()
    opt.step()


def test_unpatch_brings_back_what_its_helpers_hold_offloaded(monkeypatch):
    """[Note: unpatch() brings the state back]. Reproduces: unpatch() while a model and its optimizer
    were offloaded through the patched helpers was silent, and verl's own load helpers then could not
    bring them back (the state stayed in the ferry's pool, the forward after verl's own load raised)."""
    monkeypatch.setattr(verl_fsdp_utils, "get_device_id", lambda: "cpu")  # verl's own load, on the CPU
    originals = {h: getattr(verl_fsdp_utils, h) for h in HELPERS}
    m, opt = trained()
    before, ids = snapshot(m, opt), identities(m, opt)
    tf_verl.patch()
    verl_fsdp_utils.offload_fsdp_model_to_cpu(m)
    verl_fsdp_utils.offload_fsdp_optimizer(opt)
    ferries = compat.ferry_for(m), compat.ferry_for(opt)
    assert all(f is not None and f.residency.on_host for f in ferries)
    tf_verl.unpatch()
    assert not tf_verl.is_patched()
    assert {h: getattr(verl_fsdp_utils, h) for h in HELPERS} == originals  # verl's own functions
    assert_same(before, snapshot(m, opt))  # every parameter, grad, buffer and state tensor, bit-exact
    assert identities(m, opt) == ids
    assert all(t.device == torch.device("cpu") for t in snapshot(m, opt).values())  # where they came from
    assert all(f.residency is Residency.DEVICE for f in ferries)
    assert compat.ferry_for(m) is None and compat.ferry_for(opt) is None  # closed: their pools returned
    _verls_own_helpers_round_trip(m, opt, before)


def test_unpatch_completes_a_reload_still_under_way():
    """With verl's default optimizer_at_step, the patched load_fsdp_optimizer leaves the state's copies to
    optimizer.step(): an unpatch() before that step brings the rest back ([Note: unpatch() brings the state
    back])."""
    m, opt = trained()
    before = snapshot(m, opt)
    tf_verl.patch()
    verl_fsdp_utils.offload_fsdp_optimizer(opt)
    verl_fsdp_utils.load_fsdp_optimizer(opt, "cpu")
    ferry = compat.ferry_for(opt)
    assert ferry.residency is Residency.PREFETCHING
    tf_verl.unpatch()
    assert ferry.residency is Residency.DEVICE and compat.ferry_for(opt) is None
    assert_same(before, snapshot(m, opt))
    opt.step()  # no step pre-hook of the ferry is left to wait for anything


def test_unpatch_that_cannot_bring_the_state_back_raises_and_stays_patched(monkeypatch):
    """[Note: unpatch() brings the state back]: a reload that fails (the device out of memory) leaves
    everything patched and where it was, the model brought back before it offloaded again, and says so
    in one line naming the cause and what stays offloaded."""
    m, opt = trained()
    before = snapshot(m, opt)
    tf_verl.patch()
    patched = {h: getattr(verl_fsdp_utils, h) for h in HELPERS}
    verl_fsdp_utils.offload_fsdp_model_to_cpu(m)
    verl_fsdp_utils.offload_fsdp_optimizer(opt)
    fm, fo = compat.ferry_for(m), compat.ferry_for(opt)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB\nSee the documentation")

    monkeypatch.setattr(fo, "reload", out_of_memory)
    with pytest.raises(RuntimeError, match=(
            r"^torchferry.integrations.verl: unpatch\(\) could not bring optimizer AdamW \(\d+ bytes\) back to cpu "
            r"\(RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB\); nothing was unpatched: "
            r"model Mixed \(\d+ bytes\), optimizer AdamW \(\d+ bytes\) stay offloaded in torchferry's pool")) as e:
        tf_verl.unpatch()
    assert "\n" not in str(e.value)
    assert tf_verl.is_patched() and {h: getattr(verl_fsdp_utils, h) for h in HELPERS} == patched
    assert fm.residency.on_host and fo.residency.on_host  # the model's reload undone
    assert compat.ferry_for(m) is fm and compat.ferry_for(opt) is fo
    with pytest.raises(RuntimeError, match=r"load_fsdp_model_to_gpu\(model\)"):
        m(IDS)  # still guarded: offloaded, as before the call
    monkeypatch.undo()
    tf_verl.unpatch()  # room again: it all comes back
    assert not tf_verl.is_patched()
    assert_same(before, snapshot(m, opt))
    m(IDS).backward()
    opt.step()


def test_unpatch_keep_offloaded_leaves_the_state_to_a_later_patch():
    """unpatch(keep_offloaded=True): a process switching between torchferry and verl's own helpers for other
    models (benchmarks/verl_actor.py's turns) leaves the state in its ferries for a later patch()."""
    m, opt = trained()
    before = snapshot(m, opt)
    tf_verl.patch()
    verl_fsdp_utils.offload_fsdp_model_to_cpu(m)
    verl_fsdp_utils.offload_fsdp_optimizer(opt)
    fm, fo = compat.ferry_for(m), compat.ferry_for(opt)
    with pytest.raises(TypeError, match=r"unpatch\(keep_offloaded=...\) must be True or False"):
        tf_verl.unpatch(keep_offloaded="yes")  # type: ignore[arg-type]
    assert tf_verl.is_patched()
    tf_verl.unpatch(keep_offloaded=True)
    assert not tf_verl.is_patched() and fm.residency.on_host and fo.residency.on_host
    tf_verl.patch()
    assert compat.ferry_for(m) is fm and compat.ferry_for(opt) is fo  # the same ferries and pools
    verl_fsdp_utils.load_fsdp_model_to_gpu(m)
    verl_fsdp_utils.load_fsdp_optimizer(opt, "cpu")
    tf_verl.unpatch()
    assert_same(before, snapshot(m, opt))
    m(IDS).backward()
    opt.step()


def test_state_verl_offloaded_itself_is_loaded_by_verls_own_code(monkeypatch):
    """A model or optimizer that verl's own helpers offloaded (before ``patch()``, or by a path it does
    not reach) has no ferry: the patched loads hand it to verl's own code, which moves it (to ``meta``
    here, where the CPU cannot tell the host from the device), instead of doing nothing."""
    torch.manual_seed(0)
    m = Mixed()
    opt = torch.optim.AdamW(m.parameters())
    m(IDS).backward()
    opt.step()
    verl_fsdp_utils.offload_fsdp_model_to_cpu(m)  # verl's own, unpatched
    verl_fsdp_utils.offload_fsdp_optimizer(opt)
    monkeypatch.setattr(verl_fsdp_utils, "get_device_id", lambda: "meta")
    tf_verl.patch()
    try:
        assert compat.ferry_for(m) is None and compat.ferry_for(opt) is None
        verl_fsdp_utils.load_fsdp_model_to_gpu(m)
        assert all(p.device.type == "meta" for p in m.parameters())
        m2 = Mixed()
        verl_fsdp_utils.load_fsdp2_model_to_gpu(m2)
        assert all(p.device.type == "meta" for p in m2.parameters())
        verl_fsdp_utils.load_fsdp_optimizer(opt, "meta")
        assert all(v.device.type == "meta" for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    finally:
        tf_verl.unpatch()


def _lora_model():
    peft = pytest.importorskip("peft")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(8, 8)
            self.v = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.v(self.q(x))

    torch.manual_seed(0)
    model = peft.get_peft_model(Tiny(), peft.LoraConfig(r=2, target_modules=["q", "v"]))
    with torch.no_grad():  # adapters that differ from their initial zeros
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


def test_the_lora_sync_reads_adapters_where_they_are_only_when_verl_would_read_only_them(patched):
    """[Note: the LoRA weight sync reads the adapters where they are]: a sync after the base's (``base_sync_done``)
    of an FSDP2 peft model torchferry offloaded reads the adapters from the host, bit-identical to verl's own
    ``collect_lora_params`` on the device, and leaves the model offloaded; every other sync is verl's own."""
    import types as t

    from torchferry.integrations.verl import _lora_sync as ls

    engine_mod = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
    assert "verl.workers.engine.fsdp.transformer_impl.FSDPEngine.get_per_tensor_param" in patched
    assert "verl.utils.fsdp_utils.collect_lora_params" in patched
    assert engine_mod.collect_lora_params is verl_fsdp_utils.collect_lora_params
    model = _lora_model()
    verl_own = verl_fsdp_utils.collect_lora_params.__torchferry_original__  # verl's, on the model as it is
    want = verl_own(model, False, True)
    assert want and all("lora_" in k for k in want)
    verl_fsdp_utils.offload_fsdp_model_to_cpu(model)
    ferry = compat.ferry_for(model)
    assert ferry.residency is Residency.HOST

    def engine(**lora):
        return t.SimpleNamespace(module=model, model_config=t.SimpleNamespace(lora={"merge": False, **lora}),
                                 _uses_fsdp2_cpu_offload_policy=False, _is_offload_param=True)

    fsdp2 = lambda m: 2  # noqa: E731  # the decision as for an FSDP2 module
    assert ls._adapters_only(engine(), fsdp2, False, True)
    assert not ls._adapters_only(engine(), fsdp2, False, False)  # the base's sync
    assert not ls._adapters_only(engine(), fsdp2, True, True)  # layered summon
    assert not ls._adapters_only(engine(merge=True), fsdp2, False, True)
    assert not ls._adapters_only(engine(), lambda m: 1, False, True)  # FSDP1
    assert not ls._adapters_only(t.SimpleNamespace(**{**vars(engine()), "_uses_fsdp2_cpu_offload_policy": True}),
                                 fsdp2, False, True)
    # param_offload off (a model offloaded by hand): verl's sync loads it and leaves it on the device
    assert not ls._adapters_only(t.SimpleNamespace(**{**vars(engine()), "_is_offload_param": False}), fsdp2, False, True)
    reading = lambda: marked(REGISTRY.patched["verl"].left_in_place, model)  # noqa: E731  # as the sync marks it
    with reading():
        assert ls.reads_adapters_only(model)
        verl_fsdp_utils.load_fsdp_model_to_gpu(model)  # left on the host
        assert ferry.residency is Residency.HOST
        got = verl_fsdp_utils.collect_lora_params(model, False, True)
        verl_fsdp_utils.offload_fsdp_model_to_cpu(model)
    assert not ls.reads_adapters_only(model) and ferry.residency is Residency.HOST
    with pytest.raises(RuntimeError, match="inside the sync"), reading():  # the scope ends with the call
        verl_fsdp_utils.load_fsdp_model_to_gpu(model)
        raise RuntimeError("inside the sync")
    assert not ls.reads_adapters_only(model) and ferry.residency is Residency.HOST
    assert list(got) == list(want)
    pool = {p.untyped_storage().data_ptr() for p in model.parameters()}  # offloaded: the pool's slots
    for k in want:
        assert got[k].device.type == "cpu" and got[k].untyped_storage().data_ptr() not in pool  # a copy of its own
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)
    verl_fsdp_utils.load_fsdp_model_to_gpu(model)  # outside a sync: the model comes back
    assert ferry.residency is Residency.DEVICE
    assert not ls._adapters_only(engine(), fsdp2, False, True)  # resident: verl's own read
    with reading():  # a resident model's read is verl's own even inside the scope
        torch.testing.assert_close(verl_fsdp_utils.collect_lora_params(model, False, True), want, atol=0, rtol=0)
    tf_verl.unpatch()
    assert "get_per_tensor_param" not in engine_mod.FSDPEngine.__dict__ or \
        engine_mod.FSDPEngine.get_per_tensor_param.__qualname__.startswith("FSDPEngine.")
    assert verl_fsdp_utils.collect_lora_params is verl_own
    tf_verl.patch()  # for the fixture's unpatch


def _twin_syncs(rank, world):
    """verl's own weight syncs on a resident FSDP2 peft model against the same syncs under ``patch()``'s defaults
    on its twin, offloaded by verl's patched helper: the merged one (``lora.merge``) and the layer-summoned one."""
    import sys
    import types as t

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from torch.distributed.fsdp import fully_shard
    from verl_step.environment import _install_cpu_platform

    _install_cpu_platform()  # verl's device names on a CPU
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    def model():
        m = _lora_model()
        for mod in (m.base_model.model.q, m.base_model.model.v, m):
            fully_shard(mod)
        m(torch.ones(2, 8))  # FSDP2's lazy init
        return m

    def engine(m, merge):
        config = t.SimpleNamespace(lora={"merge": merge}, hf_config=t.SimpleNamespace(model_type="x"))
        e = t.SimpleNamespace(module=m, model_config=config, _uses_fsdp2_cpu_offload_policy=False,
                              _is_offload_param=True, _qat_enabled=False)
        e._merged_lora_per_tensor_param = t.MethodType(FSDPEngine._merged_lora_per_tensor_param, e)
        return e

    def syncs(m):
        merged = dict(FSDPEngine.get_per_tensor_param(engine(m, True), base_sync_done=True)[0])
        layered = dict(FSDPEngine.get_per_tensor_param(engine(m, False), layered_summon=True, base_sync_done=True)[0])
        verl_fsdp_utils.load_fsdp_model_to_gpu(m)
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in {**merged, **layered}.items()}, \
            {k: v.full_tensor() for k, v in m.state_dict().items()}

    verl_own, verl_state = syncs(model())
    tf_verl.patch()  # its defaults: layerwise_reload and skip_unchanged on
    try:
        twin = model()
        verl_fsdp_utils.offload_fsdp_model_to_cpu(twin)
        got, state = syncs(twin)
        assert compat.ferry_for(twin).residency is Residency.DEVICE
    finally:
        tf_verl.unpatch()
    for want, have in ((verl_own, got), (verl_state, state)):
        assert list(have) == list(want)
        for k in want:
            torch.testing.assert_close(have[k], want[k], atol=0, rtol=0)


def test_a_sync_that_merges_or_reads_the_base_loads_the_model_whole():
    """[Note: verl's defaults]: only a train/eval context's load is followed by a forward, so only it reloads
    layer-wise; the merged LoRA sync (peft's merge writes ``.data`` before any forward) and the layer-summoned one
    (``full_tensor()`` of each unit) get the model whole. Before, under ``patch()``'s defaults the merged sync sent
    the base without the adapters and left the merge in the model's weights for good."""
    pytest.importorskip("peft")
    run_spawned(_twin_syncs, world=1)


def _stepped_linear():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 4)).sum().backward()
    opt.step()
    return m, opt


@pytest.mark.parametrize("call", ["offload_fsdp2_model_to_cpu(opt)", "load_fsdp2_model_to_gpu(5)",
                                  "offload_fsdp_optimizer(m)", "load_fsdp_optimizer(m, 'cpu')"])
def test_a_helper_given_the_wrong_kind_of_object_refuses_it_in_one_line(call):
    """An optimizer given to a model helper was offloaded through it; a module given to an optimizer helper, or
    an int to a load, raised from inside Python or weakref. Now a one-line ``TypeError``, nothing moved."""
    m, opt = _stepped_linear()
    before = snapshot(m, opt)
    with pytest.raises(TypeError, match=r"^torchferry: the (model|optimizer) (offload|load) takes a torch") as e:
        eval(call, {**vars(compat), "m": m, "opt": opt})
    assert "\n" not in str(e.value)
    assert compat.ferry_for(m) is None and compat.ferry_for(opt) is None
    assert_same(before, snapshot(m, opt))


@pytest.mark.parametrize("device_id, exc, match", [
    (None, TypeError, r"load_fsdp_optimizer\(device_id=None\): give the device to reload onto"),
    ("gpu", ValueError, r"load_fsdp_optimizer\(device_id=\.\.\.\): 'gpu' is not a device"),
    (True, TypeError, r"load_fsdp_optimizer\(device_id=\.\.\.\) takes a device index, 'cuda:N' or a device; got bool"),
    (1.5, TypeError, r"got float 1\.5"),
    (-1, ValueError, r"device index -1 is negative"),
])
def test_the_optimizer_load_refuses_a_bad_device_id_in_one_line_and_the_state_stays_offloaded(device_id, exc, match):
    """``load_fsdp_optimizer(opt, None)`` (or ``"gpu"``, ``True``, ``1.5``) raised PyTorch's multi-line errors from
    ``torch.device``; now one torchferry line, the state offloaded and intact, a right device then reloads it."""
    m, opt = _stepped_linear()
    before = snapshot(m, opt)
    compat.offload_fsdp_optimizer(opt)
    with pytest.raises(exc, match="^torchferry: .*" + match) as e:
        compat.load_fsdp_optimizer(opt, device_id)
    assert "\n" not in str(e.value) and compat.ferry_for(opt).residency.on_host
    compat.load_fsdp_optimizer(opt, "cpu")
    assert_same(before, snapshot(m, opt))


@pytest.mark.parametrize("call", ["load_fsdp2_model_to_gpu([1])", "load_fsdp_model_to_gpu(opt)",
                                  "load_fsdp_optimizer(m, 'cpu')", "offload_fsdp_model_to_cpu(opt)"])
def test_verls_patched_helpers_refuse_the_wrong_kind_of_object_before_looking_it_up(call, patched):
    """The patched loads looked an object up first: a list raised weakref's error, an optimizer never offloaded
    went to verl's own load (which asserts CUDA), a module to the optimizer load raised an ``AttributeError``."""
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(TypeError, match=r"^torchferry: the (model|optimizer) (offload|load) takes a torch"):
        eval(call, {**vars(verl_fsdp_utils), "m": m, "opt": opt})
    assert compat.ferry_for(m) is None and compat.ferry_for(opt) is None
