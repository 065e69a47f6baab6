"""``torchferry bench-pin``: pinning speed, small tensors and the first offload, on one GPU.

Three measurements, each against its baseline in the same run:

* pinning: a ferry's pool (``Ferry(t, pin_ahead=False).reserve_host()`` over one
  device tensor of ``n`` bytes: map, touch from several threads, huge pages,
  ``cudaHostRegister``) against ``torch.empty(n, pin_memory=True)`` for the
  same bytes (PyTorch's caching host allocator, ``cudaHostAlloc``);
* small tensors: a ferry over 4096 tensors of 256 KiB (packed, one DMA per
  64 MiB chunk) against one ``copy_`` per tensor into pinned memory;
* the first offload: of ``Ferry(*ts)`` as the README uses it (the pool pinned
  ahead, in the background, while training runs), against a steady offload;
  and with ``pin_ahead=False``, where the first offload pins.

Seconds are host wall clock from the call until the copies are complete
(``handle.wait()`` / ``torch.cuda.synchronize()``), as the user sees them.
GB/s = 1e9 B/s; fractions are of the link peak measured in the same run.
Only ``torchferry``'s public API is used: a ferry's ``reserve_host()`` (the
seconds it pinned, or their future), ``pinned``, ``pinned_bytes``, ``host_bytes``.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import cast

import torch

from torchferry import Ferry

from ._common.link import measure_link_peak, release_host_cache
from ._common.output import CommandError, check_paths, write_results
from ._common.setup import source_commit

__all__ = ["SCHEMA", "pin_command", "render_table", "run_pin_bench", "summarise_small"]

SCHEMA = "torchferry.bench-pin/1"


def _wall(fn: Callable[[], object], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t


def measure_pinning(nbytes: int, device: torch.device, reps: int = 3) -> dict:
    """Host seconds to get ``nbytes`` of pinned memory: a ferry's pool against ``torch.empty(pin_memory=True)``.

    Alternates the two ``reps`` times (each allocation freed, and PyTorch's
    host cache emptied, before the next) and takes the median of each. The
    ferry holds one device tensor of ``nbytes`` (``pin_ahead=False``: nothing
    pins before the timed ``reserve_host()``); ``torchferry_s`` is the call's
    wall time, ``torchferry_reported_s`` the seconds it returns (mapping,
    touching and registering the block).
    """
    state = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ours, theirs, reported = [], [], []
    for _ in range(reps):
        release_host_cache()
        t = time.perf_counter()
        x = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        theirs.append(time.perf_counter() - t)
        assert x.is_pinned()
        del x
        release_host_cache()
        ferry = Ferry(state, device=device, pin_ahead=False)
        t = time.perf_counter()
        seconds = cast(float, ferry.reserve_host())  # without background=True: the seconds, never a Future
        ours.append(time.perf_counter() - t)
        reported.append(seconds)
        assert ferry.pinned and ferry.pinned_bytes >= nbytes, (ferry.pinned_bytes, nbytes)
        ferry.close()
    del state
    o, p = statistics.median(ours), statistics.median(theirs)
    return {"bytes": nbytes, "torchferry_s": o, "torch_s": p, "torchferry_GBps": nbytes / o / 1e9,
            "torch_GBps": nbytes / p / 1e9, "speedup_vs_torch": p / o, "reps": reps,
            "torchferry_all_s": ours, "torch_all_s": theirs, "torchferry_reported_s": reported}


def summarise_small(nbytes: int, offload_s: list[float], reload_s: list[float], per_tensor_d2h_s: list[float],
                    per_tensor_h2d_s: list[float], peak: dict) -> dict:
    """Fractions of the link peak for the small-tensor run (medians of the timed cycles).

    ``per_tensor_frac_of_peak`` is the per-tensor round trip (D2H then H2D,
    ``2 * nbytes`` over the summed seconds) against the round trip the peak
    allows (``2 / (1 / d2h + 1 / h2d)`` GB/s).
    """
    off, on = statistics.median(offload_s), statistics.median(reload_s)
    pd, ph = statistics.median(per_tensor_d2h_s), statistics.median(per_tensor_h2d_s)
    round_trip_peak = 2 / (1 / peak["d2h"] + 1 / peak["h2d"])
    return {
        "bytes": nbytes,
        "offload_GBps": nbytes / off / 1e9, "reload_GBps": nbytes / on / 1e9,
        "offload_frac_of_peak": nbytes / off / 1e9 / peak["d2h"],
        "reload_frac_of_peak": nbytes / on / 1e9 / peak["h2d"],
        "per_tensor_offload_GBps": nbytes / pd / 1e9, "per_tensor_reload_GBps": nbytes / ph / 1e9,
        "per_tensor_offload_frac_of_peak": nbytes / pd / 1e9 / peak["d2h"],
        "per_tensor_reload_frac_of_peak": nbytes / ph / 1e9 / peak["h2d"],
        "per_tensor_frac_of_peak": 2 * nbytes / (pd + ph) / 1e9 / round_trip_peak,
        "offload_s": offload_s, "reload_s": reload_s,
        "per_tensor_offload_s": per_tensor_d2h_s, "per_tensor_reload_s": per_tensor_h2d_s,
    }


def measure_small_tensors(device: torch.device, peak: dict, count: int = 4096, each: int = 256 << 10,
                          cycles: int = 5) -> dict:
    """``count`` tensors of ``each`` bytes: a ferry's offload/reload against per-tensor copies.

    Steady cycles (the caching allocator keeps the blocks; no
    ``empty_cache`` between), after two warm-up cycles. Bit-exactness of
    the ferry's round trips is checked.
    """
    g = torch.Generator(device=device).manual_seed(0)
    ts = [torch.randint(-2**31, 2**31 - 1, (each // 4,), device=device, dtype=torch.int32, generator=g)
          for _ in range(count)]
    want = torch.cat(ts).cpu()
    nbytes = count * each
    ferry = Ferry(*ts)
    ferry.reserve_host()
    off, on, gpu_off, gpu_on = [], [], [], []
    for i in range(cycles + 2):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        h = ferry.offload()
        h.wait()
        o = time.perf_counter() - t
        t = time.perf_counter()
        h2 = ferry.reload()
        h2.wait()
        r = time.perf_counter() - t
        if i >= 2:
            off.append(o)
            on.append(r)
            gpu_off.append(h.seconds)
            gpu_on.append(h2.seconds)
    bit_exact = torch.equal(torch.cat(ts).cpu(), want)
    ferry.close()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    views = [v.view(torch.int32) for v in host.split(each)]
    pd, ph = [], []
    for i in range(cycles + 1):
        # F821 below is a false positive: `views` is deleted after the loop, and _wall calls each lambda at once
        d = _wall(lambda: [v.copy_(t, non_blocking=True) for v, t in zip(views, ts, strict=False)], device)  # noqa: F821
        h = _wall(lambda: [t.copy_(v, non_blocking=True) for v, t in zip(views, ts, strict=False)], device)  # noqa: F821
        if i:
            pd.append(d)
            ph.append(h)
    del host, views
    release_host_cache()
    out = summarise_small(nbytes, off, on, pd, ph, peak)
    out.update(count=count, tensor_bytes=each, bit_exact=bit_exact, gpu_offload_s=gpu_off, gpu_reload_s=gpu_on)
    return out


def _train_for(seconds: float, device: torch.device) -> tuple[int, float]:
    """A training stand-in: bf16 8192^2 matmuls until ``seconds`` pass. Returns (steps, seconds)."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    steps, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(8):
            a = torch.tanh(a @ b)
        torch.cuda.synchronize(device)
        steps += 8
    return steps, time.perf_counter() - t


