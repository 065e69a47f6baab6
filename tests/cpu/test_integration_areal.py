"""torchferry.integrations.areal (patch()/unpatch() of FSDPEngine.offload/onload) against the real
areal package, on the CPU: AReaL's own FSDPEngine, built and trained through its own API (a tiny
Qwen2 made here, FSDP2 over gloo on 2 ranks).

CI installs areal 1.0.4 without its dependencies, plus only what importing
``areal.engine.fsdp_engine`` needs (see .ci/run); without them these tests skip, naming what is
missing. Everything that imports areal runs in spawned processes: areal's logging setup replaces
the logging module's root logger and manager at import (``areal.utils.logging.getLogger``), which
would change what other tests' ``caplog`` sees in this process."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import identities, snapshot
from tests.spawn import run_spawned

if importlib.util.find_spec("areal") is None:
    pytest.skip("areal not installed (pip install --no-deps areal==1.0.4)", allow_module_level=True)

TIMEOUT_S = 600


@pytest.fixture(scope="module")
def areal_importable():
    """Skips (with areal's own error) where ``areal.engine.fsdp_engine`` does not import here."""
    p = subprocess.run([sys.executable, "-c", "import areal.engine.fsdp_engine"], capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"areal.engine.fsdp_engine does not import here: {last}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, areal_importable):
    """A tiny Qwen2 config and a word-level tokenizer, what FSDPEngine loads from ``config.path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    path = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(62)} | {"<unk>": 62, "<eos>": 63}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------ inside the spawned ranks
def _engine(path: str, world: int, lr: float | None, seed: int = 0):
    """AReaL's FSDPEngine as its trainer builds one (an optimizer when ``lr``, else forward-only)."""
    from areal.api.cli_args import OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    config = TrainEngineConfig(experiment_name="torchferry", trial_name="test", path=path, attn_impl="sdpa",
                               init_from_scratch=True, backend=f"fsdp:d{world}", dtype="float32",
                               optimizer=None if lr is None else OptimizerConfig(lr=lr))
    engine = FSDPEngine(config)
    engine.create_process_group()
    torch.manual_seed(seed)  # the same initial weights for every engine of a seed
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2))
    return engine


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return {"input_ids": torch.randint(0, 62, (2, 6), generator=g), "attention_mask": mask}


def _loss(logprobs, entropy, mb_input, **kwargs):
    return -logprobs.sum()


def _weight(mb_input):
    return torch.tensor(float(mb_input["input_ids"].numel()))


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    wrong = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not wrong, wrong


def _kept(model, optimizer) -> list[int]:
    """Ids of the parameters and optimizer-state tensors (the objects a training step keeps)."""
    return [id(p) for p in model.parameters()] + [id(v) for st in optimizer.state.values() for v in st.values()]


