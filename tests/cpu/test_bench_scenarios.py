"""``torchferry bench-grpo`` end to end on the CPU, the bench's host-page report, and the rules of
``src/torchferry/bench/``: torchferry's public API only, no file over 500 lines."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchferry

BENCH = Path(__file__).resolve().parents[2] / "src" / "torchferry" / "bench"
NO_GPU = "no transfer figures without a GPU"


# ------------------------------------------------------------- bench-grpo
def test_grpo_bench_runs_tiny_on_the_cpu_bit_exact_and_moves_only_the_reference(tmp_path):
    """``torchferry bench-grpo --preset tiny`` end to end (it replaced the script
    ``git show 72c0885^:benchmarks/grpo_dock.py``, same options and JSON): the JSON's keys, bit-exactness,
    and the bytes each strategy moves per step (the dock: the reference in and out; verl-style: every set); no
    warning of the bench's own ferries at exit (it warned that one was dropped while offloaded)."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "g.json", tmp_path / "g.png"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "torchferry", "bench-grpo", "--preset", "tiny", "--steps", "2",
                        "--warmup-steps", "1", "--json", str(out), "--plot", str(png)], check=False,
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dropped" not in p.stdout + p.stderr  # the run lets its sides go: no ferry warns at exit
    r = json.loads(out.read_text())
    assert r["schema"] == "torchferry.bench-grpo/1"
    assert set(r["env"]) >= {"gpu", "torch", "world_size", "date", "command"} and r["env"]["gpu"] is None
    assert "bench-grpo --preset tiny" in r["env"]["command"]
    b, sb = r["budget"], r["model"]["state_bytes"]
    P, O, R = sb["actor_params"], sb["actor_optimizer"], sb["ref_params"]
    assert P > 0 and O > 1.9 * P and R > 0 and b["kv_bytes"] == P + O  # AdamW: 2x the parameters (P has buffers too)
    assert not b["holds_everything"] and b["gpu_budget_bytes"] < b["everything_bytes"]
    assert list(r["strategies"]) == ["torchferry", "torchferry+dock"]
    assert r["bit_exact"] is True and r["bit_exact_detail"]["losses_equal"]
    for s in r["strategies"].values():
        assert isinstance(s["exposed_transfer_s_per_step"], float) and len(s["exposed_transfer_s_steps"]) == 2
        assert set(s["exposed_transfer_s_by_phase"]) == {"rollout", "ref_log_prob", "old_log_prob", "update_actor"}
        assert s["bit_exact"] is True and s["within_budget"] is True and s["peak_gpu_bytes"] is None  # no GPU
        assert s["peak_accounted_bytes"] <= b["gpu_budget_bytes"]
        assert {c["engine"] for c in s["timeline_step"]["copies"]} == {"h2d", "d2h"}
    base, dock = r["strategies"]["torchferry"], r["strategies"]["torchferry+dock"]
    assert base["bytes_moved_per_step"] == {"h2d": R + 2 * P + O, "d2h": R + 2 * P + O}
    assert dock["bytes_moved_per_step"] == {"h2d": R, "d2h": R}
    assert dock["exposed_vs_torchferry"] is not None and dock["dock_stats"]["swaps"] == 0
    assert dock["dock_stats"]["prefetch_evictions"] == dock["dock_stats"]["evictions"] == 3  # one per step
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The summary on the CPU: bytes, budget, bit-exactness; no exposed seconds.
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("  torchferry")]
    assert len(rows) == 2 and all(f"exposed: {NO_GPU}" in ln and "bit-exact True" in ln for ln in rows), p.stdout
    assert not re.search(r"\d s/step|\dx torchferry", p.stdout), p.stdout
    assert "[100%] done" in p.stderr.splitlines()  # plain progress lines when not on a terminal
    assert p.stderr.splitlines()[-2:] == [f"wrote {out}", f"wrote {png}"]


