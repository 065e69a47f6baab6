"""AReaL's FSDP engine's offload()/onload(), unpatched and patched."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from frameworks_bench.common import (
    LAST_RELEASE_S,
    _compare,
    _device_bytes,
    _error,
    _gpu_free,
    _identities,
    _merge_compares,
    _snapshot,
    _state_tensors,
    _timed,
    _version,
    say,
    summarise,
)
from frameworks_bench.context import Run, _release_host
from frameworks_bench.imports import import_areal


# --------------------------------------------------------------------------------------------- AReaL
def write_model_dir(path: Path, preset: str, layers: int | None) -> None:
    """A Qwen2 config at the preset's sizes and a word-level tokenizer: what FSDPEngine loads from ``path``
    with ``init_from_scratch=True`` (the weights are random; no download)."""
    import dataclasses

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    from torchferry.bench._common.presets import PRESETS

    sizes = dataclasses.asdict(PRESETS[preset])
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    cfg = Qwen2Config(**sizes, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(62)} | {"<unk>": 62, "<eos>": 63}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # pyright: ignore[reportAttributeAccessIssue]
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


def _areal_engine(path: str, cuda: bool, lr: float | None, seed: int):
    """AReaL's FSDPEngine as its trainer builds one (an optimizer when ``lr``, else forward-only)."""
    from areal.api.cli_args import OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    config = TrainEngineConfig(experiment_name="torchferry", trial_name="frameworks", path=path, attn_impl="sdpa",
                               init_from_scratch=True, backend="fsdp:d1",
                               dtype="bfloat16" if cuda else "float32", optimizer_dtype="float32",
                               optimizer=None if lr is None else OptimizerConfig(lr=lr))
    engine = FSDPEngine(config)
    engine.create_process_group()
    torch.manual_seed(seed)
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2))
    return engine