def _round_trips_body(rank: int, world: int, path: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    import torchferry.integrations.areal as tf_areal
    from torchferry import Residency

    tf_areal.patch()
    actor, plain, ref = _engine(path, world, 1e-2), _engine(path, world, 1e-2), _engine(path, world, None)
    assert not hasattr(ref, "optimizer")  # AReaL's forward-only engine: no optimizer attribute at all
    for engine in (actor, plain):
        engine.train_batch(_batch(rank), _loss, _weight)
    before = snapshot(actor.model, actor.optimizer)
    assert any(k.endswith(".grad") for k in before) and any(k.startswith("opt.") for k in before)
    ids = identities(actor.model, actor.optimizer)
    kept = _kept(actor.model, actor.optimizer)

    # offload / onload: flags as AReaL sets them, bit-exact, every object kept
    assert tf_areal.ferry_for(actor) is None and not actor.is_offload
    actor.offload()
    ferry = tf_areal.ferry_for(actor)
    assert actor.is_offload and ferry is not None and ferry.residency is Residency.HOST
    assert ferry.stats.offload_bytes_copied == ferry.stats.last_offload_bytes > 0
    with pytest.raises(RuntimeError, match="reload"):
        actor.model(input_ids=_batch(rank)["input_ids"])
    actor.offload()  # a second offload moves nothing (a second torch_memory_saver pause ends the process)
    assert actor.is_offload and tf_areal.ferry_for(actor) is ferry and ferry.stats.bytes_offloaded == ferry.state_bytes
    actor.onload()
    assert not actor.is_offload and ferry.residency is Residency.DEVICE
    _assert_equal(before, snapshot(actor.model, actor.optimizer))
    assert identities(actor.model, actor.optimizer) == ids
    actor.onload()  # resident: moves nothing
    assert not actor.is_offload and ferry.stats.bytes_reloaded == ferry.state_bytes

    # a full-parameter engine with an optimizer copies everything, unchanged or not
    actor.offload()
    assert ferry.stats.offload_bytes_copied == ferry.stats.last_offload_bytes

    # AReaL's offload-aware context: the outermost one onloads and offloads again at its end; a nested
    # one finds is_offload False (onload() cleared it) and only yields (AReaL's depth stays 1)
    with actor._offload_aware_context():
        assert not actor.is_offload and actor._offload_depth == 1 and ferry.residency is Residency.DEVICE
        with actor._offload_aware_context():
            assert actor._offload_depth == 1 and ferry.residency is Residency.DEVICE
        assert not actor.is_offload and ferry.residency is Residency.DEVICE
    assert actor.is_offload and actor._offload_depth == 0 and ferry.residency is Residency.HOST
    actor.export_stats()  # one of AReaL's callers of that context
    assert actor.is_offload and ferry.residency is Residency.HOST
    _assert_equal(before, snapshot(actor.model, actor.optimizer))  # offloaded tensors read on the host

    # _ensure_ready: train_batch onloads an offloaded engine and leaves it onloaded; the training is
    # bit-identical to an engine of the same seed that was never offloaded
    for engine in (actor, plain):
        engine.train_batch(_batch(10 + rank), _loss, _weight)
    assert not actor.is_offload and ferry.residency is Residency.DEVICE
    _assert_equal(snapshot(plain.model, plain.optimizer), snapshot(actor.model, actor.optimizer))
    assert _kept(actor.model, actor.optimizer) == kept  # the .grads are new: AReaL's zero_grad() dropped them

    # the reference engine: skip_unchanged, so after the first cycle an offload copies nothing
    out = ref.forward_batch(_batch(rank))
    ref_before, ref_ids = snapshot(ref.model), identities(ref.model)
    ref.offload()
    ref_ferry = tf_areal.ferry_for(ref)
    assert ref.is_offload and ref_ferry is not None and ref_ferry.residency is Residency.HOST
    assert ref_ferry.stats.offload_bytes_copied == ref_ferry.stats.last_offload_bytes > 0
    assert torch.equal(ref.forward_batch(_batch(rank)), out)  # _ensure_ready onloaded it
    assert not ref.is_offload and ref_ferry.residency is Residency.DEVICE
    ref.offload()
    assert ref_ferry.stats.offload_bytes_copied == 0 and ref_ferry.stats.last_offload_bytes > 0
    ref.onload()
    _assert_equal(ref_before, snapshot(ref.model))
    assert identities(ref.model) == ref_ids

    # unpatch() brings back an engine offloaded through torchferry ([Note: unpatch() brings the state back])
    ref.offload()
    tf_areal.unpatch()
    assert not tf_areal.is_patched() and tf_areal.ferry_for(actor) is None and tf_areal.ferry_for(ref) is None
    assert not ref.is_offload and ref_ferry.residency is Residency.DEVICE
    _assert_equal(ref_before, snapshot(ref.model))
    assert identities(ref.model) == ref_ids
    assert torch.equal(ref.forward_batch(_batch(rank)), out)  # AReaL's own _ensure_ready: nothing to onload
    for engine in (actor, plain, ref):
        engine.destroy()


def test_patched_offload_onload_round_trip_bit_exact_on_fsdp2_over_two_ranks(model_dir):
    run_spawned(functools.partial(_round_trips_body, path=model_dir), world=2, timeout_s=TIMEOUT_S)


def _patch_body(rank: int, world: int) -> None:
    import inspect

    import torch.distributed as dist
    from torch import nn

    import torchferry.integrations.areal as tf_areal
    from areal.engine import fsdp_engine
    from torchferry import Residency

    cls = fsdp_engine.FSDPEngine
    offload, onload = cls.__dict__["offload"], cls.__dict__["onload"]
    assert "torch_memory_saver.pause()" in inspect.getsource(offload)  # AReaL's own, before any patch

    # idempotent; subclasses inherit the replacements
    names = tf_areal.patch()
    assert names == ["areal.engine.fsdp_engine.FSDPEngine.offload", "areal.engine.fsdp_engine.FSDPEngine.onload"]
    assert tf_areal.patch(skip_unchanged=False) == names and tf_areal.is_patched()
    assert cls.__dict__["offload"] is not offload and cls.__dict__["offload"].__torchferry_original__ is offload
    assert fsdp_engine.FSDPPPOActor.offload is cls.__dict__["offload"]
    assert fsdp_engine.FSDPPPOCritic.onload is cls.__dict__["onload"]

    # AReaL's own class with only the attributes offload/onload read (no cluster, no model files)
    engine = object.__new__(cls)
    engine.is_offload, engine._offload_depth, engine._initialized = False, 0, True
    engine._cpu_group = dist.group.WORLD
    with pytest.raises(RuntimeError, match=r"offload\(\) of an FSDPEngine without a model .*nothing was moved"):
        engine.offload()
    assert not engine.is_offload
    engine.onload()  # never offloaded through torchferry: moves nothing, the flag as AReaL's
    assert not engine.is_offload
    torch.manual_seed(0)
    engine.model, engine.device = nn.Linear(8, 8), torch.device("cpu")
    engine.optimizer = torch.optim.AdamW(engine.model.parameters())
    engine.model(torch.randn(2, 8)).sum().backward()
    engine.optimizer.step()
    before, ids = snapshot(engine.model, engine.optimizer), identities(engine.model, engine.optimizer)
    engine.offload()
    assert engine.is_offload and tf_areal.ferry_for(engine).residency is Residency.HOST
    engine.onload()
    assert not engine.is_offload
    _assert_equal(before, snapshot(engine.model, engine.optimizer))
    assert identities(engine.model, engine.optimizer) == ids
    first = tf_areal.ferry_for(engine)
    engine.model = nn.Linear(8, 8)  # a new model (initialize() again): a new ferry, for it
    engine.optimizer = torch.optim.AdamW(engine.model.parameters())
    assert tf_areal.ferry_for(engine) is None
    engine.offload()
    assert tf_areal.ferry_for(engine) not in (None, first)
    engine.onload()

    # unpatch restores exactly AReaL's functions; idempotent
    tf_areal.unpatch()
    assert cls.__dict__["offload"] is offload and cls.__dict__["onload"] is onload and not tf_areal.is_patched()
    tf_areal.unpatch()
    assert cls.__dict__["offload"] is offload and tf_areal.ferry_for(engine) is None

    # a method whose parameters changed: a clear error and nothing replaced
    def changed_onload(self, tags=None):
        pass

    cls.onload = changed_onload
    try:
        with pytest.raises(RuntimeError, match=r"FSDPEngine\.onload\('self', 'tags'\) does not have the parameters "
                                               r"\('self',\) this integration was written for; AReaL changed"):
            tf_areal.patch()
        assert cls.__dict__["offload"] is offload and cls.__dict__["onload"] is changed_onload
        assert not tf_areal.is_patched()
    finally:
        cls.onload = onload
    del cls.offload  # moved elsewhere: missing from the class
    try:
        with pytest.raises(RuntimeError, match=r"FSDPEngine\.offload is missing; AReaL changed"):
            tf_areal.patch()
        assert cls.__dict__["onload"] is onload and not tf_areal.is_patched()
    finally:
        cls.offload = offload
    with pytest.raises(TypeError, match=r"patch\(skip_unchanged=\.\.\.\) takes None or a bool"):
        tf_areal.patch(skip_unchanged="yes")  # type: ignore[arg-type]
    saved = sys.modules["areal.engine.fsdp_engine"]
    sys.modules["areal.engine.fsdp_engine"] = None  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match=r"torchferry\.integrations\.areal: areal is not importable"):
            tf_areal.patch()
    finally:
        sys.modules["areal.engine.fsdp_engine"] = saved
    assert cls.__dict__["offload"] is offload and cls.__dict__["onload"] is onload and not tf_areal.is_patched()

    # patch(skip_unchanged=True) applies to every engine, one with an optimizer too
    tf_areal.patch(skip_unchanged=True)
    engine.offload()
    engine.onload()
    engine.offload()  # nothing written since the reload: only optimizer state (always copied) is
    stats = tf_areal.ferry_for(engine).stats
    opt_bytes = sum(v.nbytes for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    grad_bytes = sum(p.grad.nbytes for p in engine.model.parameters() if p.grad is not None)
    assert stats.offload_bytes_copied <= opt_bytes + grad_bytes < stats.last_offload_bytes
    engine.onload()
    tf_areal.unpatch()


def test_patch_is_idempotent_unpatch_restores_and_a_changed_method_is_refused(areal_importable):
    run_spawned(_patch_body, world=1, timeout_s=TIMEOUT_S)


def test_only_areals_own_cuda_clear_memory_runs_beside_the_copies(areal_importable):
    """[Note: AReaL's clear_memory() beside the copies]: AReaL's CUDA ``clear_memory`` is split
    around the copies; an override, or another platform's, is called whole (in a subprocess:
    importing areal replaces the logging module's root logger)."""
    code = (
        "from areal.infra.platforms.cuda import CudaPlatform\n"
        "from torchferry.integrations.areal._patch import _clears_as_areal_cuda\n"
        "class Override(CudaPlatform):\n"
        "    def clear_memory(self): pass\n"
        "print(_clears_as_areal_cuda(CudaPlatform()), _clears_as_areal_cuda(Override()), "
        "_clears_as_areal_cuda(object()))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.stdout.split() == ["True", "False", "False"], p.stderr[-2000:]


def _replaced_while_offloaded_body(rank: int, world: int) -> None:
    import gc

    import torch.distributed as dist
    from torch import nn

    import torchferry.integrations.areal as tf_areal
    from areal.engine import fsdp_engine
    from torchferry import Residency
    from torchferry._core._state.host_blocks import in_host_pool

    tf_areal.patch()
    try:
        engine = object.__new__(fsdp_engine.FSDPEngine)
        engine.is_offload, engine._offload_depth, engine._initialized = False, 0, True
        engine._cpu_group = dist.group.WORLD
        torch.manual_seed(0)
        engine.model, engine.device = nn.Linear(8, 8), torch.device("cpu")
        engine.optimizer = torch.optim.AdamW(engine.model.parameters())
        engine.model(torch.randn(2, 8)).sum().backward()
        engine.optimizer.step()
        weights = snapshot(engine.model)
        engine.offload()
        engine.optimizer = torch.optim.AdamW(engine.model.parameters(), lr=0.5)  # replaced while offloaded
        gc.collect()  # the old optimizer, with its state in the pool, is not collected before the onload
        engine.onload()
        assert not engine.is_offload and not any(in_host_pool(p.data_ptr()) for p in engine.model.parameters())
        _assert_equal(weights, snapshot(engine.model))  # the model back, bit-exact
        engine.model(torch.randn(2, 8)).sum().backward()
        engine.optimizer.step()  # the new optimizer's state, made on the device
        state = snapshot(engine.model, engine.optimizer)
        engine.offload()  # a new ferry, for the model and the new optimizer: its state moves too
        ferry = tf_areal.ferry_for(engine)
        assert engine.is_offload and ferry is not None and ferry.residency is Residency.HOST
        assert all(in_host_pool(t.data_ptr()) for s in engine.optimizer.state.values() for t in s.values() if t.dim())
        engine.onload()
        _assert_equal(state, snapshot(engine.model, engine.optimizer))
        engine.offload()  # replaced while offloaded again, then offload() retried instead of onload()
        engine.optimizer = torch.optim.SGD(engine.model.parameters(), lr=0.1, momentum=0.9)
        engine.offload()
        assert engine.is_offload and tf_areal.ferry_for(engine).residency is Residency.HOST
        engine.onload()
        assert not any(in_host_pool(p.data_ptr()) for p in engine.model.parameters())
    finally:
        tf_areal.unpatch()


def test_onload_with_a_replaced_optimizer_brings_the_model_back_and_the_next_offload_moves_the_new_state(
        areal_importable):
    """Reproduces: ``offload(); engine.optimizer = AdamW(...); onload()`` moved nothing, set is_offload False
    and left the model on the host; a retried offload() was refused as "already offloaded by another Ferry"."""
    run_spawned(_replaced_while_offloaded_body, world=1, timeout_s=TIMEOUT_S)


def _stand_in(cls, seed: int):
    """AReaL's own class with only the attributes offload/onload read, trained one step (no cluster)."""
    import torch.distributed as dist
    from torch import nn

    engine = object.__new__(cls)
    engine.is_offload, engine._offload_depth, engine._initialized = False, 0, True
    engine._cpu_group = dist.group.WORLD
    torch.manual_seed(seed)
    engine.model, engine.device = nn.Linear(8, 8), torch.device("cpu")
    engine.optimizer = torch.optim.AdamW(engine.model.parameters())
    engine.model(torch.randn(2, 8)).sum().backward()
    engine.optimizer.step()
    return engine


def _unpatch_brings_back_body(rank: int, world: int) -> None:
    import torchferry.integrations.areal as tf_areal
    from areal.engine import fsdp_engine
    from torchferry import Residency

    cls = fsdp_engine.FSDPEngine
    offload, onload = cls.__dict__["offload"], cls.__dict__["onload"]
    tf_areal.patch()
    engines = [_stand_in(cls, 0), _stand_in(fsdp_engine.FSDPPPOActor, 1)]
    before = [snapshot(e.model, e.optimizer) for e in engines]
    ids = [identities(e.model, e.optimizer) for e in engines]
    for e in engines:
        e.offload()
    ferries = [tf_areal.ferry_for(e) for e in engines]
    assert all(f.residency is Residency.HOST for f in ferries) and all(e.is_offload for e in engines)

    # a reload that fails (the device out of memory): one line, still patched, every engine as it was
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")

    ferries[1].reload = out_of_memory
    with pytest.raises(RuntimeError, match=(
            r"^torchferry.integrations.areal: unpatch\(\) could not bring FSDPPPOActor engine \(\d+ bytes\) back to "
            r"cpu \(RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB\); nothing was unpatched: "
            r"FSDPEngine engine \(\d+ bytes\), FSDPPPOActor engine \(\d+ bytes\) stay offloaded")) as err:
        tf_areal.unpatch()
    assert "\n" not in str(err.value)
    del ferries[1].reload
    assert tf_areal.is_patched() and cls.__dict__["offload"] is not offload
    assert all(f.residency is Residency.HOST for f in ferries) and all(e.is_offload for e in engines)
    assert [tf_areal.ferry_for(e) for e in engines] == ferries

    # room again: unpatch() brings both back, AReaL's own methods are back, the engines train on
    tf_areal.unpatch()
    assert not tf_areal.is_patched() and cls.__dict__["offload"] is offload and cls.__dict__["onload"] is onload
    for e, b, i, f in zip(engines, before, ids, ferries):
        assert not e.is_offload and f.residency is Residency.DEVICE and tf_areal.ferry_for(e) is None
        _assert_equal(b, snapshot(e.model, e.optimizer))
        assert identities(e.model, e.optimizer) == i
        assert all(t.device == torch.device("cpu") for t in snapshot(e.model, e.optimizer).values())
        with e._offload_aware_context():  # AReaL's own: resident, so nothing to onload
            e.model(torch.randn(2, 8)).sum().backward()
        e.optimizer.step()


def test_unpatch_brings_back_what_its_helpers_hold_offloaded(areal_importable):
    """[Note: unpatch() brings the state back]. Reproduces: unpatch() while an engine was offloaded
    through torchferry refused (AReaL's own onload() resumes a torch_memory_saver that paused nothing, so
    it cannot bring the state back); now it brings every engine back, all or nothing."""
    run_spawned(_unpatch_brings_back_body, world=1, timeout_s=TIMEOUT_S)


def _sigint_in_offload_body(rank: int, world: int) -> None:
    import signal

    import torchferry._core._state.parking as parking
    import torchferry.integrations.areal as tf_areal
    from areal.engine import fsdp_engine
    from torchferry import Residency

    tf_areal.patch()
    engine = _stand_in(fsdp_engine.FSDPEngine, 0)
    before = snapshot(engine.model, engine.optimizer)
    real, sent = parking._exchange, []

    def exchange(a, b, dtensor):  # a real Ctrl-C in the middle of each move
        real(a, b, dtensor)
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    parking._exchange = exchange
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.offload()
        assert tf_areal.ferry_for(engine).residency is Residency.HOST and engine.is_offload
        sent.clear()
        with pytest.raises(KeyboardInterrupt):
            engine.onload()
        assert tf_areal.ferry_for(engine).residency is Residency.DEVICE and not engine.is_offload
    finally:
        parking._exchange = real
        signal.signal(signal.SIGINT, previous)
    _assert_equal(before, snapshot(engine.model, engine.optimizer))
    tf_areal.unpatch()


def test_a_sigint_during_the_patched_offload_or_onload_leaves_is_offload_true_to_the_state(areal_importable):
    """A Ctrl-C held during the ferry's move was raised once it was done, before the patched ``offload()`` set
    ``is_offload``: the state on the host with ``is_offload`` False, so AReaL's ``_ensure_ready()`` did not
    onload it. The flag is now set with the move ([Note: the patched offload() keeps AReaL's contract])."""
    run_spawned(_sigint_in_offload_body, world=1, timeout_s=TIMEOUT_S)