@pytest.mark.parametrize("args, message", [
    (["--preset", "qwen9"], "unknown preset 'qwen9'"),
    (["--strategies", "torchferry,teleport"], "non-empty subset"),
    (["--steps", "0"], "steps must be >= 1, got 0"),
    (["--json", "/proc/x/g.json"], "error: --json /proc/x/g.json: folder /proc/x does not exist"),
])
def test_grpo_command_refuses_bad_options_in_one_line(args, message, tmp_path):
    pytest.importorskip("transformers")
    p = subprocess.run([sys.executable, "-m", "torchferry", "bench-grpo", *args], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("kwargs, message", [
    ({"preset": "qwen9"}, "unknown preset 'qwen9'"),
    ({"strategies": ("torchferry", "teleport")}, "non-empty subset"),
    ({"strategies": ("torchferry", "torchferry")}, "repeated"),
    ({"steps": 0}, "steps must be >= 1, got 0"),
    ({"budget_bytes": 0}, "budget_bytes must be >= 1, got 0"),
    ({"kv_bytes": -1}, "kv_bytes must be >= 0, got -1"),
])
def test_grpo_config_refuses_bad_values(kwargs, message):
    from torchferry.bench.grpo.config import GrpoConfig

    with pytest.raises(ValueError, match=message):
        GrpoConfig(**kwargs)


# ------------------------------------------------------------- host pages
def test_host_page_report_counts_the_huge_pages_of_the_mappings_advised_hugepage(tmp_path):
    from torchferry.bench._common.host_pages import host_page_report

    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0040000000 rw-p 00000000 00:00 0\n"
        "Size:            1048576 kB\nAnonHugePages:    524288 kB\nVmFlags: rd wr mr mw me ac hg\n"
        "7f1000000000-7f1000200000 rw-p 00000000 00:00 0\n"
        "Size:               2048 kB\nAnonHugePages:      2048 kB\nVmFlags: rd wr mr mw me ac\n"
    )
    r = host_page_report(1 << 30, smaps=str(smaps))
    assert r["pool_bytes"] == 1 << 30 and r["anon_huge_bytes"] == 512 << 20 and r["huge_page_coverage"] == 0.5
    assert host_page_report(0, smaps=str(smaps))["anon_huge_bytes"] is None  # no pool: nothing to say
    assert host_page_report(1, smaps=str(tmp_path / "missing"))["huge_page_coverage"] is None


def test_host_page_report_sees_a_ferrys_pool():
    """The same figure the engine's own diagnostic gives, from /proc and the public ``host_bytes``."""
    import torch

    from torchferry.bench._common.host_pages import host_page_report

    t = torch.ones(16 << 20)  # 64 MiB: whole huge pages where THP allows them
    ferry = torchferry.Ferry(t, device="cpu")
    ferry.offload()
    r = host_page_report(ferry.host_bytes)
    assert r["pool_bytes"] == ferry.host_bytes == 64 << 20
    assert r["anon_huge_bytes"] is None or 0 <= r["anon_huge_bytes"] <= ferry.host_bytes + (2 << 20)
    ferry.reload()
    ferry.close()


# ------------------------------------------------------------- the bench's rules
def _modules():
    files = sorted(BENCH.rglob("*.py"))
    assert len(files) > 10 and (BENCH / "rl_step" / "run.py") in files
    return files


def _module_name(path: Path) -> str:
    parts = path.relative_to(BENCH.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


# Private attributes of torch and transformers the bench reads on purpose (none of torchferry's).
_ALLOWED_PRIVATE = {("torch", "_C"), ("st", "_cdata"), ("model.config", "_attn_implementation")}


def _violations(path: Path, source: str | None = None) -> list[str]:
    """What breaks the rules in one module (``source``: its text, if not the file's)."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    where = f"{path.relative_to(BENCH.parents[1])}"
    out = []
    public = set(torchferry.__all__)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(path).split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "torchferry":
                out += [f"{where}:{node.lineno}: from torchferry import {a.name} (not in torchferry.__all__)"
                        for a in node.names if a.name not in public]
            elif module.startswith("torchferry.") and not module.startswith("torchferry.bench"):
                out.append(f"{where}:{node.lineno}: from {module} import ... (not the public API)")
        elif isinstance(node, ast.Import):
            out += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                    if a.name.startswith("torchferry.") and not a.name.startswith("torchferry.bench")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base not in ("self", "cls") and (base, node.attr) not in _ALLOWED_PRIVATE:
                out.append(f"{where}:{node.lineno}: {base}.{node.attr} (a private attribute)")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_") and not str(node.args[1].value).startswith("__")):
            out.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r}) (a private attribute)")
    return out


def test_bench_uses_only_torchferrys_public_api():
    """No ``torchferry._core`` (or any other non-bench torchferry module) import, only names of
    ``torchferry.__all__`` from ``torchferry``, and no private attribute read off an object other than
    ``self`` (a Ferry's ``_pool``, a handle's ``_event``...), but for the torch internals allowed above."""
    found = [v for f in _modules() for v in _violations(f)]
    assert not found, "\n".join(found)


def test_the_rule_catches_what_it_forbids():
    source = ("from ..._core._host.pool import HostPool\nfrom ... import Ferry, _version\n"
              "import torchferry._core\nx = ferry._pool.ready()\ny = getattr(s, '_ferries', None)\n"
              "from .._common.units import local_of\nfrom torchferry import Dock\n")  # the last two are fine
    found = _violations(BENCH / "rl_step" / "probe.py", source)
    assert len(found) == 5 and "torchferry._core._host.pool" in found[0], found


def test_one_folder_or_module_per_scenario_and_no_file_over_500_lines():
    top = sorted(p.name for p in BENCH.iterdir() if not p.name.startswith("__"))
    assert top == ["_common", "grpo", "lora.py", "pin.py", "rl_step"], top
    long = [f"{p.relative_to(BENCH)}: {n}" for p in _modules() if (n := len(p.read_text().splitlines())) > 500]
    assert not long, long
    assert not (BENCH.parents[2] / "benchmarks" / "grpo_dock.py").exists()  # replaced by torchferry bench-grpo
