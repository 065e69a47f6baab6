#!/usr/bin/env python3
"""SkyRL's and AReaL's own offload/onload functions, unpatched and patched with torchferry, on the
same model in one run: seconds, bytes, the fraction of the same run's link peak, bit-exactness.

    PYTHONPATH=src python benchmarks/frameworks.py --preset qwen2.5-1.5b --json OUT.json
    PYTHONPATH=src python benchmarks/frameworks.py --tiny --json OUT.json    # the CPU check (gloo)

One process, world size 1, FSDP2 (``fully_shard`` on a 1-rank process group: NCCL on a GPU,
gloo on the CPU). In order:

1. the link peak: pinned 1 GiB copies, H2D and D2H (``torchferry.bench._common.link``);
2. SkyRL 0.4.0 (``skyrl.backends.skyrl_train.distributed.fsdp_utils``, called as module
   attributes, as its ``FSDPStrategy.offload_to_cpu`` / ``backload_to_gpu`` call them): the preset
   (fp32 parameters, bf16 compute, the bench's FSDP2 units) with AdamW after one training step;
   ``offload_fsdp2_model_to_cpu``, ``offload_fsdp_optimizer``, ``load_fsdp2_model_to_gpu``,
   ``load_fsdp_optimizer`` each timed (synchronised before and after: the seed's copies are
   ``non_blocking``), first cycle apart from the warm ones; SkyRL's own helpers first, then the
   same model with ``torchferry.integrations.skyrl.patch()``. Then a forward-only model (no
   optimizer, a reference model) with a forward between cycles, both ways: bytes copied per offload;
3. AReaL 1.0.4 (``areal.engine.fsdp_engine.FSDPEngine``, built from a saved config and tokenizer
   with ``init_from_scratch=True``, trained one ``train_batch``): ``offload()`` / ``onload()`` with
   ``torchferry.integrations.areal.patch()``, an actor (with optimizer) and a reference engine (no
   optimizer, ``forward_batch`` between cycles). AReaL's own methods need torch_memory_saver with
   its ``LD_PRELOAD`` hook from process start (``TMS_INIT_ENABLE=1``,
   ``TMS_INIT_ENABLE_CPU_BACKUP=1``, as AReaL's launchers set them): they run in a child process
   of this script (``--_tms-child``) when the hook can be found; otherwise, and when the child
   fails, the JSON says why;
4. one JSON (schema ``torchferry.frameworks/1``) and a table.

Bit-exact: every parameter shard, ``.grad``, buffer and optimizer-state tensor is cloned before the
cycles and compared bitwise (``torch.equal`` of the bytes) after every reload (the child compares
once, after its last cycle, against host copies). ``frac_of_peak`` is bytes / seconds / the peak
of the direction (D2H for offloads, H2D for loads); it is reported raw, and any value above 1.0 is
flagged in ``flags``. Without a GPU the seconds are Python overhead: transfer rates are null.

Not SkyRL/AReaL: where ``ray`` is not installed, ``benchmarks/verl_raystub`` stands in for it
(AReaL's modules import it; nothing here uses it). On Python < 3.12, where SkyRL's
``skyrl.backends`` package ``__init__`` (the Tinker engine backend) fails to import, the package is
registered bare and only SkyRL's own ``fsdp_utils`` module is run (recorded in the JSON). On the
CPU, SkyRL's ``load_*`` helpers call ``torch.cuda.current_device()``, which is made to answer
``"cpu"`` around the unpatched calls.
"""


from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frameworks_bench.areal import run_areal  # noqa: E402
from frameworks_bench.common import _T0, SCHEMA, _error, _free_port, _version, say  # noqa: E402
from frameworks_bench.context import Run, _release_host  # noqa: E402
from frameworks_bench.report import _checks, _flag_over_peak, _settle_peak, print_table  # noqa: E402
from frameworks_bench.skyrl import run_skyrl  # noqa: E402
from frameworks_bench.tms import tms_child_main  # noqa: E402
from frameworks_bench.common import summarise  # noqa: E402, F401  # tests/cpu/test_bench_frameworks.py reads it here


