"""``torchferry bench`` end to end on the CPU (tiny preset), and its argument errors."""

import json
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


def test_tiny_preset_runs_on_cpu_and_writes_json_and_png(tmp_path):
    out, png, trace = tmp_path / "sub" / "r.json", tmp_path / "r.png", tmp_path / "tr" / "t"
    p = _bench("--steps", "2", "--phase-gap-s", "0", "--json", str(out), "--plot", str(png), "--trace", str(trace))
    assert p.returncode == 0, p.stderr[-3000:]
    assert " ".join(p.stderr.split()).count("transfer figures need a GPU (GB/s are left out") == 1  # said once
    r = json.loads(out.read_text())
    # What ran, not the option's default: tiny runs 32 tokens.
    assert r["config"]["seq_len"] == r["model"]["seq_len"] == 32 and r["config"]["preset"] == "tiny"
    # No GB/s figure on the CPU: the table's GB/s cells and the swap line say nothing of a link.
    assert not re.search(r"\d GB/s", p.stdout), p.stdout
    swap = [ln for ln in p.stdout.splitlines() if ln.startswith("swap (torchferry.swap")]
    assert len(swap) == 1 and swap[0].endswith("bit-exact: yes") and "GB/s" not in swap[0]
    rows = [ln for ln in p.stdout.splitlines() if re.search(r"\b(blocking|seed|torchferry\S*) [│|]", ln)]
    assert len(rows) == 4 and all(ln.count(" - ") >= 2 for ln in rows), p.stdout
    # --trace: each torchferry strategy's three files, each announced.
    wrote = [ln.split(" ", 1)[1] for ln in p.stderr.splitlines() if ln.startswith("wrote ")]
    want = [f"{trace}.{s}{ext}" for s in ("torchferry", "torchferry-prefetch")
            for ext in (".json.gz", ".summary.json", ".png")]
    assert wrote == [*want, str(out), str(png)]
    assert r["trace_files"] == want and all(os.path.getsize(f) > 0 for f in want)
    assert set(r["traces"]) == {"torchferry", "torchferry+prefetch"}
    assert r["schema"] == "torchferry.bench/1"
    assert set(r["env"]) >= {"gpu", "torch", "world_size", "date", "command"}
    assert r["env"]["world_size"] == 1 and r["link_peak_GBps"] is None
    assert r["per_rank"][0]["rank"] == 0 and "torchferry" in r["per_rank"][0]["strategies"]
    sb = r["model"]["state_bytes"]
    assert r["model"]["preset"] == "tiny" and sb["params"] > 0 and sb["optimizer"] >= 2 * sb["params"]
    assert list(r["strategies"]) == ["blocking", "seed", "torchferry", "torchferry+prefetch"]
    pf = r["strategies"]["torchferry+prefetch"]
    assert pf["overlap_baseline"] == "torchferry" and pf["exposed_transfer_s_per_step"] >= pf["transfer_spans_s_per_step"]
    assert pf["exposed_reload_s_per_step"] >= pf["reload_s_per_step"] > 0
    assert pf["exposed_reload_vs_torchferry_reload"] == pytest.approx(
        pf["exposed_reload_s_per_step"] / r["strategies"]["torchferry"]["reload_s_per_step"])
    for name, s in r["strategies"].items():
        for k in ("offload_s", "reload_s"):
            assert s[k]["first"] > 0 and s[k]["steady"] > 0, (name, k)
        for k in ("offload_GBps", "exposed_transfer_s_per_step", "step_s", "reload_s_per_step"):
            assert s[k] > 0, (name, k)
        assert (s["reload_GBps"] is None) == name.endswith("+prefetch")  # its reload span is the issue time
        assert s["offload_frac_of_peak"] is None  # no link on a CPU
        assert s["rollout_alloc_ok"] and s["round_trip_bit_exact"], name
        assert len(s["losses"]) == 2 and all(x == x for x in s["losses"])  # finite, training ran
        assert {sp["kind"] for sp in s["timeline_step"]} == {"rollout", "h2d", "compute", "d2h", "release"}
    sw = r["swap"]
    assert sw["bit_exact"] and sw["out_bytes"] == sw["in_bytes"] > 0 and sw["GBps"] > 0 and sw["frac_of_bidir_peak"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "qwen9"], "unknown preset 'qwen9'"),
        (["--model", "."], "not a Hugging Face checkpoint folder"),
        (["--strategies", "seed,teleport"], "unknown strategy 'teleport'"),
        (["--steps", "1"], "steps must be >= 2"),
        (["--preset", "qwen2.5-7b"], "needs a GPU"),
        (["--seq-len", "1"], "seq_len must be >= 2, got 1"),
        (["--phase-gap-s", "-1"], "phase_gap_s must be >= 0, got -1.0"),
    ],
)
def test_bad_arguments_exit_nonzero_with_a_message(args, message, tmp_path):
    p = _bench(*args, tmp_path=tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert message in " ".join(p.stderr.split())
    assert "Traceback" not in p.stderr


def test_trace_summary_pairs_ranges_with_bytes_and_gpu_copies(tmp_path):
    from torchferry.bench._trace import plot_trace, summarise_trace

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
