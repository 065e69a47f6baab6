"""``torchferry bench`` end to end on the CPU (tiny preset), and its argument errors."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def _bench(*args, tmp_path=None):
    # The CPU path of the bench, also on a machine with GPUs.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "torchferry", "bench", *args], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=env)


NO_GPU = "no transfer figures without a GPU"
# Per strategy, the figures that time or rate a transfer: null without a GPU.
TRANSFER_KEYS = ("offload_GBps", "reload_GBps", "offload_frac_of_peak", "reload_frac_of_peak", "offload_gpu_s",
                 "reload_gpu_s", "observed_GBps", "transfer_spans_s_per_step", "reload_s_per_step", "empty_cache_s",
                 "exposed_reload_s_per_step", "exposed_reload_s_all", "exposed_offload_s_per_step",
                 "exposed_offload_s_all", "exposed_s_per_phase", "compute_overhead_s_per_step",
                 "exposed_transfer_s_per_step", "step_s")


def _no_transfer_figures(r):
    """The CPU run's JSON: every transfer figure null, what the run checks still there."""
    assert r["transfer_figures"] is False and r["link_peak_GBps"] is None and r["noise_frac"] is None
    assert set(r["baseline_resident"]["noise_frac"].values()) == {None}
    for name, s in r["strategies"].items():
        for k in TRANSFER_KEYS:
            assert s[k] is None, (name, k)
        assert s["offload_s"] == s["reload_s"] == {"first": None, "steady": None}, name
        assert s["pinning"] == {"seconds": None, "GBps": None} and s["model_only"]["offload_s"] is None
        if name.endswith("+prefetch"):
            assert s["exposed_reload_vs_torchferry_reload"] is None
            assert s["exposed_reload_floor_s_per_step"] is None and s["floor_detail"] is None
        assert all(v > 0 for v in s["compute_s"].values()), name  # compute seconds stay
    sw = r.get("swap")
    if sw:
        assert sw["seconds"] is None and sw["GBps"] is None and sw["frac_of_bidir_peak"] is None
        assert all(x["seconds"] is None for x in sw["reps"])