def measure_first_offload(device: torch.device, state_bytes: int, train_s: float, cycles: int = 3) -> dict:
    """The first offload of a ferry used as the README shows it, against a steady one.

    Default (``Ferry(*ts)``, pinning ahead, [Note: pin ahead]): the ferry is
    made, ``train_s`` seconds of training run (their step rate against the
    same training with no pinning under way), then the first offload. Right
    before it, ``reserve_host(background=True)`` hands back the future of the
    pinning under way without waiting for it: whether it is done is
    ``pool_ready_before_first_offload``, its result ``background_pin_s``. Lazy
    (``Ferry(*ts, pin_ahead=False)``): the first offload, right after the
    ferry is made, allocates and pins the pool itself.
    """
    n = 32
    ts = [torch.full((state_bytes // n // 2,), float(i), device=device, dtype=torch.bfloat16) for i in range(n)]
    base_steps, base_s = _train_for(train_s, device)
    t = time.perf_counter()
    ferry = Ferry(*ts)
    call_s = time.perf_counter() - t
    steps, s = _train_for(train_s, device)
    pinning = cast(Future, ferry.reserve_host(background=True))  # pinning ahead's seconds; does not wait
    ready = pinning.done()
    first = _wall(lambda: ferry.offload().wait(), device)
    ferry.reload().wait()
    pin_s = pinning.result()
    steady = []
    for _ in range(cycles):
        steady.append(_wall(lambda: ferry.offload().wait(), device))
        ferry.reload().wait()
    ferry.close()
    lazy_ferry = Ferry(*ts, pin_ahead=False)
    lazy_first = _wall(lambda: lazy_ferry.offload().wait(), device)
    lazy_ferry.reload().wait()
    lazy_ferry.close()
    ok = all(torch.equal(t_, torch.full_like(t_, float(i))) for i, t_ in enumerate(ts))
    st = statistics.median(steady)
    return {
        "state_bytes": sum(t_.untyped_storage().nbytes() for t_ in ts),
        "train_s": train_s, "ferry_init_s": call_s, "background_pin_s": pin_s,
        "pool_ready_before_first_offload": ready,
        "train_steps_per_s_alone": base_steps / base_s, "train_steps_per_s_while_pinning": steps / s,
        "first_offload_s": first, "steady_offload_s": st, "first_over_steady": first / st,
        "steady_offload_all_s": steady,
        "lazy_first_offload_s": lazy_first, "lazy_first_over_steady": lazy_first / st,
        "bit_exact": ok,
    }


def run_pin_bench(*, pin_bytes: int = 4 << 30, first_state_bytes: int = 8 << 30, train_s: float = 3.0,
                  device: torch.device | None = None, command: str = "",
                  on_progress: Callable[[str], None] | None = None) -> dict:
    """Runs the three measurements on one GPU; returns the ``torchferry.bench-pin/1`` JSON as a dict.

    Raises:
        ValueError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise ValueError("torchferry bench-pin measures pinned memory and PCIe copies: it needs a CUDA GPU")
    device = device or torch.device("cuda", torch.cuda.current_device())
    say = on_progress or (lambda msg: None)
    say("measuring the link peak")
    p = measure_link_peak(device)
    peak = {"h2d": p.h2d, "d2h": p.d2h, "bidir": p.bidir}
    say(f"pinning {pin_bytes / 2**30:.1f} GiB: torchferry's pool vs torch.empty(pin_memory=True)")
    pinning = measure_pinning(pin_bytes, device)
    say("4096 x 256 KiB tensors: packed ferry vs per-tensor copies")
    small = measure_small_tensors(device, peak)
    say(f"first offload of {first_state_bytes / 2**30:.1f} GiB after Ferry creation (pinned ahead) and training")
    first = measure_first_offload(device, first_state_bytes, train_s)
    return {
        "schema": SCHEMA,
        "env": {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "device": str(device),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": command, "commit": source_commit()},
        "link_peak_GBps": peak,
        "pinning": pinning,
        "small_tensors": small,
        "first_offload": first,
    }


def render_table(result: dict):
    """The ``rich.table.Table`` ``torchferry bench-pin`` prints: each measurement against its baseline."""
    from rich.table import Table

    pin, small = result["pinning"], result["small_tensors"]
    first, peak = result["first_offload"], result["link_peak_GBps"]
    table = Table(title=f"torchferry bench-pin on {result['env']['gpu']}; link peak H2D {peak['h2d']:.1f} / "
                        f"D2H {peak['d2h']:.1f} GB/s")
    table.add_column("measurement")
    table.add_column("torchferry", justify="right")
    table.add_column("baseline", justify="right")
    table.add_column("ratio", justify="right")
    table.add_row(f"pin {pin['bytes'] / 2**30:.1f} GiB (GB/s)", f"{pin['torchferry_GBps']:.2f}",
                  f"{pin['torch_GBps']:.2f} (torch.empty pinned)", f"{pin['speedup_vs_torch']:.1f}x")
    table.add_row("4096 x 256 KiB offload (of peak)", f"{small['offload_frac_of_peak']:.1%}",
                  f"{small['per_tensor_offload_frac_of_peak']:.1%} (per-tensor copy_)", "")
    table.add_row("4096 x 256 KiB reload (of peak)", f"{small['reload_frac_of_peak']:.1%}",
                  f"{small['per_tensor_reload_frac_of_peak']:.1%} (per-tensor copy_)", "")
    table.add_row(f"first offload of Ferry() after training, {first['state_bytes'] / 2**30:.1f} GiB (s)",
                  f"{first['first_offload_s']:.3f}",
                  f"{first['steady_offload_s']:.3f} (steady)", f"{first['first_over_steady']:.2f}x")
    table.add_row("first offload, Ferry(pin_ahead=False) (s)", f"{first['lazy_first_offload_s']:.3f}",
                  f"{first['steady_offload_s']:.3f} (steady)", f"{first['lazy_first_over_steady']:.2f}x")
    return table


def pin_command(*, json_path: Path | None, pin_gib: float, first_gib: float, train_s: float) -> int:
    """``torchferry bench-pin`` with the command line's options; returns the exit status.

    Raises:
        CommandError: an option refused, or no CUDA device (exit 2).
    """
    from rich.console import Console

    console = Console(stderr=True)
    check_paths(("--json", json_path, False, "bench-pin.json"))
    for name, value in (("--pin-gib", pin_gib), ("--first-gib", first_gib)):
        if value <= 0:
            raise CommandError(f"{name} must be > 0, got {value}")
    if train_s < 0:
        raise CommandError(f"--train-s must be >= 0, got {train_s}")
    try:
        result = run_pin_bench(pin_bytes=int(pin_gib * 2**30), first_state_bytes=int(first_gib * 2**30),
                               train_s=train_s, command="torchferry " + " ".join(sys.argv[1:]),
                               on_progress=lambda msg: console.print(f"[dim]{msg}[/]"))
    except ValueError as e:
        raise CommandError(str(e)) from None
    Console().print(render_table(result))
    if not write_results(result, json_path):
        return 1
    return 0
