"""torch_memory_saver, as AReaL runs it, in a child process of its own."""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from frameworks_bench.areal import (
    _areal_batch,
    _areal_cycles,
    _areal_engine,
    _areal_loss,
    _areal_state,
    _areal_summary,
    _areal_weight,
)
from frameworks_bench.common import (
    _T0,
    ROOT,
    SCRIPT,
    _compare,
    _error,
    _free_port,
    _merge_compares,
    _snapshot,
    _tail,
    _version,
    say,
)
from frameworks_bench.context import Run
from frameworks_bench.imports import import_areal


# --------------------------------------------------------------------------------------------- torch_memory_saver
def _loaded_lib_dirs(names: tuple[str, ...]) -> list[str]:
    """Folders of the shared libraries this process has loaded whose file name starts with one of ``names``."""
    dirs: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                base = os.path.basename(path)
                if any(base.startswith(n) for n in names):
                    d = os.path.dirname(path)
                    if d not in dirs:
                        dirs.append(d)
    except OSError:
        pass
    return dirs


def tms_preload_library() -> tuple[str | None, dict]:
    """The preload hook for this torch's CUDA major, or ``None`` and why; with what AReaL itself would preload."""
    info: dict = {"version": _version("torch_memory_saver")}
    if info["version"] is None:
        return None, {**info, "reason": "torch_memory_saver is not installed (pip install --no-deps "
                                        "torch_memory_saver; a cp39-abi3 wheel with _cu12 and _cu13 builds)"}
    try:
        import torch_memory_saver as tms
        from torch_memory_saver.utils import get_binary_path_from_package

        path = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    except Exception as e:
        return None, {**info, "reason": f"torch_memory_saver's preload hook cannot be found: {_error(e)}"}
    areal_path = os.path.join(os.path.dirname(os.path.dirname(tms.__file__)),
                              "torch_memory_saver_hook_mode_preload.abi3.so")
    info["areal_get_tms_env_vars_would_preload"] = areal_path if os.path.exists(areal_path) else None
    info["preload"] = path
    return path, info