def test_tiny_preset_runs_on_cpu_and_writes_json_and_png(tmp_path):
    out, png, trace = tmp_path / "sub" / "r.json", tmp_path / "r.png", tmp_path / "tr" / "t"
    p = _bench("--steps", "2", "--phase-gap-s", "0", "--json", str(out), "--plot", str(png), "--trace", str(trace))
    assert p.returncode == 0, p.stderr[-3000:]
    assert " ".join(p.stderr.split()).count(f"ran on the CPU end to end; {NO_GPU}") == 1  # the note, said once
    # Not on a terminal: a plain progress line per set-up and per round and strategy, as they start.
    progress = [ln for ln in p.stderr.splitlines() if re.match(r"\[ *\d+%\] ", ln)]
    assert "[100%] done" in progress and sum(": step " in ln for ln in progress) == 2 * 5, progress  # 4 + resident
    r = json.loads(out.read_text())
    # What ran, not the option's default: tiny runs 32 tokens.
    assert r["config"]["seq_len"] == r["model"]["seq_len"] == 32 and r["config"]["preset"] == "tiny"
    # No transfer figure on the CPU: no GB/s, no seconds of a copy, no negative exposure, no ratio, no noise.
    assert NO_GPU in p.stdout
    for nonsense in (r"\d GB/s", r"-\d", r"\d+\.\d+x\b", r"\d%", "noise_frac [0-9]"):
        assert not re.search(nonsense, p.stdout), (nonsense, p.stdout)
    swap = [ln for ln in p.stdout.splitlines() if ln.startswith("swap (torchferry.swap")]
    assert swap == ["swap (torchferry.swap, actor out + critic in): bit-exact: yes; " + NO_GPU], p.stdout
    rows = [ln for ln in p.stdout.splitlines() if re.search(r"\b(blocking|seed|torchferry\S*) [│|]", ln)]
    assert len(rows) == 4 and all(" yes " in ln and " ok " in ln for ln in rows), p.stdout
    # --trace: each torchferry strategy's three files and the resident baseline's, each announced.
    wrote = [ln.split(" ", 1)[1] for ln in p.stderr.splitlines() if ln.startswith("wrote ")]
    want = [f"{trace}.{s}{ext}" for s in ("torchferry", "torchferry-prefetch", "resident")
            for ext in (".json.gz", ".summary.json", ".png")]
    assert wrote == [*want, str(out), str(png)]
    assert r["trace_files"] == want and all(os.path.getsize(f) > 0 for f in want)
    assert set(r["traces"]) == {"torchferry", "torchferry+prefetch", "resident"}
    phases = json.loads(open(f"{trace}.resident.summary.json").read())["phases"]
    assert [p["name"] for p in phases][1:4] == ["bench::old_log_prob::h2d", "bench::old_log_prob::compute",
                                                "bench::old_log_prob::d2h"]
    assert r["schema"] == "torchferry.bench/1"
    assert set(r["env"]) >= {"gpu", "torch", "world_size", "date", "command"}
    assert r["env"]["world_size"] == 1 and r["link_peak_GBps"] is None
    assert r["per_rank"][0]["rank"] == 0 and "torchferry" in r["per_rank"][0]["strategies"]
    assert r["per_rank"][0]["strategies"]["seed"]["offload_GBps"] is None  # every rank's copy blanked too
    sb = r["model"]["state_bytes"]
    assert r["model"]["preset"] == "tiny" and sb["params"] > 0 and sb["optimizer"] >= 2 * sb["params"]
    assert list(r["strategies"]) == ["blocking", "seed", "torchferry", "torchferry+prefetch"]
    _no_transfer_figures(r)
    assert r["strategies"]["torchferry+prefetch"]["overlap_baseline"] == "resident"
    assert r["order"] == "interleaved" and len(r["order_per_round"]) == 2  # the default
    assert r["baseline_resident"]["rollout_alloc_ok"] is None and "resident" not in r["strategies"]
    for name, s in r["strategies"].items():
        assert s["rollout_alloc_ok"] and s["round_trip_bit_exact"], name
        assert len(s["losses"]) == 2 and all(x == x for x in s["losses"])  # finite, training ran
        assert {sp["kind"] for sp in s["timeline_step"]} == {"rollout", "h2d", "compute", "d2h", "release"}
    sw = r["swap"]
    assert sw["bit_exact"] and sw["out_bytes"] == sw["in_bytes"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "qwen9"], "unknown preset 'qwen9'"),
        (["--model", "."], "not a Hugging Face checkpoint folder"),
        (["--strategies", "seed,teleport"], "unknown strategy 'teleport'"),
        (["--steps", "1"], "steps must be >= 2"),
        (["--preset", "qwen2.5-7b"], "needs a GPU"),
        (["--seq-len", "1"], "seq_len must be a finite number >= 2, got 1"),
        (["--phase-gap-s", "-1"], "--phase-gap-s must be a finite number >= 0, got -1.0"),
        (["--rollout-s", "inf"], "--rollout-s must be a finite number >= 0, got inf"),
        (["--workload", "heavy"], "unknown workload 'heavy'; choose from default, compute-rich"),
        (["--order", "random"], "unknown order 'random'; choose from interleaved, sequential"),
    ],
)
def test_bad_arguments_exit_nonzero_with_a_message(args, message, tmp_path):
    p = _bench(*args, tmp_path=tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert message in " ".join(p.stderr.split())
    assert "Traceback" not in p.stderr


def test_trace_summary_pairs_ranges_with_bytes_and_gpu_copies(tmp_path):
    from torchferry.bench.rl_step.trace import plot_trace, summarise_trace

    ev = lambda name, cat, ts, dur, **args: {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}  # noqa: E731
    trace = {"traceEvents": [
        ev("torchferry::d2h", "user_annotation", 1000, 500),
        ev("torchferry::d2h bytes=4096", "user_annotation", 1001, 498),
        ev("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 1200, 2000, bytes=4096),
        ev("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 5000, 1000, bytes=2048),
        ev("gemm", "kernel", 7000, 100), ev("gemm", "kernel", 7120, 100), ev("gemm", "kernel", 9000, 10),
        {"ph": "i", "name": "marker"},
    ]}
    s = summarise_trace(trace)
    assert s["ranges"] == [{"name": "torchferry::d2h", "bytes": 4096, "start_s": 0.0, "dur_s": 0.0005}]
    assert s["totals"]["DtoH"] == {"copies": 1, "bytes": 4096, "gpu_s": 0.002, "GBps": 4096 / 0.002 / 1e9}
    assert s["totals"]["HtoD"]["bytes"] == 2048
    assert len(s["kernel_busy"]) == 2 and abs(s["totals"]["kernel_busy_s"] - 230e-6) < 1e-12  # 2 kernels merged
    plot_trace(s, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000


def _finite(x, path="r"):
    """Every number in a JSON value is finite (json.loads reads NaN and Infinity without complaint)."""
    if isinstance(x, dict):
        for k, v in x.items():
            _finite(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _finite(v, f"{path}[{i}]")
    elif isinstance(x, float):
        assert math.isfinite(x), path


def test_interleaved_rounds_and_resident_baseline_without_gpu_figures(tmp_path):
    out = tmp_path / "r.json"
    p = _bench("--strategies", "torchferry,torchferry+prefetch", "--steps", "3", "--phase-gap-s", "0", "--no-swap",
               "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    _finite(r)
    names = ["torchferry", "torchferry+prefetch", "resident"]
    assert r["order"] == "interleaved"
    assert r["order_per_round"] == [names, names[1:] + names[:1], names[2:] + names[:2]]  # each takes each position
    base = r["baseline_resident"]
    assert set(base["compute_s_all"]) == {"old_log_prob", "update_actor"}
    assert all(len(v) == 3 and min(v) > 0 for v in base["compute_s_all"].values())
    assert r["model"]["tokens_per_phase_per_rank"] == 32 and r["model"]["batch_size"] == r["model"]["micro_batches"] == 1
    _no_transfer_figures(r)
    # The FSDP units the prefetch floor would use on a GPU: the root, embed_tokens, 2 layers, lm_head (tiny's
    # embeddings are untied), their bytes the parameters', and the resident baseline's seconds per unit.
    sb, m = r["model"]["state_bytes"], r["model"]
    assert m["fsdp_units"] == len(m["fsdp_unit_bytes"]) == 5 and sum(m["fsdp_unit_bytes"]) == sb["params"]
    assert all(len(v) == 5 for v in base["unit_compute_s"].values())
    hp = r["env"]["host_pages"]
    assert {"thp_enabled", "thp_defrag", "pool_bytes", "anon_huge_bytes", "huge_page_coverage"} <= set(hp)
    assert hp["pool_bytes"] > 0  # the two ferries' pools, alive when it was read
    assert r["link_peak_GBps"] is None and r["link_peak_raised"] == []
    assert NO_GPU in p.stdout and "noise_frac" in p.stdout


def test_sequential_order_and_compute_rich_workload(tmp_path):
    out = tmp_path / "r.json"
    p = _bench("--order", "sequential", "--workload", "compute-rich", "--seq-len", "16", "--strategies",
               "seed,torchferry+prefetch", "--steps", "2", "--phase-gap-s", "0", "--no-swap", "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    _finite(r)
    assert r["order"] == "sequential" and r["order_per_round"] is None
    # compute-rich supplies batch_size and micro_batches; the seq_len given wins.
    m = r["model"]
    assert (m["seq_len"], m["batch_size"], m["micro_batches"], m["tokens_per_phase_per_rank"]) == (16, 2, 4, 128)
    assert (r["config"]["seq_len"], r["config"]["batch_size"], r["config"]["micro_batches"]) == (16, 2, 4)
    assert r["config"]["workload"] == "compute-rich"
    assert all(len(v) == 2 for v in r["baseline_resident"]["compute_s_all"].values())
    _no_transfer_figures(r)
    assert all(s["round_trip_bit_exact"] and s["rollout_alloc_ok"] for s in r["strategies"].values())


def test_floor_hand_computed():
    from torchferry.bench.rl_step.overlap import phase_floor

    # 10 GB/s: copies 0.1, 0.2, 0.1 s. Unit 0 computes 0.01 s while unit 1 copies 0.2 s: unit 1 starts at
    # 0.3 s instead of 0.01 s. Cumulative copy - compute before: 0.1, 0.29, 0.4 - 0.51 -> 0.29 s.
    assert phase_floor([1e9, 2e9, 1e9], [0.01, 0.5, 0.1], 10.0) == pytest.approx(0.29)
    # Compute that covers every later copy: only the first unit's copy is left.
    assert phase_floor([1e9, 1e9], [1.0, 1.0], 10.0) == pytest.approx(0.1)
    # The optimizer tail: 12 GB at 10 GB/s = 1.2 s against 0.7 s of compute -> 0.5 s, above the units' 0.29 s...
    assert phase_floor([1e9, 2e9, 1e9], [0.01, 0.5, 0.1], 10.0, tail_bytes=12e9, tail_compute_s=0.7) == pytest.approx(0.5)
    # ...and without effect when the phase computes longer than it takes to copy everything.
    assert phase_floor([1e9, 2e9, 1e9], [0.01, 0.5, 0.1], 10.0, tail_bytes=12e9, tail_compute_s=2.0) == pytest.approx(0.29)
    assert phase_floor([], [], 10.0) == 0.0
    with pytest.raises(ValueError, match="2 unit sizes but 1"):
        phase_floor([1, 2], [0.1], 10.0)
    with pytest.raises(ValueError, match="copy rate must be > 0"):
        phase_floor([1], [0.1], 0.0)


def test_exposure_and_noise_from_synthetic_spans():
    from torchferry.bench.rl_step.overlap import exposure, noise_frac

    def step(olp_compute, ua_compute):
        return {"old_log_prob": {"h2d": 0.1, "compute": olp_compute, "d2h": 0.2, "release": 0.05},
                "update_actor": {"h2d": 0.3, "compute": ua_compute, "d2h": 0.4, "release": 0.05}}

    resident = [{"old_log_prob": 1.0, "update_actor": 2.0}, {"old_log_prob": 1.0, "update_actor": 2.1}]
    e = exposure([step(1.2, 2.0), step(1.0, 2.5)], resident)
    # Round 0: (0.1 + 1.2 - 1.0) + (0.3 + 2.0 - 2.0) = 0.6; round 1: (0.1 + 0) + (0.3 + 0.4) = 0.8.
    assert e["reload_all"] == pytest.approx([0.6, 0.8]) and e["reload"] == pytest.approx(0.7)
    assert e["offload_all"] == pytest.approx([0.7, 0.7]) and e["offload"] == pytest.approx(0.7)
    assert e["compute_overhead_all"] == pytest.approx([0.2, 0.4]) and e["compute_overhead"] == pytest.approx(0.3)
    assert e["per_phase"]["old_log_prob"] == pytest.approx({"reload": 0.2, "offload": 0.25})
    assert e["per_phase"]["update_actor"] == pytest.approx({"reload": 0.5, "offload": 0.45})
    # An extra round on one side is left out.
    assert exposure([step(1.2, 2.0)], resident)["reload_all"] == pytest.approx([0.6])

    top, per = noise_frac([{"old_log_prob": 1.0, "update_actor": 2.0}, {"old_log_prob": 1.1, "update_actor": 2.1},
                           {"old_log_prob": 0.9, "update_actor": 2.6}])
    assert per["old_log_prob"] == pytest.approx(0.2) and per["update_actor"] == pytest.approx(0.6 / 2.1)
    assert top == pytest.approx(0.6 / 2.1)
    assert noise_frac([]) == (None, {"old_log_prob": None, "update_actor": None})


def _records(h2d, d2h, computes, params=1e9, state=4e9):
    """Step records of one strategy: per round, old_log_prob and update_actor spans (synthetic seconds)."""
    from torchferry.bench.rl_step.workload import Span, StepRecord

    out = []
    for olp, ua in computes:
        t, spans = 0.0, [Span("rollout", "rollout", 0.0, 0.05)]
        for phase, nbytes, compute in (("old_log_prob", params, olp), ("update_actor", state, ua)):
            scale = nbytes / state
            for kind, secs in (("h2d", h2d * scale), ("compute", compute), ("d2h", d2h * scale), ("release", 0.01)):
                if secs is not None:
                    spans.append(Span(phase, kind, t, t + secs, int(nbytes) if kind in ("h2d", "d2h") else 0))
                    t += secs
        out.append(StepRecord(spans, True, int(state), 0, int(state), 1.0))
    return out


def test_summary_exposure_and_floor_from_synthetic_steps():
    """The figures a GPU run reports, from step records (the CPU run blanks them): rates, exposures against
    the resident baseline of the same round, +prefetch against plain torchferry's reload, the floor."""
    from torchferry.bench.rl_step.summary import (
        FirstCycle,
        account_overlap,
        blank_transfer_figures,
        prefetch_floor,
        resident_summary,
        summarise,
    )

    sizes = {"params": int(1e9), "grads": 0, "optimizer": int(3e9)}
    resident = _records(0.0, 0.0, [(1.0, 2.0), (1.0, 2.2)])
    resident = [type(r)([sp for sp in r.spans if sp.kind in ("rollout", "compute")], None, 0, 0, 0, 1.0)
                for r in resident]
    plain = _records(0.4, 0.4, [(1.0, 2.0), (1.0, 2.2)])  # 4 GB in 0.4 s: 10 GB/s each way
    pf = _records(0.01, 0.4, [(1.05, 2.1), (1.05, 2.3)])  # the issue time; 0.05 / 0.1 s of waits in compute
    first = FirstCycle(0.5, 0.5, 0.2, True)
    results = {"torchferry": summarise(first, plain, sizes, overlaps_reload=False),
               "torchferry+prefetch": summarise(first, pf, sizes, overlaps_reload=True)}
    tf = results["torchferry"]
    assert tf["offload_GBps"] == pytest.approx(10.0) and tf["reload_GBps"] == pytest.approx(10.0)
    assert results["torchferry+prefetch"]["reload_GBps"] is None  # its reload span is the issue time
    assert tf["reload_s_per_step"] == pytest.approx(0.5)  # 0.1 (parameters) + 0.4 (everything)
    account_overlap(results, {"torchferry": plain, "torchferry+prefetch": pf}, resident)
    assert tf["exposed_reload_s_per_step"] == pytest.approx(0.5)
    assert tf["compute_overhead_s_per_step"] == pytest.approx(0, abs=1e-12)
    assert tf["exposed_offload_s_per_step"] == pytest.approx(0.5 + 0.02)  # the D2H spans and two empty_caches
    p = results["torchferry+prefetch"]
    assert p["exposed_reload_s_all"] == pytest.approx([0.0025 + 0.01 + 0.15, 0.0025 + 0.01 + 0.15])
    assert p["exposed_reload_vs_torchferry_reload"] == pytest.approx(p["exposed_reload_s_per_step"] / 0.5)
    baseline, noise = resident_summary(resident, {"old_log_prob": [0.5, 0.5], "update_actor": [1.0, 1.0]})
    assert noise == pytest.approx(0.2 / 2.1) and baseline["noise_frac"]["old_log_prob"] == 0
    floor, detail, why = prefetch_floor([int(5e8), int(5e8)], baseline["unit_compute_s"], resident, plain, None, sizes)
    assert why is None and detail["old_log_prob"]["copy_rate_from"] == "torchferry"
    assert detail["old_log_prob"]["copy_GBps"] == pytest.approx(10.0)
    # old_log_prob: 0.05 s, 0.1 - 0.5 -> 0.05; update_actor: the tail, 4 GB in 0.4 s against 2.1 s -> 0.05.
    assert floor == pytest.approx(0.05 + 0.05)
    blank_transfer_figures(results, baseline, None)  # what a CPU run does to all of it
    assert tf["offload_GBps"] is None and p["exposed_reload_vs_torchferry_reload"] is None
    assert set(baseline["noise_frac"].values()) == {None} and tf["compute_s"]["update_actor"] == pytest.approx(2.1)


def test_link_peak_is_raised_to_every_observed_rate():
    from torchferry.bench.rl_step.overlap import apply_peak, observed_rates, raise_peak

    measured = {"h2d": 50.0, "d2h": 52.0, "bidir": 70.0}
    results = {
        "seed": {"offload_GBps": 40.0, "reload_GBps": 45.0,
                 "observed_GBps": {"d2h": {"steady": 40.0, "first": 30.0}, "h2d": {"steady": 45.0, "per_step_max": 51.0}}},
        "torchferry": {"offload_GBps": 53.0, "reload_GBps": 49.0,
                       "observed_GBps": {"d2h": {"steady": 53.0, "per_step_max": 54.0, "gpu": 55.5},
                                         "h2d": {"steady": 49.0, "gpu": 50.5, "first": None}}},
        "torchferry+prefetch": {"offload_GBps": 52.5, "reload_GBps": None,
                                "observed_GBps": {"d2h": {"steady": 52.5}, "h2d": {"gpu": None}}},
    }
    swap = {"GBps": 72.0, "frac_of_bidir_peak": 72.0 / 70.0}
    peak, raised = raise_peak(measured, observed_rates(results, swap))
    assert peak == {"h2d": 51.0, "d2h": 55.5, "bidir": 72.0} and measured["d2h"] == 52.0  # measured kept as is
    assert {(x["direction"], x["by"], x["measured_GBps"], x["GBps"]) for x in raised} == {
        ("d2h", "torchferry: gpu", 52.0, 55.5), ("h2d", "seed: per_step_max", 50.0, 51.0), ("bidir", "swap", 70.0, 72.0)}
    apply_peak(results, swap, peak)
    fracs = [r[k] for r in results.values() for k in ("offload_frac_of_peak", "reload_frac_of_peak")]
    fracs.append(swap["frac_of_bidir_peak"])
    assert all(f is None or 0 < f <= 1.0 for f in fracs) and fracs.count(None) == 1  # +prefetch: no reload GB/s
    assert results["torchferry"]["offload_frac_of_peak"] == pytest.approx(53.0 / 55.5)
    # Below the peak: nothing raised. No GPU: no peak, no fractions.
    assert raise_peak({"h2d": 60.0, "d2h": 60.0, "bidir": 90.0}, observed_rates(results, swap))[1] == []
    assert raise_peak(None, observed_rates(results, swap)) == (None, [])
    apply_peak(results, None, None)
    assert results["seed"]["offload_frac_of_peak"] is None


def test_trace_phase_breakdown_splits_kernels_by_kind_and_finds_the_compute_streams_idle_time():
    from torchferry.bench.rl_step.trace import summarise_trace

    ev = lambda name, cat, ts, dur, **args: {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}  # noqa: E731
    trace = {"traceEvents": [
        ev("bench::update_actor::compute", "user_annotation", 0, 10_000),
        ev("sm90_xmma_gemm_bf16", "kernel", 100, 3000, stream=7),
        ev("flash_fwd_kernel", "kernel", 4100, 1000, stream=7),  # 1000 us idle before it
        ev("ncclDevKernel_AllGather", "kernel", 200, 2000, stream=21),
        ev("vectorized_elementwise_kernel", "kernel", 5100, 400, stream=7),
        ev("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 300, 1000, bytes=10**9),
        ev("cudaMalloc", "cuda_runtime", 50, 20), ev("cudaMalloc", "cuda_runtime", 60, 30),
        ev("sm90_xmma_gemm_bf16", "kernel", 20_000, 50, stream=7),  # outside the range
    ]}
    (row,) = summarise_trace(trace)["phases"]
    assert row["name"] == "bench::update_actor::compute" and row["wall_s"] == 0.01
    assert row["kernel_s"] == pytest.approx({"nccl": 0.002, "gemm": 0.003, "attention": 0.001, "other": 0.0004},
                                            rel=1e-9, abs=0)
    assert row["kernels"] == {"nccl": 1, "gemm": 1, "attention": 1, "other": 1}
    assert row["compute_stream"] == 7 and abs(row["busy_s"] - 0.0044) < 1e-12
    assert abs(row["idle_s"] - (0.01 - 0.0044)) < 1e-12
    assert row["h2d_GB"] == 1.0 and row["h2d_s"] == 0.001 and row["d2h_GB"] == 0.0
    assert row["runtime"]["cudaMalloc"][0] == 2 and abs(row["runtime"]["cudaMalloc"][1] - 50e-6) < 1e-12


def test_lora_scenario_runs_on_cpu_skips_the_frozen_base_and_is_bit_exact(tmp_path):
    """``torchferry bench-lora``: peft adapters on the tiny preset under FSDP2, seed and
    torchferry (skip_unchanged) side by side; verify mode checks every skip against a full copy."""
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCHFERRY_VERIFY_SKIPS": "1"}
    p = subprocess.run([sys.executable, "-m", "torchferry", "bench-lora", "--steps", "3", "--layers", "2",
                        "--rank", "4", "--json", str(out)], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["schema"] == "torchferry.bench-lora/1" and r["model"]["lora_rank"] == 4
    seed, tf = r["strategies"]["seed"], r["strategies"]["torchferry"]
    assert seed["round_trip_bit_exact"] and tf["round_trip_bit_exact"]
    assert seed["same_state_as_seed"] and tf["same_state_as_seed"]
    assert seed["state_bytes"] == tf["state_bytes"]
    assert seed["offload_all_bytes_copied"] == seed["state_bytes"]["total"]
    # The frozen base is never copied again: the forward-only offload copies nothing, the training
    # offload only the adapters and their AdamW state.
    assert tf["offload_params_bytes_copied"] == 0
    assert all(s["offload_params_bytes_copied"] == 0 for s in tf["steps"][1:])
    # After the update exactly what the step wrote: the adapters, then all of the AdamW state.
    sb = tf["state_bytes"]
    assert 0 < tf["offload_params_after_update_bytes_copied"] < 0.5 * sb["params"]
    assert tf["offload_optimizer_bytes_copied"] == sb["optimizer"]
    assert tf["offload_all_bytes_copied"] == sb["written_per_step"] < 0.5 * sb["total"]
    assert seed["offload_params_after_update_bytes_copied"] == sb["params"]
    # No seconds and no speed-up without a GPU (they were "0.6x": Python, not a link), and no warning.
    for s in (seed, tf):
        assert all(s[k] is None for k in ("offload_params_s", "offload_optimizer_s", "offload_all_s", "reload_all_s"))
        assert all(v is None for step in s["steps"] for k, v in step.items() if k.endswith("_s"))
    assert not any(k.endswith("speedup_vs_seed") for k in tf) and "speedup_vs_full_copy_at_peak" not in tf
    assert "torchferry: a step writes 0." in p.stdout and NO_GPU in p.stdout
    assert not re.search(r"\d\.\dx\b|seconds (first|steady)", p.stdout), p.stdout
    assert "Warning" not in p.stderr, p.stderr


@pytest.mark.parametrize("args, message", [
    (["--strategies", "blocking"], "strategies must be distinct names from seed, torchferry"),
    (["--steps", "1"], "steps must be >= 2"),
    (["--rank", "0"], "rank must be >= 1"),
])
def test_lora_bad_arguments_exit_nonzero_with_a_message(args, message, tmp_path):
    pytest.importorskip("peft")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "torchferry", "bench-lora", *args], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path, env=env)
    assert p.returncode == 2 and message in p.stderr, p.stderr[-2000:]


def test_the_copies_own_cost_is_the_dma_baselines_exposure_against_the_resident_one():
    """[Note: the copies' own cost]: ``resident+dma`` (its issue time + compute over the resident
    baseline's compute, round by round) is reported beside each +prefetch strategy's exposure."""
    from torchferry.bench.rl_step.summary import dma_penalty

    resident = _records(0.0, 0.0, [(1.0, 2.0), (1.0, 2.2)])
    dma = _records(0.005, 0.0, [(1.03, 2.08), (1.01, 2.26)])  # issue 1.25 / 5 ms; 30+80 and 10+60 ms slower
    results = {"torchferry": {}, "torchferry+prefetch": {}}
    out = dma_penalty(results, dma, resident)
    assert out is not None
    assert out["penalty_s_all"] == pytest.approx([0.00625 + 0.11, 0.00625 + 0.07])
    assert out["penalty_s_per_step"] == pytest.approx(0.00625 + 0.09)
    assert out["penalty_s_per_phase"]["update_actor"] == pytest.approx(0.005 + 0.07)
    assert out["compute_overhead_s_per_step"] == pytest.approx(0.09)
    assert out["issue_s_per_step"] == pytest.approx(0.00625)
    assert out["compute_s"]["old_log_prob"] == pytest.approx(1.02)
    assert results["torchferry+prefetch"]["dma_penalty_s_per_step"] == out["penalty_s_per_step"]
    assert "dma_penalty_s_per_step" not in results["torchferry"]
    assert dma_penalty(results, None, resident) is None and dma_penalty(results, [], resident) is None
