"""benchmarks/verl_actor.sh end to end on the CPU (tiny model, 2 gloo ranks): verl 0.9.1's own
TrainingWorker / FSDP2 engine with param and optimizer offload, resident, unpatched and with
torchferry (its defaults, and a variant with layer-wise reload and optimizer_at_step off), one actor
each in a process of its own (and, for LoRA, all in one process), rounds interleaved, and the
torchferry.verl-step/1 JSON it writes. (On GPUs the same command is the real run.)"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.workers.engine_workers", reason="verl's actor code and what it imports are not installed")
pytest.importorskip("hydra")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import verl_actor  # noqa: E402
import verl_isolate  # noqa: E402

PLAIN = "plain:TORCHFERRY_LAYERWISE_RELOAD=0,TORCHFERRY_OPTIMIZER_AT_STEP=0"


def _run(out: Path, **env: str) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable,
           "VERL_ACTOR_MODEL_DIR": str(out / "model"), "OMP_NUM_THREADS": "1", **env}
    for k in ("TORCHFERRY_LAYERWISE_RELOAD", "TORCHFERRY_OPTIMIZER_AT_STEP", "TORCHFERRY_SKIP_UNCHANGED"):
        env.pop(k, None)  # the torchferry strategy runs patch()'s defaults
    p = subprocess.run(["bash", "benchmarks/verl_actor.sh", str(out), "2", "tiny", "3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    return json.loads((out / "runs.json").read_text())


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_actor")
    runs = _run(out, VERL_ACTOR_VARIANTS=PLAIN, VERL_ACTOR_WEIGHT_SYNC="1")
    [path] = out.glob("verl_step_tiny_fsdp2-full-tiny_cpux2_*.json")
    return out, runs, json.loads(path.read_text())


def _events(runs: dict, label: str, rank: int = 0) -> list[dict]:
    return runs["per_rank"][rank]["strategies"][label]["events"]


def test_every_strategy_is_bit_identical_to_verls_own_run(result):
    out, runs, r = result
    assert r["schema"] == "torchferry.verl-step/1"
    assert r["env"]["verl"] == "0.9.1" and r["env"]["world_size"] == 2 and r["env"]["gpu"] is None
    assert r["env"]["command"] == (f"VERL_ACTOR_VARIANTS='{PLAIN}' VERL_ACTOR_WEIGHT_SYNC='1' "
                                   "bash benchmarks/verl_actor.sh OUT 2 tiny 3")
    assert any("TrainingWorker" in line for line in r["verl_code"])
    assert [s["label"] for s in r["config"]["strategies"]] == ["resident", "verl", "torchferry", "plain"]
    assert r["config"]["processes"] == 4 and r["config"]["interleaved"].startswith("one process per strategy")
    for label in ("resident", "verl", "torchferry", "plain"):  # no GPU: no memory figures, the keys there
        st = r["strategies"][label]
        assert st["phase_peak_gpu_bytes"] == {} and st["free_at_rollout_wake_bytes"] is None
        assert len(st["probe_per_step"]) == 3 and all(p["alloc_retries"] == 0 for p in st["probe_per_step"])
    for label, st in runs["per_rank"][0]["strategies"].items():  # each phase's CPU seconds beside its wall seconds
        assert st["blocking_sync"] is None and len(st["phase_cpu_s"]) == len(st["phase_s"]) == 3
        for wall, cpu in zip(st["phase_s"], st["phase_cpu_s"], strict=True):
            assert list(cpu) == list(wall) and all(0 <= c for c in cpu.values()), (label, wall, cpu)
    assert set(r["bars"]) == {"resident_step_spread", "torchferry", "plain"}
    assert r["bit_identical"] is True and r["bit_identical_to_verl"] == {"resident": True, "torchferry": True,
                                                                        "plain": True}
    assert r["compared"] == {"steps": 3, "ranks": 2, "parameter_shards": 2 * 26, "optimizer_state_tensors": 2 * 26 * 3,
                             "weight_sync_tensors": 27}  # 26 parameters + the tied lm_head
    assert all(d["differing"] == {} for d in r["bit_identical_detail"].values())
    u, t = r["runs"]["verl"], r["runs"]["torchferry"]
    assert u["losses"] == t["losses"] and len(u["losses"]) == 3 and len(u["losses"][0]) == 2  # 2 PPO mini-batches
    assert len({str(x) for x in u["losses"]}) == 3  # the steps trained: each step's losses differ
    assert u["patched"] == [] and "verl.workers.engine.fsdp.transformer_impl.offload_fsdp_model_to_cpu" in t["patched"]
    # rounds interleaved: each strategy took each place in the round order once in the first rounds
    assert [r["runs"][k]["order_in_round"] for k in ("resident", "verl", "torchferry")] == [[0, 3, 2], [1, 0, 3],
                                                                                            [2, 1, 0]]
    for s in (u, t):
        # update_actor moved parameters + AdamW state: offloads at steps 1-3, reloads (with state) at steps 2-3
        assert len(s["offload_s"]["all"]) == 3 and len(s["reload_s"]["all"]) == 2
        assert s["offload_s"]["first"] > 0 and s["reload_s"]["first"] > 0
        assert len(s["model_only_offload_s"]["all"]) == 3 and s["init_offload_s"] > 0
        assert s["state_bytes"]["optimizer"] > s["state_bytes"]["params"] > 0
        assert s["peak_gpu_allocated_bytes"] is None  # no GPU
    detail = t["pinned_host_bytes_detail"]
    assert len(detail["ferries"]) == 2 and all("residency=HOST" in f for f in detail["ferries"])
    assert detail["torchferry_pool_bytes"] >= sum(t["state_bytes"].values())
    assert r["runs"]["resident"]["bytes_moved_per_step"] == {"offload": 0, "reload": 0}
    sizes = u["state_bytes"]  # reloaded before old_log_prob (parameters) and update_actor (both)
    assert u["bytes_moved_per_step"]["reload"] == 2 * sizes["params"] + sizes["optimizer"]
    # torchferry's offload after old_log_prob copies nothing: the forward changed no byte
    assert t["bytes_moved_per_step"]["offload"] < u["bytes_moved_per_step"]["offload"]


def test_the_exposed_figures_are_the_per_round_differences(result):
    _, runs, r = result
    ex = r["exposed"]
    base = runs["per_rank"][0]["strategies"]["resident"]["step_s"][1:]
    for label in ("verl", "torchferry", "plain"):
        steps = runs["per_rank"][0]["strategies"][label]["step_s"][1:]
        per_round = [a - b for a, b in zip(steps, base, strict=True)]
        assert ex[label]["exposed_transfer_s_per_step"]["all"] == pytest.approx(per_round)
        at_calls = [sum(e["seconds"] for e in _events(runs, label) if e["step"] == s) for s in (1, 2)]
        assert ex[label]["transfer_at_calls_s_per_step"]["all"] == pytest.approx(at_calls)
        assert min(at_calls) > 0
    v = ex["verl"]["transfer_at_calls_s_per_step"]
    if v["median"] > v["max"] - v["min"]:  # a ratio where verl's figure is above its own spread ...
        assert ex["torchferry"]["at_calls_over_verl"] == pytest.approx(
            ex["torchferry"]["transfer_at_calls_s_per_step"]["median"] / v["median"])
    else:  # ... else none (on a busy CPU the tiny model's calls can spread more than that)
        assert ex["torchferry"]["at_calls_over_verl"] is None


def test_patch_defaults_leave_the_state_to_the_forward_and_the_step(result):
    """verl's patch() defaults: the optimizer state comes back only at ``optimizer.step()`` and the
    parameters unit by unit at their forward; the variant with both off reloads whole."""
    _, runs, r = result
    assert r["runs"]["torchferry"]["torchferry_settings"] == {}
    assert r["runs"]["plain"]["torchferry_settings"] == {"TORCHFERRY_LAYERWISE_RELOAD": "0",
                                                         "TORCHFERRY_OPTIMIZER_AT_STEP": "0"}
    for label, model_after, opt_after in (("torchferry", "PREFETCHING", "PREFETCHING"), ("plain", "DEVICE", "DEVICE")):
        events = _events(runs, label)
        reloads = [e for e in events if e["direction"] == "reload" and e["model"]]
        # the first reload comes before FSDP2's lazy init (the first forward), when the units are not known: whole
        assert {e["model_residency_after"] for e in reloads[1:]} == {model_after}, (label, reloads)
        assert [e["optimizer_residency_after"] for e in events
                if e["phase"] == "update" and e["direction"] == "reload" and e["optimizer"]] == [opt_after] * 2


def test_report_says_what_differs(result):
    out, runs, _ = result
    a = verl_actor._view(runs, "verl")
    b = copy.deepcopy(verl_actor._view(runs, "torchferry"))
    assert verl_actor.identical(a, b) == ({"losses": True, "log_probs": True, "params": True,
                                          "optimizer_state": True, "weight_sync": True}, {})
    name = "layers.0.mlp.up_proj.weight"
    b["per_rank"][1]["against_verl"]["params"].append(name)
    b["per_rank"][0]["losses"][1][0] += 1e-7
    same, differing = verl_actor.identical(a, b)
    assert same == {"losses": False, "log_probs": True, "params": False, "optimizer_state": True, "weight_sync": True}
    assert differing == {"losses": True, "params": [f"rank1:{name}"]}
    # against_verl from the fingerprints: a changed or a missing name is reported
    fps = runs["per_rank"][0]["strategies"]["torchferry"]["fingerprints"]
    ref = copy.deepcopy(fps)
    ref["params"][name] = "changed"
    del ref["optimizer_state"][next(iter(ref["optimizer_state"]))]
    got = verl_actor.against(ref, fps)
    assert got["params"] == [name] and len(got["optimizer_state"]) == 1 and got["weight_sync"] == []
    with pytest.raises(ValueError, match="verl's records are missing"):
        verl_actor.merge_runs([{**runs, "strategies": [s for s in runs["strategies"] if s["label"] != "verl"],
                                "per_rank": [{**x, "strategies": {k: v for k, v in x["strategies"].items()
                                                                  if k != "verl"}} for x in runs["per_rank"]],
                                "strategies_all": [s for s in runs["strategies_all"] if s["label"] != "verl"]}])
    with pytest.raises(SystemExit, match="must have distinct labels and include verl"):
        verl_actor.parse_strategies(["resident", "torchferry"])
    with pytest.raises(SystemExit, match="is none of resident, verl, torchferry, LABEL:K=V"):
        verl_actor.parse_strategies(["verl", "plain:"])


def test_a_merged_runs_json_reports_again(result):
    """A kept ``runs.json`` (the processes' records merged) gives the same records when merged again, so
    ``verl_actor.py report OUT/runs.json`` rebuilds the JSON; each phase's wall and CPU seconds per step are
    in it."""
    _, runs, out = result
    again = verl_actor.merge_runs([copy.deepcopy(runs)])
    assert again["per_rank"] == runs["per_rank"]
    redone = verl_actor.report(again)
    assert redone["runs"]["verl"]["pinned_host_bytes"] == out["runs"]["verl"]["pinned_host_bytes"]
    for label, entry in redone["strategies"].items():
        assert entry["phase_s_per_step"] == out["strategies"][label]["phase_s_per_step"]
        steps = entry["phase_cpu_s_per_step"]
        assert len(steps) == len(entry["phase_s_per_step"]) > 0 and set(steps[0]) == set(entry["phase_s_per_step"][0])
        assert all(v >= 0 for step in steps for v in step.values())


def test_lora_adds_the_reference_phase_and_stays_bit_identical_through_the_weight_sync(tmp_path):
    """With LoRA the reference log-probs come from the actor with its adapters off (verl's
    ref_in_actor), and verl's first weight sync (the base, ``base_sync_done=False``) calls
    ``model.to("cpu")`` on the FSDP2 model right after ``load_fsdp_model_to_gpu``: with the layer-wise
    reload on, that is while the state is still on the host ([Note: FSDP2's shard buffer after a
    move]); later syncs send the adapters only. The run stays bit-identical to verl's."""
    runs = _run(tmp_path, VERL_ACTOR_LORA_RANK="4", VERL_ACTOR_WEIGHT_SYNC="1", VERL_ACTOR_RESIDENT="0",
                VERL_ACTOR_ISOLATE="0")  # all strategies in one process: that mode too
    assert runs["config"].get("processes", 1) == 1
    [path] = tmp_path.glob("verl_step_tiny_fsdp2-lora-tiny_cpux2_*.json")
    r = json.loads(path.read_text())
    assert r["config"]["lora"] is True and r["config"]["phases"] == ["rollout", "log_prob", "ref", "update",
                                                                     "weight_sync"]
    assert r["bit_identical"] is True, r["bit_identical_detail"]
    assert all(len(x["ref_log_prob_sha256"]) == 3 for x in verl_actor._view(runs, "torchferry")["per_rank"])
    # no resident strategy: no step-minus-resident figure, the seconds inside the calls all the same
    assert "resident_step_spread" not in r["exposed"]
    assert all("exposed_transfer_s_per_step" not in v and v["transfer_at_calls_s_per_step"]["median"] >= 0
               for k, v in r["exposed"].items() if isinstance(v, dict) and "step_s" in v)
    for label in ("verl", "torchferry"):  # the sync's own load and offload are timed too ([Note: the calls timed])
        ws = [(e["step"], e["direction"], e["model"], e["optimizer"]) for e in _events(runs, label)
              if e["phase"] == "weight_sync"]
        # the first sync reads the parameters twice (the adapters, then the base: _weight_sync)
        assert ws == [(s, d, True, False) for s in (0, 0, 1, 2) for d in ("reload", "offload")], (label, ws)
    assert all(e["bytes"] > 0 for e in _events(runs, "verl") if e["phase"] == "weight_sync"
               and e["direction"] == "reload")
    # torchferry's sync of the adapters alone leaves the model offloaded ([Note: the LoRA weight sync reads the
    # adapters where they are]): no byte moved, on the host after each call; the base's sync reloads it
    tf = [e for e in _events(runs, "torchferry") if e["phase"] == "weight_sync"]
    base = tf[2:4]  # step 0's second sync
    adapters = tf[:2] + tf[4:]
    assert all(e["bytes"] == 0 and e["model_residency_after"] == "HOST" for e in adapters), adapters
    assert base[0]["direction"] == "reload" and base[0]["bytes"] > 0, base
    for x in verl_actor._view(runs, "torchferry")["per_rank"]:  # the base on the first sync, then the adapters
        first, *later = x["weight_sync_bytes_per_step"]
        assert len(later) == 2 and all(0 < b < x["state_bytes"]["params"] / 4 < first for b in later), (first, later)
    # the base's buffers are among those compared with verl's: one per parameter of a rank (summed over
    # the ranks in parameter_shards) and the tied lm_head; the adapters alone would be about half
    c = r["compared"]
    assert c["weight_sync_tensors"] == c["parameter_shards"] // c["ranks"] + 1, c


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_logprobs_match_verls_row_by_row_fallback(dtype):
    """The bench's chunked log-probs give verl's row-wise fallback's values, past a chunk's end too:
    bf16 bit for bit (both take log_softmax per row), fp32 to rounding (verl's takes x - logsumexp)."""
    import torch
    from verl.utils.torch_functional import logprobs_from_logits_v2

    g = torch.Generator().manual_seed(0)
    rows = verl_actor.LOGPROB_ROWS + 37
    logits = (torch.randn(rows, 97, generator=g) * 4).to(getattr(torch, dtype))
    labels = torch.randint(0, 97, (rows,), generator=g)
    got = verl_actor._logprobs_chunked(logits, labels)
    want = logprobs_from_logits_v2(logits, labels)
    assert got.shape == (rows,) and got.dtype == logits.dtype
    exact = {"atol": 0, "rtol": 0} if dtype == "bfloat16" else {}
    torch.testing.assert_close(got, want, **exact)
    # the (batch, seq) layout keeps its shape; labels that do not match the rows are refused
    assert verl_actor._logprobs_chunked(logits.view(1, rows, 97), labels.view(1, rows)).shape == (1, rows)
    with pytest.raises(ValueError, match="one label per row"):
        verl_actor._logprobs_chunked(logits.view(1, rows, 97), labels)


def test_fingerprints_tell_bytes_apart():
    """Byte for byte: -0.0 is not 0.0, a NaN is itself, the shape counts, a 0-dim tensor (AdamW's step)
    works; a changed word and two swapped words change it; a chunk's end changes nothing."""
    import torch

    fp = verl_isolate.fingerprint
    assert fp(torch.tensor([0.0]), "cpu") != fp(torch.tensor([-0.0]), "cpu")
    assert fp(torch.tensor([float("nan")]), "cpu") == fp(torch.tensor([float("nan")]), "cpu")
    assert fp(torch.zeros(2), "cpu") != fp(torch.zeros(1, 2), "cpu")
    assert fp(torch.tensor(3.0), "cpu") == fp(torch.tensor(3.0), "cpu") != fp(torch.tensor(3.5), "cpu")
    x = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[[3, 7]] = y[[7, 3]]
    z = x.clone()
    z.view(torch.int64)[500] ^= 1
    assert len({fp(x, "cpu"), fp(y, "cpu"), fp(z, "cpu")}) == 3
    assert fp(x, "cpu") == fp(x.clone(), "cpu") and fp(x[1:], "cpu") != fp(x[:-1], "cpu")
    before = x.clone()
    fp(x, "cpu")
    assert torch.equal(x, before)  # computed beside the tensor, never in it


def test_turns_go_in_ticket_order_and_stop_when_another_process_failed(tmp_path):
    t = verl_isolate.Turns(str(tmp_path), rank=0, timeout_s=0.2)
    t.wait(0)  # no turn file yet: ticket 0
    t.done(0)
    t.wait(1)
    with pytest.raises(SystemExit, match="no turn 5 after"):
        t.wait(5)
    assert not t.decide_stop(0, 1.0) and t.stop_round() is None
    (tmp_path / "rounds_t0").write_text("0.0")  # rounds began long ago
    assert not t.decide_stop(1, 1.0) and t.decide_stop(2, 1.0) and t.stop_round() == 2
    (tmp_path / "failed").write_text("x")
    with pytest.raises(SystemExit, match="another strategy's process failed"):
        t.wait(5)
    verl_isolate.Turns(None, rank=0).wait(99)  # one process: no turns


def test_each_strategys_process_gets_its_own_cpus():
    """pin_cpus gives share I of N (split again among ranks) to the process and every thread it starts
    later; with fewer CPUs than processes it pins nothing. Run in a child: affinity is per process."""
    code = ("import json, os, sys, threading; sys.path.insert(0, 'benchmarks'); from verl_isolate import pin_cpus\n"
            "n = len(os.sched_getaffinity(0)); mine = pin_cpus(n - 1, n) if n >= 2 else None\n"
            "seen = []; t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
            "t.start(); t.join()\n"
            "print(json.dumps([n, mine, sorted(os.sched_getaffinity(0)), seen[0], pin_cpus(0, n + 1)]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    n, mine, now, thread, unpinned = json.loads(p.stdout)
    if n < 2:
        pytest.skip("one CPU: nothing to split")
    last = [sorted(os.sched_getaffinity(0))[-1]]
    assert mine == now == thread == last
    assert unpinned == last  # more processes than CPUs: the affinity left as it was (here: the one CPU)


class _FakeNVML:
    """NVML's counters as a test sets them: the probe reads their change over a step."""
    NVML_PERF_POLICY_POWER, NVML_PERF_POLICY_THERMAL, NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 0, 1, 0, 2, 0

    def __init__(self):
        self.capped_ns = {0: 5_000_000_000, 1: 0}
        self.energy_mj = 1_000_000

    def nvmlDeviceGetViolationStatus(self, h, policy):
        return type("V", (), {"violationTime": self.capped_ns[policy]})()

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return self.energy_mj

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1980 if clock == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 61


def test_blocking_sync_says_why_it_did_not_apply_without_a_gpu_driver():
    if os.path.exists("/proc/driver/nvidia"):
        pytest.skip("an NVIDIA driver is loaded here")
    assert verl_isolate.blocking_sync(0).startswith("not set: ")


def test_the_step_probe_reads_the_gpus_capped_seconds_and_energy_over_the_step():
    """A cap that comes and goes inside a step is invisible to a clock read at its end: the probe gives NVML's
    cumulative power- and thermal-capped seconds and joules as their change over the step, and None where NVML
    does not answer."""
    import torch

    probe = verl_isolate.StepProbe(torch.device("cpu"))
    nv = _FakeNVML()
    probe._nvml = (nv, None)
    probe.begin()
    nv.capped_ns[0] += 250_000_000  # 0.25 s held down by the power limit during the step
    nv.energy_mj += 1_500_000  # 1,500 J
    out = probe.end()
    assert out["gpu_power_capped_s"] == pytest.approx(0.25) and out["gpu_thermal_capped_s"] == 0
    assert out["gpu_energy_j"] == pytest.approx(1500.0)
    assert (out["sm_clock_mhz"], out["mem_clock_mhz"], out["gpu_temp_c"]) == (1980, 2619, 61)
    probe._nvml = None  # no NVML: no readings, no error
    probe.begin()
    out = probe.end()
    assert out["gpu_power_capped_s"] is None and out["gpu_energy_j"] is None and out["gpu_temp_c"] is None


def test_the_step_probe_times_the_host_before_and_after_the_step_and_reads_the_cores_clock(tmp_path, monkeypatch):
    """A host slow at both ends of a step was slow through it; slow at the start only, its core was waking up:
    the fixed workload is timed at both ends, and the step thread's CPU clock read where the machine tells it
    (the kernel's cpufreq, else /proc/cpuinfo's ``cpu MHz`` for that CPU)."""
    import builtins

    import torch

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu MHz\t\t: 2000.5\n\nprocessor\t: 1\ncpu MHz\t\t: 3100.25\n")
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if str(path).startswith("/sys/devices/system/cpu/"):
            raise FileNotFoundError(path)  # no cpufreq here: /proc/cpuinfo's line instead
        return real_open(cpuinfo if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert verl_isolate.StepProbe.cpu_mhz(1) == 3100.25 and verl_isolate.StepProbe.cpu_mhz(0) == 2000.5
    assert verl_isolate.StepProbe.cpu_mhz(7) is None and verl_isolate.StepProbe.cpu_mhz(None) is None
    monkeypatch.setattr(verl_isolate.StepProbe, "main_cpu", staticmethod(lambda: 1))
    probe = verl_isolate.StepProbe(torch.device("cpu"))
    probe.begin()
    out = probe.end()
    assert out["host_reference_s"] > 0 and out["host_reference_end_s"] > 0
    assert out["cpu_mhz_at_start"] == out["cpu_mhz_at_end"] == 3100.25


def test_each_process_gets_whole_cores_where_the_kernel_shows_the_hyperthreads(tmp_path):
    """CPUs grouped by the kernel's thread siblings (8 CPUs, 4 cores, siblings 0+4, 1+5, ...): two processes
    get two whole cores each, so none shares a core with the other; four ranks of one process a core each;
    more processes than cores: single CPUs; more than CPUs: nothing (the caller leaves the affinity)."""
    for c in range(8):
        d = tmp_path / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(f"{c % 4},{c % 4 + 4}\n")
    cpus = list(range(8))
    cores = verl_isolate.cpu_cores(cpus, str(tmp_path))
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [verl_isolate.cpu_share(cpus, cores, i, 2) for i in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [verl_isolate.cpu_share(cpus, cores, 0, 1, r, 4) for r in range(4)] == cores
    assert [verl_isolate.cpu_share(cpus, cores, i, 8) for i in range(8)] == [[c] for c in cpus]
    assert verl_isolate.cpu_share(cpus, cores, 0, 9) == []
    # siblings outside the allowed CPUs are not counted; an unreadable CPU is a core of its own
    assert verl_isolate.cpu_cores([0, 1, 2, 9], str(tmp_path)) == [[0], [1], [2], [9]]
    assert verl_isolate._cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}


def test_the_step_probe_gives_each_threads_cpu_seconds_by_name():
    """A thread that burns CPU during the step shows under its name with its seconds, the step's own thread
    as ``main``: what kept the step's thread off its CPU, where the step is the host's work."""
    import threading
    import time

    import torch

    probe = verl_isolate.StepProbe(torch.device("cpu"))
    probe._nvml = None

    spun, done = threading.Event(), threading.Event()

    def spin():
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.3:
            pass
        spun.set()
        done.wait()  # alive at the step's end: a thread that ended within the step is not read

    probe.begin()
    t = threading.Thread(target=spin)
    t.start()
    spun.wait()
    step = probe.end()
    out = step["threads"]
    done.set()
    t.join()
    assert step["cpu_s_since_last_step"] is None  # the first step: nothing before it
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:  # CPU burnt between two steps
        pass
    probe.begin()
    assert probe.end()["cpu_s_since_last_step"] >= 0.2
    assert "main" in out
    others = {k: v for k, v in out.items() if k != "main"}
    assert sum(v["cpu_s"] for v in others.values()) >= 0.25, out
    assert all(set(v) == {"cpu_s", "involuntary_switches"} for v in out.values())


def test_the_gpus_busy_seconds_are_the_union_of_its_intervals_within_each_phase():
    """--gpu-busy: overlapping kernels count once, a gap counts nothing, an interval across a phase's end is
    split between the two phases; the host's runtime calls inside the step say the clocks agree."""
    from verl_step.gpu_busy import GpuBusy, busy_ns

    assert busy_ns([(0, 10), (5, 15), (20, 30)], 0, 100) == 25
    assert busy_ns([(20, 30), (0, 10), (5, 15)], 8, 25) == 12  # 8-15 and 20-25
    assert busy_ns([], 0, 10) == 0 and busy_ns([(0, 10)], 10, 20) == 0
    b = GpuBusy(enabled=False)
    b.begin()
    b.mark("rollout")
    assert b.end() is None
    b._t0, b._t_exit = 1_000_000_000, 1_900_000_000
    b._marks = [("rollout", 1_300_000_000), ("update", 1_800_000_000)]
    s = 1_000_000_000
    got = b.split([(s + 100_000_000, s + 250_000_000), (s + 200_000_000, s + 400_000_000), (s + 700_000_000,
                   s + 750_000_000)], [(s + 10_000_000, s + 20_000_000)])
    assert got["busy_s"] == {"rollout": pytest.approx(0.2), "update": pytest.approx(0.15)}
    assert got["step_busy_s"] == pytest.approx(0.35) and got["device_events"] == 3 and got["aligned"] is True
    assert b.split([], [(5, 6)])["aligned"] is False  # a host call years before the step: the clocks differ
