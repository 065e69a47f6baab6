"""``run``: each strategy's actor stepped in turns, every measurement recorded."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from verl_isolate import StepProbe, Turns, blocking_sync, context_bytes, cpu_cores, pin_cpus, repin

from verl_step.common import ATTENTION, ROOT
from verl_step.config import _batch, _build_actor, _shape, _verl_config
from verl_step.environment import _cpu_engine_to_by_direction, _install_cpu_platform, _use_ray_stub_if_needed
from verl_step.logprobs import LOGPROB_ROWS, _logprobs_chunked
from verl_step.records import _part_bytes, _sha, fingerprints
from verl_step.rollout import RolloutStandIn, _gpu_bytes, _rewarm_cublas, _weight_sync, _write_segments
from verl_step.strategies import BUDGETS, Strategy, _settings_env, dock_budget, lora_trainable, parse_strategies
from verl_step.gpu_busy import GpuBusy
from verl_step.timing import CallTimer


def cmd_run(args) -> None:
    cpus = None
    if args.cpu_slot:  # before torch starts a thread: every thread of the process inherits the share
        cpus = pin_cpus(args.cpu_slot[0], args.cpu_slot[1], int(os.environ.get("LOCAL_RANK", 0)),
                        int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        os.environ.setdefault("OMP_NUM_THREADS", str(len(cpus)))
    blocking = blocking_sync(int(os.environ.get("LOCAL_RANK", 0))) if args.blocking_sync else None
    stubbed = _use_ray_stub_if_needed()
    import asyncio
    import contextlib

    import torch

    cuda = torch.cuda.is_available()
    sys.path.insert(0, str(ROOT / "src"))
    if not cuda:
        _install_cpu_platform()
    import torch.distributed as dist

    if cuda:
        from verl.utils.distributed import initialize_global_process_group

        initialize_global_process_group()  # as verl's run_sft: cpu:gloo,cuda:nccl; set_device(LOCAL_RANK)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gpu = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ctx = context_bytes(gpu) if cuda else None  # the CUDA context (and NCCL's), before the allocator holds any
    if cuda and args.segments_at_wake is not None:  # where each live block was allocated: Python stacks
        torch.cuda.memory._record_memory_history(max_entries=200_000)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(gpu)

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[verl_actor] {msg}", flush=True)

    import verl
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp import transformer_impl as ti
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    import torchferry.integrations.verl as tf_verl
    from torchferry._core._transfer.streams import record_stalls
    from torchferry.integrations.verl import dock_rollout, docked, ferry_for

    strategies = parse_strategies(args.strategies)
    if args.own and args.own not in {s.label for s in strategies}:
        raise SystemExit(f"error: --own {args.own!r} is not among the strategies {[s.label for s in strategies]}")
    # [Note: one process per strategy]: with --own this process builds and steps that strategy alone,
    # taking its turns with the other strategies' processes through --turns.
    own = [s for s in strategies if not args.own or s.label == args.own]
    turns = Turns(args.turns, rank)
    isolated = bool(args.own)
    kinds = {s.label: s.kind for s in strategies}
    with_dock = {s.label for s in strategies if s.env.get("TORCHFERRY_VERL_DOCK", "0") not in ("", "0")}
    prepared = json.loads((Path(args.model_dir) / "torchferry_prepare.json").read_text())
    weights_bytes = 2 * prepared.get("state_dict_numel", prepared["params"])  # the stand-in rollout's bf16 weights
    docks: dict[str, dict] = {}  # label -> its budget: patch(dock=...) keeps one dock per budget
    for s in strategies:  # TORCHFERRY_VERL_DOCK=tight|roomy: the budget from the sizes (dock_budget)
        if s.label in with_dock:
            kind = s.env["TORCHFERRY_VERL_DOCK"] if s.env["TORCHFERRY_VERL_DOCK"] in BUDGETS else None
            if kind:
                trainable = None
                if args.lora_rank:  # the optimizer state and gradients are the adapters'
                    hf = json.loads((Path(args.model_dir) / "config.json").read_text())
                    trainable = lora_trainable(hf, args.lora_rank)
                s.env["TORCHFERRY_VERL_DOCK"] = str(dock_budget(kind, prepared["params"], world,
                                                                int(args.rollout_gb * 1e9), weights_bytes, trainable))
                log(f"{s.label}: a {kind} budget of {int(s.env['TORCHFERRY_VERL_DOCK']) / 1e9:.3f} GB")
            docks[s.label] = {"budget": kind, "budget_why": BUDGETS.get(kind or ""),
                              "TORCHFERRY_VERL_DOCK": s.env["TORCHFERRY_VERL_DOCK"]}
    if len({d["TORCHFERRY_VERL_DOCK"] for d in docks.values()}) < len(docks):
        raise SystemExit(f"error: dock strategies {sorted(docks)} share a budget, so they would share one dock")
    if not cuda:
        _cpu_engine_to_by_direction()
    base_env = _settings_env()
    patched_names: dict[str, list[str]] = {}

    @contextlib.contextmanager
    def active(s: Strategy):
        """The strategy's helpers in place: patch() under its settings, or verl's own."""
        saved = {k: os.environ.get(k) for k in s.env}
        os.environ.update(s.env)
        try:
            if s.kind == "torchferry":
                patched_names[s.label] = tf_verl.patch()
            else:
                tf_verl.unpatch(keep_offloaded=True)
            timer.wrap_helpers()
            yield
        finally:
            timer.unwrap_helpers()
            # the other strategies' turns: this one's state stays in its ferries' pools until its next turn
            tf_verl.unpatch(keep_offloaded=True)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # Timing around every offload and reload call (instrumentation only: [Note: the calls timed] in timing.py).
    current: dict = {"label": None, "phase": "init", "step": -1}
    records: dict[str, dict] = {s.label: {"events": []} for s in strategies}
    timer = CallTimer(ti=ti, records=records, current=current, kinds=kinds, cuda=cuda, sync=sync,
                      ferry_for=ferry_for, record_stalls=record_stalls, engine_to=ti.FSDPEngine.to,
                      profile=bool(args.profile_calls))
    timer.install()
    resolve_timings = timer.resolve
    if args.logprobs == "chunked":  # see _logprobs_chunked: the same for every strategy
        ti.logprobs_from_logits = _logprobs_chunked

    shape = _shape(args.tiny, args.shape)
    if args.micro_batch:  # the same tokens per phase in fewer, larger forward/backward passes
        shape = dataclasses.replace(shape, micro_batch_per_gpu=args.micro_batch[0],
                                    log_prob_micro_batch_per_gpu=args.micro_batch[1])
        per_mini = shape.batch_per_rank // shape.mini_batches
        if min(args.micro_batch) < 1 or per_mini % shape.micro_batch_per_gpu or \
                shape.batch_per_rank % shape.log_prob_micro_batch_per_gpu:
            raise SystemExit(f"error: --micro-batch {args.micro_batch[0]} {args.micro_batch[1]} must divide the "
                             f"{per_mini} sequences of a PPO mini-batch and the {shape.batch_per_rank} of a phase")
    mini = shape.batch_per_rank * world // shape.mini_batches
    actors: dict[str, tuple] = {}
    for s in own:  # each strategy's own actor, built with its helpers in place
        turns.wait(strategies.index(s))
        cfg = _verl_config(args.model_dir, shape, world, args.lr, offload=s.kind != "resident",
                           strategy=args.strategy, lora_rank=args.lora_rank)
        current.update(label=s.label, phase="init", step=-1)
        if cuda and isolated:  # what the process holds before the strategy exists: [Note: the bytes beside a strategy]
            _rewarm_cublas(gpu)
            records[s.label]["beside_bytes"] = torch.cuda.memory_allocated(gpu)
        with active(s):
            t_build = time.perf_counter()
            actor, actor_config = _build_actor(cfg)
            sync()
            records[s.label]["build_s"] = time.perf_counter() - t_build
        resolve_timings(s.label)
        actors[s.label] = (actor, actor_config)
        timer.know(actor.engine)
        log(f"{s.label}: {type(actor).__name__} / {type(actor.engine).__name__} built in "
            f"{records[s.label]['build_s']:.1f} s, "
            f"{sum(p.numel() for p in actor.engine.module.parameters()) / 1e9:.3f} B parameters")
        if cuda:  # what the build left cached is not the steps' (verl's own init empties the cache too)
            torch.cuda.empty_cache()
        turns.done(strategies.index(s))
    rollouts = {s.label: RolloutStandIn(gpu, int(args.rollout_gb * 1e9), args.rollout_matmuls) for s in own}
    # its weights (the sync's bf16 bytes) and KV cache become the dock's claimants
    for label in with_dock & {s.label for s in own}:
        s = next(x for x in strategies if x.label == label)
        with active(s):
            dock_rollout(rollouts[label], weights_bytes, int(args.rollout_gb * 1e9))
    if args.cublas_workspace:  # before any matmul of the process: torch reads it at its first cuBLAS call
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = args.cublas_workspace
    vocab = actors[own[0].label][0].engine.module.config.vocab_size
    probe = StepProbe(gpu)
    busy = GpuBusy(bool(args.gpu_busy) and cuda)
    lora = bool(args.lora_rank)
    for r in records.values():
        r.update(losses=[], grad_norms=[], log_prob_sha256=[], log_prob_sum=[], ref_log_prob_sha256=[],
                 step_s=[], phase_s=[], phase_cpu_s=[], gpu_allocated_at_start=[], peak_gpu_allocated=[],
                 weight_sync_bytes=0,
                 weight_sync_bytes_per_step=[], peak_own_gpu_bytes=[], dock_steps=[], order=[],
                 phase_peak_gpu_bytes=[], at_rollout_wake=[], probe=[], context_bytes=ctx, stall_s=[],
                 left_behind_bytes=[], gpu_busy=[])

    class PhaseStalls:
        """Per phase, the compute stream's waits for torchferry's copies outside FSDPEngine.to (a layer-wise
        reload's units, the optimizer state at step()), timed on the device ([Note: stalls recorded] in
        src/torchferry/_core/_transfer/streams.py)."""

        def __init__(self) -> None:
            self.done: dict = {}
            self._open = None

        def start(self, phase: str) -> None:
            self.stop()
            cm = record_stalls()
            self._open = (phase, cm, cm.__enter__())

        def stop(self) -> None:
            if self._open is not None:
                phase, cm, stalls = self._open
                cm.__exit__(None, None, None)
                self.done[phase], self._open = stalls, None

    # [Note: the bytes beside a strategy]
    # A phase's peak is the strategy's own: the process's peak allocated bytes less `others`, what the
    # process holds that is not the strategy's state or its rollout's. In one process `others` is the other
    # strategies' bytes at the step's start. In a process of its own it is what the process held before the
    # strategy was built (cuBLAS's workspaces): whatever the strategy's helpers leave on the device that is
    # not its state is the strategy's (left_behind_bytes). Taken at every step instead (until 2026-12-06),
    # it hid 6.2 GB verl's FSDP1 helpers leave on the device from the first offload on: verl's phase peaks
    # read up to 6.18 GB under torchferry's and its process kept 10.2 GB reserved at the rollout's wake
    # against torchferry's 4.0 (phase_peak_gpu_bytes, at_rollout_wake_per_round in
    # benchmarks/results/verl_step_qwen2.5-1.5b_fsdp-full-compute-rich_h100x1_2026-12-06_aa8b35a_others-per-step.json);
    # counted, both peak at 30.91 GB, verl leaving 6.17-6.21 GB per step (peak_gpu_bytes,
    # left_behind_bytes_per_step in ..._28d93dd_micro-8-8.json).
    def one_step(s: Strategy, step: int) -> None:
        actor, actor_config = actors[s.label]
        engine, rec, rollout = actor.engine, records[s.label], rollouts[s.label]
        current.update(label=s.label, step=step)
        vd = docked()
        others = 0  # device bytes not this strategy's: see [Note: the bytes beside a strategy]
        if cuda:
            _rewarm_cublas(gpu)  # the last step's empty_cache() freed cuBLAS's workspaces: counted in `others`
            sync()
            torch.cuda.reset_peak_memory_stats(gpu)
            if vd is not None:
                vd.take_peak()
            rec["gpu_allocated_at_start"].append(torch.cuda.memory_allocated(gpu))
            others = rec["gpu_allocated_at_start"][-1] - _gpu_bytes(engine, rollout)
            if isolated:
                rec["left_behind_bytes"].append(others - rec["beside_bytes"])
                others = rec["beside_bytes"]
        stats0 = vd.dock.stats if vd is not None and vd.dock is not None else None
        seq0 = vd.dock.moves[-1].seq + 1 if vd is not None and vd.dock is not None and vd.dock.moves else 0
        peaks: dict[str, int] = {}

        def peak(phase: str) -> None:  # the phase's peak allocated bytes of this strategy's own, then a new phase
            if cuda:
                peaks[phase] = max(torch.cuda.max_memory_allocated(gpu), vd.take_peak() if vd is not None else 0) \
                    - others
                torch.cuda.reset_peak_memory_stats(gpu)

        if cuda:  # what the rollout finds when it wakes: the device's free bytes (another process's included)
            free, total = torch.cuda.mem_get_info(gpu)  # and this process's bytes held (allocator + context)
            rec["at_rollout_wake"].append({
                "device_free_bytes": free, "device_total_bytes": total,
                "allocated_bytes": torch.cuda.memory_allocated(gpu) - others,
                "reserved_bytes": torch.cuda.memory_reserved(gpu),
                "free_alone_bytes": total - torch.cuda.memory_reserved(gpu) - (ctx or 0) if isolated else None})
            if args.segments_at_wake is not None and step == int(args.segments_at_wake[1]):
                _write_segments(Path(args.segments_at_wake[0]) / f"segments_{s.label}_rank{rank}.json", gpu)
        repinned = repin(cpus) if cpus is not None else False  # the setup may have reset the affinity
        stalls = PhaseStalls()
        busy.begin()  # the profiler's start outside the step's time
        probe.begin()
        t_step = time.perf_counter()
        marks, cpu_marks, cpu0 = {}, {}, time.process_time()

        def mark(phase: str) -> None:  # a phase's end: wall and CPU seconds, and the GPU's busy ones (--gpu-busy)
            marks[phase] = time.perf_counter()
            cpu_marks[phase] = time.process_time()
            busy.mark(phase)

        if args.rollout_gb or args.rollout_matmuls:  # the KV cache wakes, the generation, the driver's sleep
            current["phase"] = "rollout"
            stalls.start("rollout")
            asyncio.run(rollout.resume(["kv_cache"]))
            rollout.generate()
            rollout.sleep()
        mark("rollout")
        peak("rollout")
        batch, advantages = _batch(step, rank, shape, vocab, args.seed)
        # compute_log_prob (the trainer's _compute_old_log_prob -> ActorRolloutRefWorker.compute_log_prob)
        current["phase"] = "log_prob"
        stalls.start("log_prob")
        td = left_right_2_no_padding(batch.clone())
        tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False,
                             temperature=1.0)
        out = actor.infer_batch(td)
        old_log_probs = no_padding_2_padding(tu.get(out, "log_probs"), td).float()
        rec["log_prob_sha256"].append(_sha(old_log_probs))
        rec["log_prob_sum"].append(float(old_log_probs.double().sum()))
        mark("log_prob")
        peak("log_prob")
        if lora:  # ref_in_actor: the reference is the actor with its adapters off (_compute_ref_log_prob)
            current["phase"] = "ref"
            stalls.start("ref")
            td = left_right_2_no_padding(batch.clone())
            tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, no_lora_adapter=True,
                                 temperature=1.0)
            out = actor.infer_batch(td)
            rec["ref_log_prob_sha256"].append(_sha(no_padding_2_padding(tu.get(out, "log_probs"), td).float()))
            mark("ref")
            peak("ref")
        # update_actor (the trainer's _update_actor -> ActorRolloutRefWorker.update_actor)
        current["phase"] = "update"
        stalls.start("update")
        upd = batch.clone()
        upd["old_log_probs"] = old_log_probs.cpu()
        upd["advantages"] = advantages
        td = left_right_2_no_padding(upd)
        tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=mini, mini_batch_size=mini, epochs=1, seed=actor_config.data_loader_seed,
                             dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)
        out = actor.train_mini_batch(td)
        metrics = tu.get(out, "metrics")
        rec["losses"].append([float(x) for x in metrics["loss"]])
        rec["grad_norms"].append([float(x) for x in metrics.get("grad_norm", [])])
        mark("update")
        peak("update")
        if args.weight_sync:  # ActorRolloutRefWorker.update_weights, after update_actor
            current["phase"] = "weight_sync"
            stalls.start("weight_sync")
            if cuda:  # update_weights empties the cache before the rollout's weights wake (engine_workers.py)
                torch.cuda.empty_cache()
            asyncio.run(rollout.resume(["weights"]))
            rec["weight_sync_bytes"] = _weight_sync(engine, rollout.weights, first=step == 0, device=gpu)
            rec["weight_sync_bytes_per_step"].append(rec["weight_sync_bytes"])  # LoRA: the first with the base
            sync()
            if cuda:  # and again after the sync, before the KV cache wakes
                torch.cuda.empty_cache()
        if vd is not None and vd.dock is not None:  # the step ends when the dock's copies are complete
            vd.dock.wait()
            sync()
        mark("weight_sync")
        rec["step_s"].append(time.perf_counter() - t_step)
        rec["gpu_busy"].append(busy.end())
        stalls.stop()
        rec["stall_s"].append({k: v.seconds() for k, v in stalls.done.items()} if cuda else {})
        rec["probe"].append({**probe.end(), "repinned": repinned})
        if args.weight_sync or vd is not None:
            peak("weight_sync")
        rec["phase_peak_gpu_bytes"].append(peaks)
        if vd is not None and vd.dock is not None:
            st = vd.dock.stats
            rec["dock_steps"].append({
                "bytes_loaded": st.bytes_loaded - (stats0.bytes_loaded if stats0 else 0),
                "bytes_evicted": st.bytes_evicted - (stats0.bytes_evicted if stats0 else 0),
                "moves": [{"at_s": m.at - t_step, "kind": m.kind, "name": m.name, "bytes": m.nbytes,
                           "background": m.background} for m in vd.dock.moves if m.seq >= seq0],
                "marks_s": {k: t - t_step for k, t in marks.items()}, "resident_bytes_after": vd.dock.resident_bytes})
        prev, spans = t_step, {}
        for k, t in marks.items():
            spans[k], prev = t - prev, t
        rec["phase_s"].append(spans)
        prev, cpu_spans = cpu0, {}
        for k, t in cpu_marks.items():
            cpu_spans[k], prev = t - prev, t
        rec["phase_cpu_s"].append(cpu_spans)
        if cuda:  # the step's peak: the largest of its phases'
            rec["peak_gpu_allocated"].append(max(peaks.values()) + others)
            rec["peak_own_gpu_bytes"].append(max(peaks.values()))  # this strategy's own peak in its step
        resolve_timings(s.label)

    t_rounds = time.perf_counter()
    n = len(strategies)
    last = -1
    for step in range(args.steps):  # rounds: every strategy one step, the order rotated each round
        k = step % n
        order = strategies[k:] + strategies[:k]
        mine_now = [s for s in order if s in own]
        first = turns.folder is not None and order[0] in own
        if turns.folder is None and args.max_round_seconds and step >= 2:  # one process: rank 0 decides
            stop = [time.perf_counter() - t_rounds > args.max_round_seconds]
            dist.broadcast_object_list(stop, src=0)
            if stop[0]:
                log(f"stopping after {step} rounds: past --max-round-seconds {args.max_round_seconds}")
                break
        stopped, last = False, step
        for s in mine_now:
            ticket = n + step * n + order.index(s)
            turns.wait(ticket)
            if first and s is order[0]:  # the round's first turn: stop starting rounds past the budget
                turns.decide_stop(step, args.max_round_seconds)
            if isolated:
                dist.barrier()  # every rank read the same stop
            if turns.stop_round() is not None and turns.stop_round() <= step:
                stopped = True
                turns.done(ticket)
                break
            if args.settle_seconds:  # what the previous turn left running on the host (memory given back) ends
                time.sleep(args.settle_seconds)
            with active(s):
                one_step(s, step)
            records[s.label]["order"].append(order.index(s))
            gc.collect()  # between turns, not inside the next strategy's step (the probe counts what is left)
            if isolated and cuda:  # what this process cached goes back before the next strategy's turn, as a
                torch.cuda.empty_cache()  # colocated role's would before the rollout wakes (else: OOM beside it)
                _rewarm_cublas(gpu)  # empty_cache() also freed cuBLAS's workspaces: not the next step's bytes
            if isolated:
                dist.barrier()
            turns.done(ticket)
        if stopped:
            log(f"stopping after {step} rounds: past --max-round-seconds {args.max_round_seconds}")
            break
        log(f"round {step + 1}/{args.steps}: " + ", ".join(
            f"{s.label} {records[s.label]['step_s'][-1]:.2f} s (loss {records[s.label]['losses'][-1]})"
            for s in mine_now))

    # [Note: the last round ends together]: a process whose last turn came early in the last round went on to
    # fingerprint its state on the GPU and write its records while the others stepped; the 7df6fbd run's last
    # round found the machine's user CPU ticks doubled in the two steps after it (resident 418 against about
    # 200, verl 1,292 against about 730: probe_per_step[8].machine_ticks) and both steps slowest of the run.
    # So every process waits here until the last round's last turn is done.
    turns.wait(n + (last + 1) * n)
    sync()
    pinned_process = 0
    if cuda and hasattr(torch.cuda, "host_memory_stats"):
        hs = torch.cuda.host_memory_stats()
        pinned_process = int(hs.get("reserved_bytes.current", hs.get("allocated_bytes.current", 0)))
    mine: dict = {"rank": rank, "strategies": {}}
    for s in own:
        actor, _ = actors[s.label]
        engine, rec = actor.engine, records[s.label]
        ferries = [f for f in (ferry_for(engine.module), ferry_for(engine.optimizer)) if f is not None]
        mine["strategies"][s.label] = {
            **rec,
            "state_bytes": {"params": _part_bytes(engine, "model"), "optimizer": _part_bytes(engine, "optimizer")},
            "torchferry_pool_bytes": {"pinned": sum(f.pinned_bytes for f in ferries),
                                      "host": sum(f.host_bytes for f in ferries)},
            "ferries": [repr(f) for f in ferries], "cpus": cpus, "blocking_sync": blocking,
            "cpu_cores": cpu_cores(cpus) if cpus is not None else None,  # the share's CPUs by physical core
            **({"call_profile": timer.profile_of(s.label)} if args.profile_calls else {}),
            # The state after the steps (offloaded by verl's update_actor exit), fingerprinted exactly; compared
            # with verl's by against_verl once every strategy's records are together (merge_runs).
            "fingerprints": fingerprints(engine, rollouts[s.label].weights, gpu),
        }
        if s.label in with_dock:
            with active(s):
                vd = docked()
                mine["strategies"][s.label]["dock"] = None if vd is None or vd.dock is None else {
                    "budget_bytes": vd.dock.budget_bytes, "budget": os.environ.get("TORCHFERRY_VERL_DOCK"),
                    "stats": dataclasses.asdict(vd.dock.stats),
                    "workspace_bytes": {e.workspace[m]: b for e in vd.engines.values() for m, b in e.measured.items()},
                    "phase_log": [[event, list(names)] for event, names in list(vd.phase_log)[-40:]]}
    mine["caching_host_allocator_pinned_bytes"] = pinned_process
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        import transformers

        result = {
            "schema": "torchferry.verl-step-runs/1",
            "ray": "stand-in (benchmarks/verl_raystub)" if stubbed else "installed",
            "env": {"gpu": torch.cuda.get_device_name(gpu) if cuda else None, "torch": torch.__version__,
                    "verl": verl.__version__, "transformers": transformers.__version__, "world_size": world,
                    "python": sys.version.split()[0], "device": str(gpu),
                    "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                    "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None},
            "strategies": [{"label": s.label, "kind": s.kind, "settings": {**base_env, **s.env},
                            "patched": patched_names.get(s.label, [])} for s in own],
            "strategies_all": [{"label": s.label, "kind": s.kind} for s in strategies],
            "config": {"steps": len(records[own[0].label]["step_s"]), "seed": args.seed, "lr": args.lr,
                       "shape": "tiny" if args.tiny else args.shape,
                       **dataclasses.asdict(shape), "tokens_per_phase_per_rank": shape.batch_per_rank * (
                           shape.prompt_len + shape.response_len),
                       "attn_implementation": ATTENTION, "full_determinism": True,
                       "logprobs": (f"chunked: log_softmax over {LOGPROB_ROWS} rows at a time (the bench's "
                                    "_logprobs_chunked)" if args.logprobs == "chunked" else
                                    "verl: logprobs_from_logits_v2, one log_softmax per token"),
                       "strategy": args.strategy, "lora": lora, "lora_rank": args.lora_rank,
                       "phases": ["rollout", "log_prob", *(["ref"] if lora else []), "update",
                                  *(["weight_sync"] if args.weight_sync else [])],
                       "rollout_stand_in": {"kv_cache_bytes": int(args.rollout_gb * 1e9),
                                            "matmuls_8192_bf16": args.rollout_matmuls},
                       "weight_sync": args.weight_sync,
                       "docks": docks,
                       "optimizer": f"{actor_config.optim.optimizer} (lr {actor_config.optim.lr}, "
                                    f"clip_grad {actor_config.optim.clip_grad})",
                       "ppo_mini_batch_size": mini, "model_dir": args.model_dir,
                       "model": json.loads((Path(args.model_dir) / "torchferry_prepare.json").read_text())},
            "per_rank": gathered,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        log(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()