def run_tms_child(run: Run, model_dir: Path) -> dict:
    """AReaL's own offload()/onload() under torch_memory_saver (LD_PRELOAD from process start) in a child."""
    if not run.cuda:
        return {"reason": "no CUDA: AReaL's own offload() needs torch_memory_saver, which pauses CUDA allocations "
                          "(it raises RuntimeError without TMS_INIT_ENABLE=1)"}
    if run.args.skip_tms:
        return {"reason": "--skip-tms"}
    lib, info = tms_preload_library()
    if lib is None:
        return info
    lib_dirs = _loaded_lib_dirs(("libcudart.so", "libcuda.so"))
    env = dict(os.environ)
    env.update(LD_PRELOAD=lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else ""),
               TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env["LD_LIBRARY_PATH"] = ":".join(lib_dirs + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    env["PYTHONPATH"] = ":".join([str(ROOT / "src"), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    if "expandable_segments:True" in env.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        env.pop("PYTORCH_CUDA_ALLOC_CONF")  # torch_memory_saver refuses expandable segments
    timeout = min(run.args.tms_timeout_s, run.args.budget_s - (time.perf_counter() - _T0) - 15)
    if timeout < 60:
        return {**info, "reason": f"not run: {timeout:.0f} s of --budget-s {run.args.budget_s:.0f} left for it "
                                  "(at least 60 s needed)"}
    out_json = Path(tempfile.mkdtemp(prefix="tf_tms_")) / "child.json"
    cmd = [sys.executable, str(SCRIPT), "--_tms-child", str(out_json), "--model-dir", str(model_dir),
           "--preset", run.args.preset, "--cycles", str(run.args.cycles), "--warmup", str(run.args.warmup),
           "--gap-s", str(run.args.gap_s), "--areal-seq-len", str(run.args.areal_seq_len)]
    if run.args.layers is not None:
        cmd += ["--layers", str(run.args.layers)]
    info.update(env={k: env[k] for k in ("LD_PRELOAD", "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP")},
                ld_library_path_added=lib_dirs, hook_mode="preload")
    say(f"areal: AReaL's own offload/onload under torch_memory_saver, in a child process (LD_PRELOAD={lib})")
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {**info, "reason": f"the torch_memory_saver child ran past its {timeout:.0f} s (--tms-timeout-s, "
                                  "--budget-s)", "stderr_tail": _tail(err)}
    info["child_s"] = time.perf_counter() - t
    info["returncode"] = p.returncode
    child = None
    if out_json.exists():
        try:
            child = json.loads(out_json.read_text())
        except ValueError:
            child = None
    shutil.rmtree(out_json.parent, ignore_errors=True)
    info["stderr_tail"] = _tail(p.stderr, 2000)
    if child is None or not (child.get("actor") or child.get("ref")):
        why = (child or {}).get("error") or f"the child exited {p.returncode} without results"
        say(f"areal: the torch_memory_saver child failed: {why.splitlines()[0][:300]}")
        return {**info, "reason": f"AReaL's own offload/onload under torch_memory_saver failed: {_tail(why, 1500)}",
                **({"partial": child} if child else {})}
    if child.get("error"):  # the actor ran, the reference engine did not
        run.flags.append(f"areal.unpatched: the torch_memory_saver child failed part-way: "
                         f"{child['error'].splitlines()[0][:300]}")
    info["child"] = {k: v for k, v in child.items() if k not in ("actor", "ref")}
    result: dict = info
    for role in ("actor", "ref"):
        raw = child.get(role)
        if not raw:
            continue
        s = _areal_summary(run, raw)
        s["bit_exact"] = raw.get("bit_exact")
        s["bytes_note"] = ("bytes = GPU memory the pause released (cudaMemGetInfo before/after): every allocation "
                           "torch_memory_saver hooked is backed up to the host and unmapped, free blocks included")
        s["state_bytes"] = raw["offload"][0].get("state_bytes") if raw["offload"] else None
        warm = raw["offload"][run.args.warmup:] or raw["offload"]
        if warm and s["state_bytes"]:
            med = statistics.median(x["s"] for x in warm)
            s["state_frac_of_peak"] = s["state_bytes"] / med / 1e9 / run.peak["d2h"] if run.peak and med else None
        freed = [x.get("gpu_freed_bytes") or 0 for x in raw["offload"]]
        if s["state_bytes"] and max(freed) < 0.5 * s["state_bytes"]:
            run.flags.append(f"areal.unpatched.{role}: torch_memory_saver's pause released {max(freed)} bytes of "
                             f"{s['state_bytes']} state bytes: the preload hook may not see PyTorch's allocations")
        result[role] = s
    return result


def tms_child_main(args) -> None:
    """In the child: AReaL's own offload()/onload() (torch_memory_saver), an actor, then a reference engine."""
    out: dict = {"pid": os.getpid(), "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
                 "TMS_INIT_ENABLE": os.environ.get("TMS_INIT_ENABLE")}
    try:
        from torchferry.bench._common.setup import init_distributed
        from torchferry.bench._common.units import reshard

        cuda = torch.cuda.is_available()
        _, _, device = init_distributed(cuda)
        fsdp_engine, stub = import_areal()
        from areal.utils.offload import is_tms_enabled

        out.update(tms_enabled=is_tms_enabled(), ray_stub=stub, torch=torch.__version__, cuda=torch.version.cuda)
        src = fsdp_engine.FSDPEngine.offload
        out["offload_is_areals"] = not hasattr(src, "__torchferry_original__")
        torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)))
        seq = args.areal_seq_len
        for role, lr, seed in (("actor", 1e-5, 0), ("ref", None, 1)):
            say(f"tms child: {role}")
            engine = _areal_engine(args.model_dir, cuda, lr, seed=seed)
            batch = None
            if lr is not None:
                engine.train_batch(_areal_batch(seq, 0), _areal_loss, _areal_weight)
            else:
                batch = _areal_batch(seq, 1)
            host = _snapshot(_areal_state(engine), device=torch.device("cpu"))  # off the GPU: the pause takes it all
            raw = _areal_cycles(args, device, engine, fsdp_engine, mode="tms", snap=None, batch=batch)
            reshard(engine.model)  # the root stays unsharded after the last forward_batch
            raw["bit_exact"] = _merge_compares([_compare(host, _areal_state(engine), host_snapshot=True)])
            raw["bit_exact"]["note"] = "compared once, after the last cycle, against host copies"
            out[role] = raw
            del host
            engine.destroy()
            del engine
            gc.collect()
    except BaseException as e:  # the parent reports it
        out["error"] = f"{_error(e)}\n{traceback.format_exc()}"
    Path(args._tms_child).write_text(json.dumps(out))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown under the preload hook
