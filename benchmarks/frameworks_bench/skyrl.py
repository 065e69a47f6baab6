"""SkyRL's own offload functions, unpatched and patched."""

from __future__ import annotations

import torch

from frameworks_bench.common import (
    FSDP_UTILS,
    LAST_RELEASE_S,
    SKYRL_OPS,
    _combine,
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
from frameworks_bench.context import Run, _cpu_current_device, _cycles, _pinned_cache_bytes, _release_host
from frameworks_bench.imports import import_skyrl_fsdp_utils


# --------------------------------------------------------------------------------------------- SkyRL
def _skyrl_models(run: Run, with_optimizer: bool, seed: int):
    from torchferry.bench._common.model import build_model
    from torchferry.bench._common.setup import shard_fsdp2
    from torchferry.bench._common.units import reshard

    model = build_model(run.args.preset, run.device, layers=run.args.layers, seed=seed)
    shard_fsdp2(model, run.device, 1)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, run.args.seq_len), generator=g).to(run.device)
    opt = None
    if with_optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(input_ids=ids)
        reshard(model)
    return model, opt, ids


def _train_step(model, opt, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _skyrl_full_cycles(run: Run, fu, model, opt, ids, patched: bool, tf_skyrl) -> dict:
    """Offload model, offload optimizer, (gap), load model, load optimizer; each timed; compared with the
    state before the offload; then one training step (untimed), so that every offload follows a step
    and moves state the step wrote, as SkyRL's after a policy update."""
    dev = run.device
    device_id = torch.cuda.current_device() if run.cuda else "cpu"
    samples: dict[str, list[dict]] = {op: [] for op in SKYRL_OPS}
    compares, freed = [], []
    ids0 = _identities(model, opt)
    ids_kept = True
    with _cpu_current_device(run.cuda):
        for _ in range(_cycles(run.args)):
            before = _state_tensors(model, opt)
            snap = _snapshot(before)
            model_bytes = _device_bytes({k: v for k, v in before.items() if not k.startswith("opt.")}, dev)
            opt_bytes = _device_bytes({k: v for k, v in before.items() if k.startswith("opt.")}, dev)
            free0 = _gpu_free(dev)
            s_om = _timed(dev, lambda: fu.offload_fsdp2_model_to_cpu(model, empty_cache=True))
            r_om = LAST_RELEASE_S[0]
            s_oo = _timed(dev, lambda: fu.offload_fsdp_optimizer(opt))
            r_oo = LAST_RELEASE_S[0]
            if run.cuda:
                torch.cuda.empty_cache()  # as SkyRL's FSDPStrategy.offload_to_cpu does after the helpers
            free1 = _gpu_free(dev)
            run.gap()
            s_lm = _timed(dev, lambda: fu.load_fsdp2_model_to_gpu(model))
            r_lm = LAST_RELEASE_S[0]
            s_lo = _timed(dev, lambda: fu.load_fsdp_optimizer(opt, device_id))
            r_lo = LAST_RELEASE_S[0]
            after = _state_tensors(model, opt)
            compares.append(_compare(snap, after))
            del snap, before, after
            ids_kept = ids_kept and _identities(model, opt) == ids0
            _train_step(model, opt, ids)
            if free0 is not None and free1 is not None:
                freed.append(free1 - free0)
            rec = {"offload_model": (s_om, model_bytes), "offload_optimizer": (s_oo, opt_bytes),
                   "load_model": (s_lm, model_bytes), "load_optimizer": (s_lo, opt_bytes)}
            released = {"offload_model": r_om, "offload_optimizer": r_oo, "load_model": r_lm, "load_optimizer": r_lo}
            if patched:
                fm, fo = tf_skyrl.ferry_for(model), tf_skyrl.ferry_for(opt)
                for f in (fm, fo):
                    if f is not None and f.last_handle is not None:
                        f.last_handle.done()  # completes the stats of a handle already synchronised
                for op, f in (("offload_model", fm), ("offload_optimizer", fo)):
                    st = f.stats
                    samples[op].append({"s": rec[op][0], "bytes": st.offload_bytes_copied,
                                        "state_bytes": st.last_offload_bytes, "copied_bytes": st.offload_bytes_copied,
                                        "release_s": released[op]})
                for op, f in (("load_model", fm), ("load_optimizer", fo)):
                    st = f.stats
                    samples[op].append({"s": rec[op][0], "bytes": st.last_reload_bytes,
                                        "copy_engine_s": st.last_reload_s, "release_s": released[op]})
            else:
                for op, (s, b) in rec.items():
                    samples[op].append({"s": s, "bytes": b, "copied_bytes": b if op.startswith("offload") else None,
                                        "release_s": released[op]})
    w = run.args.warmup
    out: dict = {"ops": {op: summarise(samples[op], run.peak_of(op), w) for op in SKYRL_OPS}}
    out["ops"]["offload"] = summarise(_combine([samples["offload_model"], samples["offload_optimizer"]]),
                                      run.peak_of("offload"), w)
    out["ops"]["load"] = summarise(_combine([samples["load_model"], samples["load_optimizer"]]), run.peak_of("load"), w)
    out["bit_exact"] = _merge_compares(compares)
    out["identities_kept"] = ids_kept
    out["gpu_freed_bytes_by_offload"] = freed
    return out


def _skyrl_forward_only_cycles(run: Run, fu, model, ids, snap, patched: bool, tf_skyrl) -> dict:
    """Offload, (gap), load, a forward (then FSDP2's reshard(): the root stays unsharded after a
    forward, and its transient unsharded copies are no state to offload)."""
    from torchferry.bench._common.units import reshard

    dev = run.device
    off, load, copied, compares, out_equal = [], [], [], [], []
    with torch.no_grad():
        ref_out = model(input_ids=ids).logits.detach().clone()
    reshard(model)
    with _cpu_current_device(run.cuda):
        for _ in range(_cycles(run.args)):
            nbytes = _device_bytes(_state_tensors(model), dev)
            s_off = _timed(dev, lambda: fu.offload_fsdp2_model_to_cpu(model, empty_cache=True))
            run.gap()
            s_on = _timed(dev, lambda: fu.load_fsdp2_model_to_gpu(model))
            compares.append(_compare(snap, _state_tensors(model)))
            with torch.no_grad():  # the forward between cycles (no weight change)
                out_equal.append(bool(torch.equal(model(input_ids=ids).logits, ref_out)))
            reshard(model)
            if patched:
                f = tf_skyrl.ferry_for(model)
                if f.last_handle is not None:
                    f.last_handle.done()
                st = f.stats
                c = st.offload_bytes_copied
                off.append({"s": s_off, "bytes": c, "copied_bytes": c, "state_bytes": st.last_offload_bytes})
                load.append({"s": s_on, "bytes": st.last_reload_bytes})
            else:
                c = nbytes  # model.to("cpu") copies every storage
                off.append({"s": s_off, "bytes": c, "copied_bytes": c, "state_bytes": nbytes})
                load.append({"s": s_on, "bytes": nbytes})
            copied.append(c)
    res = {"ops": {"offload_model": summarise(off, run.peak_of("offload"), run.args.warmup),
                   "load_model": summarise(load, run.peak_of("load"), run.args.warmup)},
           "offload_bytes_copied": copied,
           "copies_nothing_after_first": all(c == 0 for c in copied[1:]) if len(copied) > 1 else None,
           "bit_exact": _merge_compares(compares), "forward_outputs_equal": all(out_equal)}
    if patched:
        f = tf_skyrl.ferry_for(model)
        res["ferry_skip_unchanged"] = getattr(getattr(f, "_set", None), "unchanged", None) is not None
        res["ferry"] = repr(f)
    return res


def run_skyrl(run: Run, res: dict) -> dict:
    """Fills ``res`` as it goes (what ran before a failure stays in the JSON)."""
    res["available"] = False
    try:
        fu, how = import_skyrl_fsdp_utils()
        import torchferry.integrations.skyrl as tf_skyrl
    except Exception as e:
        res["reason"] = f"SkyRL's fsdp_utils does not import here: {_error(e)}"
        say(f"skyrl: skipped ({res['reason'][:200]})")
        return res
    res.update(available=True, version=_version("skyrl"))
    res["import"] = how
    res["functions"] = [f"{FSDP_UTILS}.{n}" for n in ("offload_fsdp2_model_to_cpu", "offload_fsdp_optimizer",
                                                     "load_fsdp2_model_to_gpu", "load_fsdp_optimizer")]
    if not run.cuda:
        res["cpu_stand_ins"] = ["torch.cuda.current_device() answers 'cpu' around SkyRL's own load helpers"]
    tf_skyrl.unpatch()
    # ---- full state: model + AdamW
    say("skyrl: building the model and one training step")
    model, opt, ids = _skyrl_models(run, with_optimizer=True, seed=0)
    t = _state_tensors(model, opt)
    res["state_bytes"] = {"model": _device_bytes({k: v for k, v in t.items() if not k.startswith("opt.")}, run.device),
                          "optimizer": _device_bytes({k: v for k, v in t.items() if k.startswith("opt.")}, run.device)}
    del t
    paths: dict = {}
    res["paths"] = paths
    say("skyrl: SkyRL's own helpers")
    paths["unpatched"] = _skyrl_full_cycles(run, fu, model, opt, ids, False, tf_skyrl)
    paths["unpatched"]["pinned_host_bytes"] = _pinned_cache_bytes(run.cuda)
    _release_host(run.cuda)
    say("skyrl: patched")
    paths["patched"] = {"patched": tf_skyrl.patch(import_call_sites=False)}
    try:
        paths["patched"].update(_skyrl_full_cycles(run, fu, model, opt, ids, True, tf_skyrl))
        fm, fo = tf_skyrl.ferry_for(model), tf_skyrl.ferry_for(opt)
        paths["patched"]["ferries"] = [repr(fm), repr(fo)]
        paths["patched"]["pinned_host_bytes"] = sum(f.pinned_bytes for f in (fm, fo))
        paths["patched"]["ferry_state_bytes"] = {"model": fm.state_bytes, "optimizer": fo.state_bytes}
        del fm, fo  # their pools go with the model
    finally:
        tf_skyrl.unpatch()
    del model, opt, ids
    _release_host(run.cuda)

    # ---- forward-only: a reference model, no optimizer, a forward between cycles
    say("skyrl: forward-only model")
    ref, _, ids = _skyrl_models(run, with_optimizer=False, seed=1)
    snap = _snapshot(_state_tensors(ref))
    fo_res: dict = {"state_bytes": _device_bytes(_state_tensors(ref), run.device)}
    res["forward_only"] = fo_res
    fo_res["unpatched"] = _skyrl_forward_only_cycles(run, fu, ref, ids, snap, False, tf_skyrl)
    _release_host(run.cuda)
    tf_skyrl.patch(import_call_sites=False)
    try:
        fo_res["patched"] = _skyrl_forward_only_cycles(run, fu, ref, ids, snap, True, tf_skyrl)
    finally:
        tf_skyrl.unpatch()
    del ref, snap, ids
    _release_host(run.cuda)
    return res