def _areal_batch(seq: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, seq, dtype=torch.bool)
    mask[1, seq * 2 // 3:] = False
    return {"input_ids": torch.randint(0, 62, (2, seq), generator=g), "attention_mask": mask}


def _areal_loss(logprobs, entropy, mb_input, **kwargs):
    return -logprobs.sum()


def _areal_weight(mb_input):
    return torch.tensor(float(mb_input["input_ids"].numel()), device=mb_input["input_ids"].device)


def _areal_state(engine) -> dict:
    return _state_tensors(engine.model, getattr(engine, "optimizer", None))


def _areal_cycles(run_args, device, engine, fsdp_engine, *, mode: str, snap: dict | None, batch=None,
                  tf_areal=None) -> dict:
    """``offload()``, (gap), ``onload()``, each timed; ``forward_batch`` between cycles for a reference
    engine (``batch``). ``mode``: "patched" (bytes from the ferry's stats) or "tms" (AReaL's own
    methods under torch_memory_saver: bytes = GPU memory the pause released, which it backed up)."""
    import torch.distributed as dist

    platform = fsdp_engine.current_platform
    off, on, compares, out_equal = [], [], [], []
    ref_out = None
    if batch is not None:
        ref_out = engine.forward_batch(batch).detach().clone()
    for _ in range(run_args.warmup + run_args.cycles):
        state_bytes = _device_bytes(_areal_state(engine), device)
        platform.clear_memory()  # what offload() does first; here too so that the reserved figure is the pause's
        reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else None
        free0 = _gpu_free(device)
        s_off = _timed(device, engine.offload)
        r_off = LAST_RELEASE_S[0]
        free1 = _gpu_free(device)
        freed = None if free0 is None or free1 is None else free1 - free0
        if run_args.gap_s > 0:
            time.sleep(run_args.gap_s)
        s_on = _timed(device, engine.onload)
        # AReaL's offload() besides the move: clear_memory (gc.collect, empty_cache), synchronize,
        # a barrier, two memory-stats logs; timed alone, with the state resident.
        ovh = _timed(device, lambda: (platform.clear_memory(), platform.synchronize(),
                                      dist.barrier(group=engine.cpu_group),
                                      engine.get_device_stats().log("torchferry frameworks: overhead probe")))
        if mode == "patched":
            f = tf_areal.ferry_for(engine)
            if f.last_handle is not None:
                f.last_handle.done()  # completes the stats of the reload (onload() synchronised)
            st = f.stats
            off.append({"s": s_off, "bytes": st.offload_bytes_copied, "copied_bytes": st.offload_bytes_copied,
                        "state_bytes": st.last_offload_bytes, "gpu_freed_bytes": freed, "overhead_s": ovh,
                        "copy_engine_s": st.last_offload_s, "release_s": r_off})
            on.append({"s": s_on, "bytes": st.last_reload_bytes, "copy_engine_s": st.last_reload_s})
        else:
            moved = freed if freed and freed > 0 else 0
            off.append({"s": s_off, "bytes": moved, "copied_bytes": moved, "state_bytes": state_bytes,
                        "gpu_freed_bytes": freed, "reserved_bytes": reserved, "overhead_s": ovh, "release_s": r_off})
            on.append({"s": s_on, "bytes": moved})
        if snap is not None and mode == "patched":
            compares.append(_compare(snap, _areal_state(engine)))
        if batch is not None:
            out_equal.append(bool(torch.equal(engine.forward_batch(batch), ref_out)))
    return {"offload": off, "onload": on, "compares": compares,
            "forward_outputs_equal": all(out_equal) if out_equal else None}


def _areal_summary(run: Run, raw: dict) -> dict:
    out = {"ops": {"offload": summarise(raw["offload"], run.peak_of("offload"), run.args.warmup),
                   "onload": summarise(raw["onload"], run.peak_of("load"), run.args.warmup)}}
    if raw.get("forward_outputs_equal") is not None:
        out["forward_outputs_equal"] = raw["forward_outputs_equal"]
    copied = [s.get("copied_bytes") for s in raw["offload"]]
    out["offload_bytes_copied"] = copied
    out["copies_nothing_after_first"] = all(c == 0 for c in copied[1:]) if len(copied) > 1 else None
    return out


def run_areal(run: Run, res: dict, workdir: Path) -> dict:
    """Fills ``res`` as it goes (what ran before a failure stays in the JSON)."""
    from frameworks_bench.tms import run_tms_child  # tms uses this module's engine helpers

    res["available"] = False
    try:
        fsdp_engine, stub = import_areal()
        import torchferry.integrations.areal as tf_areal
    except Exception as e:
        res["reason"] = f"areal.engine.fsdp_engine does not import here: {_error(e)}"
        say(f"areal: skipped ({res['reason'][:200]})")
        return res
    res.update(available=True, version=_version("areal"),
               ray="stand-in (benchmarks/verl_raystub)" if stub else "installed",
               functions=["areal.engine.fsdp_engine.FSDPEngine.offload", "areal.engine.fsdp_engine.FSDPEngine.onload"])
    model_dir = workdir / "areal_model"
    write_model_dir(model_dir, run.args.preset, run.args.layers)
    res["model_dir"] = "a Qwen2 config at the preset's sizes and a 64-token word-level tokenizer (init_from_scratch)"
    seq = run.args.areal_seq_len
    paths: dict = {}
    res["paths"] = paths
    names = tf_areal.patch()
    try:
        say("areal: building the actor (with optimizer) and one train_batch")
        actor = _areal_engine(str(model_dir), run.cuda, 1e-5, seed=0)
        actor.train_batch(_areal_batch(seq, 0), _areal_loss, _areal_weight)
        t = _areal_state(actor)
        res["state_bytes"] = {
            "model": _device_bytes({k: v for k, v in t.items() if not k.startswith("opt.")}, run.device),
            "optimizer": _device_bytes({k: v for k, v in t.items() if k.startswith("opt.")}, run.device),
            "grads_included": any(k.endswith(".grad") for k in t)}
        snap = _snapshot(t)
        ids0 = _identities(actor.model, actor.optimizer)
        del t
        say("areal: patched offload/onload (actor)")
        raw = _areal_cycles(run.args, run.device, actor, fsdp_engine, mode="patched", snap=snap, tf_areal=tf_areal)
        p = _areal_summary(run, raw)
        p["bit_exact"] = _merge_compares(raw["compares"])
        p["identities_kept"] = _identities(actor.model, actor.optimizer) == ids0
        f = tf_areal.ferry_for(actor)
        p["ferry"] = repr(f)
        p["pinned_host_bytes"] = f.pinned_bytes
        p["patched"] = names
        paths["patched"] = p
        del snap, f
        actor.destroy()
        del actor
        _release_host(run.cuda)

        say("areal: patched offload/onload (forward-only reference engine)")
        ref = _areal_engine(str(model_dir), run.cuda, None, seed=1)
        snap = _snapshot(_areal_state(ref))
        raw = _areal_cycles(run.args, run.device, ref, fsdp_engine, mode="patched", snap=snap,
                            batch=_areal_batch(seq, 1), tf_areal=tf_areal)
        fo = _areal_summary(run, raw)
        fo["bit_exact"] = _merge_compares(raw["compares"])
        f = tf_areal.ferry_for(ref)
        fo["ferry_skip_unchanged"] = getattr(getattr(f, "_set", None), "unchanged", None) is not None
        fo["ferry"] = repr(f)
        fo["state_bytes"] = f.state_bytes
        res["forward_only"] = {"patched": fo}
        del snap, f
        ref.destroy()
        del ref
    finally:
        tf_areal.unpatch()
    _release_host(run.cuda)
    if run.cuda:
        torch.cuda.empty_cache()
    # ---- AReaL's own offload()/onload(): torch_memory_saver, in a child process
    tms = run_tms_child(run, model_dir)
    why = tms.get("reason") or "the child did not get to it (torch_memory_saver.child.error)"
    res["paths"]["unpatched"] = tms.pop("actor", None) or {"skipped": why}
    res.setdefault("forward_only", {})["unpatched"] = tms.pop("ref", None) or {"skipped": why}
    res["torch_memory_saver"] = tms
    return res
