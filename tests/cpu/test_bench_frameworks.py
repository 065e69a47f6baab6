"""benchmarks/frameworks.py --tiny on the CPU (gloo, world size 1): SkyRL's and AReaL's own offload
functions, unpatched and patched, end to end, and the JSON they produce.

Without a GPU the seconds are Python overhead (no rates, no link peak), but the bytes, the
bit-exactness and the forward-only offloads' copied bytes are real. Skipped, with the reason the
script recorded, where SkyRL's ``fsdp_utils`` or AReaL's ``fsdp_engine`` does not import here
(``pip install --no-deps --ignore-requires-python -r tests/frameworks.txt``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "frameworks.py"
CYCLES = 4  # 1 warm-up + 3 timed, the script's default
SKYRL_OPS = ("offload_model", "offload_optimizer", "load_model", "load_optimizer", "offload", "load")


def _load_script():
    spec = importlib.util.spec_from_file_location("tf_bench_frameworks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    if importlib.util.find_spec("skyrl") is None and importlib.util.find_spec("areal") is None:
        pytest.skip("neither skyrl nor areal is installed (pip install --no-deps --ignore-requires-python "
                    "-r tests/frameworks.txt)")
    out = tmp_path_factory.mktemp("frameworks") / "frameworks.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--json", str(out)], capture_output=True, text=True,
                       timeout=240, cwd=ROOT, env=env)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-4000:])
    assert "all bit-exact" in p.stdout  # the closing summary under the table
    return json.loads(out.read_text())


def _framework(result: dict, name: str) -> dict:
    fw = result["frameworks"][name]
    if not fw.get("available"):
        pytest.skip(f"{name}: {fw.get('reason')}")
    assert "error" not in fw, fw["error"]
    return fw


def _full_op(s: dict) -> None:
    assert s["cycles"] == CYCLES and s["warm_cycles"] == CYCLES - 1
    assert len(s["all_s"]) == CYCLES and all(x >= 0 for x in s["all_s"])
    assert s["min_s"] <= s["median_s"] <= s["max_s"]
    assert s["bytes"] > 0 and s["first_bytes"] > 0
    assert s["GBps"] is None and s["frac_of_peak"] is None  # no transfer rates without a GPU


def test_record_env_and_no_rates_without_a_gpu(result):
    assert result["schema"] == "torchferry.frameworks/1"
    env = result["env"]
    assert env["gpu"] is None and env["torch"] and env["python"] and env["date"]
    assert "commit" in env and env["command"].startswith("python ") and "--tiny" in env["command"]
    assert result["link_peak_GBps"] is None and "no GPU" in result["link_peak_note"]
    assert result["config"]["preset"] == "tiny" and result["config"]["world_size"] == 1
    assert result["flags"] == []
    assert result["checks"]["all_patched_at_target"] is None  # no peak to compare with


def test_skyrl_helpers_unpatched_and_patched_bit_exact(result):
    fw = _framework(result, "skyrl")
    assert fw["version"] == "0.4.0"
    assert fw["state_bytes"]["model"] > 0 and fw["state_bytes"]["optimizer"] > 0
    for path in ("unpatched", "patched"):
        p = fw["paths"][path]
        for op in SKYRL_OPS:
            _full_op(p["ops"][op])
        assert p["bit_exact"]["equal"] is True and p["bit_exact"]["checks"] == CYCLES, p["bit_exact"]
        assert result["checks"]["bit_exact"][f"skyrl.{path}"] is True
    patched = fw["paths"]["patched"]
    assert set(patched["patched"]) >= {f"skyrl.backends.skyrl_train.distributed.fsdp_utils.{h}" for h in (
        "offload_fsdp2_model_to_cpu", "load_fsdp2_model_to_gpu", "offload_fsdp_optimizer", "load_fsdp_optimizer")}
    assert patched["identities_kept"] is True  # torchferry keeps every tensor object
    assert patched["ferry_state_bytes"] == fw["state_bytes"]
    ops = patched["ops"]
    model_copied, model_bytes = ops["offload_model"]["copied_bytes_all"], fw["state_bytes"]["model"]
    # An actor after a step: all of it copied but buffers no one wrote (the rotary inv_freq), skipped as unchanged.
    assert model_copied[0] == model_bytes and all(model_bytes - 4096 <= c <= model_bytes for c in model_copied)
    assert ops["offload"]["bytes"] == ops["offload_model"]["bytes"] + ops["offload_optimizer"]["bytes"]


def test_skyrl_forward_only_round_trips_bit_exact(result):
    fw = _framework(result, "skyrl")
    fo = fw["forward_only"]
    assert fo["state_bytes"] > 0
    for path in ("unpatched", "patched"):
        p = fo[path]
        _full_op(p["ops"]["load_model"])
        assert p["bit_exact"]["equal"] is True, p["bit_exact"]
        assert p["forward_outputs_equal"] is True
        assert len(p["offload_bytes_copied"]) == CYCLES and p["offload_bytes_copied"][0] > 0
    assert fo["unpatched"]["offload_bytes_copied"] == [fo["state_bytes"]] * CYCLES  # model.to("cpu") copies all
    assert fo["unpatched"]["copies_nothing_after_first"] is False


def test_skyrl_forward_only_patched_offloads_copy_nothing_after_the_first(result):
    fo = _framework(result, "skyrl")["forward_only"]["patched"]
    copied = fo["offload_bytes_copied"]
    assert fo["ferry_skip_unchanged"] is True  # [Note: the helpers skip unchanged storages]
    assert copied[0] > 0 and copied[1:] == [0] * (CYCLES - 1)
    assert fo["copies_nothing_after_first"] is True
    assert result["checks"]["forward_only_copies_nothing_after_first"]["skyrl"] is True


def test_areal_patched_offload_onload_bit_exact(result):
    fw = _framework(result, "areal")
    assert fw["version"] == "1.0.4"
    assert fw["state_bytes"]["grads_included"] is True  # AReaL keeps the .grads after train_batch
    p = fw["paths"]["patched"]
    for op in ("offload", "onload"):
        _full_op(p["ops"][op])
    assert p["ops"]["offload"]["copied_bytes_all"] == [p["ops"]["offload"]["bytes"]] * CYCLES  # an actor: all copied
    assert p["bit_exact"]["equal"] is True and p["bit_exact"]["checks"] == CYCLES, p["bit_exact"]
    assert p["identities_kept"] is True
    assert p["patched"] == ["areal.engine.fsdp_engine.FSDPEngine.offload", "areal.engine.fsdp_engine.FSDPEngine.onload"]
    # AReaL's own methods need torch_memory_saver (CUDA): not run here, and the JSON says why
    assert "CUDA" in fw["paths"]["unpatched"]["skipped"] and "CUDA" in fw["torch_memory_saver"]["reason"]
    assert "CUDA" in fw["forward_only"]["unpatched"]["skipped"]


def test_areal_forward_only_patched_offloads_copy_nothing_after_the_first(result):
    fo = _framework(result, "areal")["forward_only"]["patched"]
    assert fo["ferry_skip_unchanged"] is True  # an engine without optimizer
    copied = fo["offload_bytes_copied"]
    assert len(copied) == CYCLES and copied[0] == fo["state_bytes"] > 0 and copied[1:] == [0] * (CYCLES - 1)
    assert fo["copies_nothing_after_first"] is True and fo["forward_outputs_equal"] is True
    assert fo["bit_exact"]["equal"] is True, fo["bit_exact"]
    assert fo["ops"]["onload"]["bytes"] == fo["state_bytes"]  # the reload brings everything back
    assert result["checks"]["forward_only_copies_nothing_after_first"]["areal"] is True


def test_a_rate_above_the_link_peak_is_flagged_not_capped():
    fw = _load_script()
    samples = [{"s": 0.5, "bytes": 10 * 10**9}, {"s": 0.1, "bytes": 10 * 10**9}, {"s": 0.1, "bytes": 10 * 10**9}]
    s = fw.summarise(samples, peak=50.0)  # 100 GB/s warm against a 50 GB/s peak
    assert s["frac_of_peak"] == pytest.approx(2.0) and s["first_frac_of_peak"] == pytest.approx(0.4)
    import torch

    run = fw.Run(fw._parse(["--tiny"]), device=torch.device("cpu"), peak={"h2d": 50.0, "d2h": 50.0})
    fw._flag_over_peak({"frameworks": {"x": {"paths": {"patched": {"ops": {"offload": s}}}}}}, run)
    assert any("frameworks.x.paths.patched.ops.offload.frac_of_peak = 2.0000 > 1.0" in f for f in run.flags)
    assert not any("first_frac_of_peak" in f for f in run.flags)


def test_a_large_preset_without_a_gpu_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    p = subprocess.run([sys.executable, str(SCRIPT), "--preset", "qwen2.5-1.5b"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 2 and "needs a GPU" in p.stderr


def test_the_link_peak_is_the_faster_of_before_and_after_and_rescales_every_fraction():
    """``_settle_peak``: per direction the faster measurement; offloads' fractions rescaled against
    D2H, loads' against H2D, forward-only paths too; both measurements kept."""
    fw = _load_script()
    summary = lambda f: {"frac_of_peak": f, "max_cycle_frac_of_peak": f, "frac_of_peak_excluding_release": f,  # noqa: E731
                         "GBps": 50.0}
    result = {"link_peak_GBps": {"h2d": 50.0, "d2h": 55.0, "bidir": 90.0, "nbytes": 1 << 30},
              "frameworks": {"skyrl": {"paths": {"patched": {"ops": {"offload_model": summary(1.0),
                                                                     "load_model": summary(1.0)}}},
                                       "forward_only": {"patched": {"ops": {"load_model": summary(0.5)}}}}}}
    run = fw.Run(None, torch.device("cpu"), dict(result["link_peak_GBps"]))
    fw._settle_peak(result, run, {"h2d": 55.0, "d2h": 50.0, "bidir": 95.0, "nbytes": 1 << 30})
    peak = result["link_peak_GBps"]
    assert (peak["h2d"], peak["d2h"], peak["bidir"]) == (55.0, 55.0, 95.0) and peak["before"]["h2d"] == 50.0
    ops = result["frameworks"]["skyrl"]["paths"]["patched"]["ops"]
    assert ops["offload_model"]["frac_of_peak"] == 1.0  # D2H: the first measurement was the faster
    for key in ("frac_of_peak", "max_cycle_frac_of_peak", "frac_of_peak_excluding_release"):
        assert ops["load_model"][key] == pytest.approx(50.0 / 55.0)
    assert ops["load_model"]["GBps"] == 50.0
    assert result["frameworks"]["skyrl"]["forward_only"]["patched"]["ops"]["load_model"]["frac_of_peak"] == \
        pytest.approx(0.5 * 50.0 / 55.0)
    assert run.peak is peak