# --------------------------------------------------------------------------------------------- main
def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="a torchferry.bench preset (default qwen2.5-1.5b; tiny with --tiny)")
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset and short inputs (the CPU check)")
    ap.add_argument("--cycles", type=int, default=3, help="timed cycles after the warm-up (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, help="first cycles, reported apart (default %(default)s)")
    ap.add_argument("--gap-s", type=float, default=None,
                    help="idle seconds between offload and reload (a rollout's place; 1 on a GPU, 0 on the CPU)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens of the SkyRL models' inputs")
    ap.add_argument("--areal-seq-len", type=int, default=None, help="tokens per sequence of AReaL's batches")
    ap.add_argument("--frameworks", default="skyrl,areal", help="comma-separated: skyrl, areal")
    ap.add_argument("--skip-tms", action="store_true", help="do not run AReaL's own methods (torch_memory_saver child)")
    ap.add_argument("--tms-timeout-s", type=float, default=150.0, help="limit for the torch_memory_saver child")
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="the child gets at most what is left of this since the start (default %(default)s)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_tms-child", dest="_tms_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.preset is None:
        args.preset = "tiny" if args.tiny else "qwen2.5-1.5b"
    if args.seq_len is None:
        args.seq_len = 16 if args.tiny else 256
    if args.areal_seq_len is None:
        args.areal_seq_len = 6 if args.tiny else 64
    if args.cycles < 1 or args.warmup < 0:
        ap.error("--cycles must be >= 1 and --warmup >= 0")
    return args


def _command(argv: list[str]) -> str:
    try:
        script = str(Path(__file__).resolve().relative_to(Path.cwd()))
    except ValueError:
        script = str(Path(__file__).resolve())
    return " ".join(["python", script, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args._tms_child:
        if args.gap_s is None:
            args.gap_s = 1.0
        tms_child_main(args)
        return 0
    from torchferry.bench._common.setup import env_record, init_distributed

    use_cuda = torch.cuda.is_available()
    if not use_cuda and args.preset != "tiny":
        print(f"error: preset {args.preset!r} needs a GPU; on a machine without CUDA use --tiny", file=sys.stderr)
        return 2
    if args.gap_s is None:
        args.gap_s = 1.0 if use_cuda else 0.0
    _, world, device = init_distributed(use_cuda)
    env = env_record(device, world)
    env["command"] = _command(argv)
    env.update(python=sys.version.split()[0], transformers=_version("transformers"), skyrl=_version("skyrl"),
               areal=_version("areal"), torch_memory_saver=_version("torch_memory_saver"),
               cuda=torch.version.cuda)
    peak = None
    if use_cuda:
        from torchferry.bench._common.link import measure_link_peak

        say("link peak")
        lp = measure_link_peak(device)
        peak = {"h2d": lp.h2d, "d2h": lp.d2h, "bidir": lp.bidir, "nbytes": lp.nbytes}
    run = Run(args, device, peak)
    result: dict = {
        "schema": SCHEMA,
        "env": env,
        "config": {"preset": args.preset, "layers": args.layers, "tiny": args.tiny, "warmup_cycles": args.warmup,
                   "timed_cycles": args.cycles, "gap_s": args.gap_s, "seq_len": args.seq_len,
                   "areal_seq_len": args.areal_seq_len, "world_size": world,
                   "skyrl_model": "Qwen2 at the preset's sizes, random init, fp32 parameters, FSDP2 units as "
                                  "torchferry.bench (each decoder layer, the root; bf16 compute), AdamW after one step",
                   "areal_engine": "FSDPEngine(init_from_scratch=True, optimizer_dtype=float32, dtype=bfloat16 on a "
                                   "GPU / float32 on the CPU, attn_impl=sdpa, backend fsdp:d1), one train_batch"},
        "units": "seconds from the call until its copies are complete (synchronised before and after); bytes moved; "
                 "GB/s = 1e9 B/s; frac_of_peak = bytes / median warm seconds / the link peak of the direction "
                 "(D2H for offloads, H2D for loads), reported raw; first = the first cycle, apart from the warm ones",
        "link_peak_GBps": peak,
        "link_peak_note": "fastest of 5 bursts of 4 pinned 1 GiB copies, this process, before the frameworks"
        if peak else "no GPU: no transfer rates (the seconds are Python overhead)",
        "frameworks": {},
        "flags": run.flags,
    }
    wanted = {x.strip() for x in args.frameworks.split(",") if x.strip()}
    workdir = Path(tempfile.mkdtemp(prefix="tf_frameworks_"))
    try:
        for name, fn in (("skyrl", lambda r: run_skyrl(run, r)), ("areal", lambda r: run_areal(run, r, workdir))):
            res = result["frameworks"][name] = {}
            if name not in wanted:
                res.update(available=False, reason="not asked for (--frameworks)")
                continue
            try:
                fn(res)
            except Exception as e:
                say(f"{name}: failed: {_error(e)}")
                res["error"] = f"{_error(e)}\n{traceback.format_exc()}"
                run.flags.append(f"{name}: the run failed part-way ({_error(e)[:200]}); what ran is in the JSON")
            _release_host(use_cuda)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if use_cuda and peak:
        say("link peak again")
        lp2 = measure_link_peak(device)
        _settle_peak(result, run, {"h2d": lp2.h2d, "d2h": lp2.d2h, "bidir": lp2.bidir, "nbytes": lp2.nbytes})
    _flag_over_peak(result, run)
    result["checks"] = _checks(result)
    result["wall_s"] = time.perf_counter() - _T0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        say(f"wrote {args.json}")
    print_table(result)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
