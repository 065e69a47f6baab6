"""GPU reliability: a real out-of-memory during reload, a 1,000-cycle soak, and host reads right
after an offload (a stream sync through the verl helper, a checkpoint through ``state_dict()``)."""

import gc
import io
import json
import os

import pytest
import torch
from torch import nn

from tests.helpers import rss_bytes
from torchferry import Ferry, Residency

pytestmark = pytest.mark.gpu



def test_real_out_of_memory_during_reload_keeps_state_and_retry_succeeds():
    torch.cuda.empty_cache()
    x = torch.randn(256 << 20, device="cuda")  # 1 GiB
    want = x.cpu()
    ferry = Ferry(x)
    ferry.offload().wait()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")  # leave 256 MiB
    with pytest.raises(RuntimeError, match=r"reload needs \d+ bytes .*ran out of device memory"):
        ferry.reload()
    assert ferry.residency is Residency.HOST
    torch.testing.assert_close(x, want, atol=0, rtol=0)  # the host copy is intact
    del hog
    torch.cuda.empty_cache()  # later tests need the memory back from the allocator
    ferry.reload().wait()
    torch.testing.assert_close(x.cpu(), want, atol=0, rtol=0)


def test_real_out_of_memory_while_reconciling_replaced_state_keeps_it_offloaded_and_hooks_fire():
    """On a GPU: optimizer state replaced while offloaded (a checkpoint resumed in
    verl's order) and a reload that runs out of device memory moving the replacements: before, 9 of
    24 tensors stayed on the GPU under residency HOST, the error was torch's, and the retry gave
    the parameters the host twins' impls (their hooks never fired again)."""
    import copy

    from torchferry._core._state.host_blocks import in_host_pool

    torch.cuda.empty_cache()
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)]).cuda()  # 4 x 64 MiB of weights
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(8, 4096, device="cuda")
    m(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    fires = []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fires.append(p))
    params = [p.detach().cpu() for p in m.parameters()]
    sd = opt.state_dict()
    want = {i: {k: v.cpu() for k, v in st.items()} for i, st in sd["state"].items()}
    # The checkpoint, on the CPU (load_state_dict adopts these very tensors for CPU parameters).
    saved = {"state": {i: {k: v.clone() for k, v in st.items()} for i, st in want.items()},
             "param_groups": copy.deepcopy(sd["param_groups"])}
    ferry = Ferry(m, opt)
    ferry.offload().wait()
    opt.load_state_dict(saved)  # new CPU tensors where the ferry's were: 512 MiB to move back
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (320 << 20), dtype=torch.uint8, device="cuda")  # the weights fit, the rest not
    # offload() while offloaded with replaced state reconciles first (no plain reload before it)
    with pytest.raises(RuntimeError, match=r"replaced while offloaded .*ran out of device memory.*nothing was lost"):
        ferry.offload()
    assert ferry.residency is Residency.HOST
    assert all(in_host_pool(p.data_ptr()) for p in m.parameters())
    with pytest.raises(RuntimeError, match="offloaded"):
        m(x)
    del hog
    torch.cuda.empty_cache()
    ferry.reload()
    assert ferry.residency is not Residency.HOST
    for p, before in zip(m.parameters(), params):
        assert p.is_cuda
        torch.testing.assert_close(p.detach().cpu(), before, atol=0, rtol=0)
    for i, p in enumerate(m.parameters()):
        for k, v in opt.state[p].items():
            if k != "step":
                assert v.device == p.device, k
            torch.testing.assert_close(v.cpu(), want[i][k], atol=0, rtol=0)
    m(x).square().mean().backward()
    assert sorted(map(id, fires)) == sorted(map(id, m.parameters()))  # each hook once
    opt.step()
    torch.cuda.synchronize()
    ferry.close()
    del m, opt, ferry, saved, sd
    gc.collect()
    torch.cuda.empty_cache()


def _settled_device_bytes() -> tuple[int, int]:
    """``(reserved, allocated)`` once every block freed under a pending event is freed: a block
    freed on the D2H stream's events counts as allocated until the allocator next looks at its
    events, so a read right after a cycle saw the whole state (128 MiB) more or less, at 424a4de
    and a6bec90; ``empty_cache()`` looks at them all (and returns the free segments)."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


def test_thousand_cycles_hold_memory_flat():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    want = [p.detach().clone() for p in m.parameters()]
    ferry = Ferry(m, opt)
    # Back to back: each reload takes the blocks its offload freed ([Note: a reload takes the
    # blocks its offload freed]); before that rule reserved memory grew 805 MB here after the
    # rest of the GPU tier, 0 bytes since: benchmarks/results/soak_gpu_h200x1_2026-12-02_2a0919f.json.
    for _ in range(400):
        ferry.offload()
        ferry.reload()
    reserved0, allocated0 = _settled_device_bytes()
    rss0, objs0, host0 = rss_bytes(), len(gc.get_objects()), ferry.host_bytes
    for _ in range(1000):
        ferry.offload()
        ferry.reload()
    reserved1, allocated1 = _settled_device_bytes()
    growth = {"rss": rss_bytes() - rss0, "objects": len(gc.get_objects()) - objs0,
              "reserved": reserved1 - reserved0, "allocated": allocated1 - allocated0,
              "host": ferry.host_bytes - host0}
    growth["pinned"] = ferry.pinned_bytes - host0
    print("growth over 1000 cycles:", growth)
    if os.environ.get("TORCHFERRY_RESULTS_DIR"):  # the GPU batch keeps the figures seen
        os.makedirs(os.environ["TORCHFERRY_RESULTS_DIR"], exist_ok=True)
        with open(os.path.join(os.environ["TORCHFERRY_RESULTS_DIR"], "soak_gpu_1000_cycles.json"), "w") as f:
            import datetime

            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "commit": os.environ.get("TORCHFERRY_COMMIT", "unknown"),
                       "command": "pytest tests/gpu/test_reliability.py -k thousand_cycles",
                       "cycles": 1000, "warmup_cycles": 400,
                       "state_bytes": ferry.state_bytes, "host_bytes": ferry.host_bytes,
                       "growth_bytes_or_objects": growth}, f, indent=1)
    # Host and pinned bytes exactly flat. Device: the packing pipeline's staging chunks are
    # freed under pending events (record_stream), so the allocator may hold a block more or
    # less at a given moment: bounded, not per cycle (+4 MiB and -2 MiB seen over 1,000 cycles
    # on H200s, benchmarks/results/soak_gpu_*). Reserved memory may take one more segment late
    # after the rest of the GPU tier (+256 MiB at 7d20961, +384 MiB at 74693cd; 0 when the test
    # runs alone, switch points on or off): a leak of even 1 MiB a cycle would be 1 GB here.
    assert growth["host"] == 0 and growth["pinned"] == 0
    assert abs(growth["allocated"]) <= (8 << 20), growth
    assert abs(growth["reserved"]) <= (512 << 20), growth
    assert growth["rss"] < (16 << 20) and growth["objects"] < 200, growth
    assert all(torch.equal(a, p) for a, p in zip(want, m.parameters()))


def test_back_to_back_reload_takes_the_blocks_its_offload_freed():
    """[Note: a reload takes the blocks its offload freed]: ``offload(); reload()`` back to back
    carves each reload from the segment the last one used, instead of caching a second one while
    the offload's blocks wait for their D2H event."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).cuda()  # 134 MB, 16 MiB weights
    want = [p.detach().clone() for p in m.parameters()]
    ferry = Ferry(m)
    ferry.offload()
    ferry.reload()  # seeds the arena's segment (the model's own blocks are 16 MiB apiece)
    torch.cuda.synchronize()
    reserved0 = torch.cuda.memory_reserved()
    for _ in range(20):
        ferry.offload()
        ferry.reload()
    torch.cuda.synchronize()
    growth = torch.cuda.memory_reserved() - reserved0
    assert growth < ferry.state_bytes // 2, (growth, ferry.state_bytes)  # a second segment: the whole state
    assert all(torch.equal(a, p) for a, p in zip(want, m.parameters(), strict=True))


def _adamw_with_state(n: int = 12, size: int = 4096):
    """``n`` fp32 ``size`` x ``size`` parameters (n = 12: 0.8 GB) and their AdamW, stepped once (1.6 GB of state)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(size, size, device="cuda")) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    return params, opt


def _new_state(params, opt) -> dict[tuple[int, str], torch.Tensor]:
    """One more step (so the host pool holds older state than the optimizer); host copies of the new state."""
    for p in params:
        p.grad.normal_()
    opt.step()
    return {(i, k): v.to("cpu", copy=True) for i, p in enumerate(params) for k, v in opt.state[p].items()}


def _late_copies(ferry: Ferry) -> None:
    """Delays the next offload's D2H copies (about 0.5 s: at 0.1 s, once, the offload was done when
    its call returned, at a6bec90): host reads ordered wrongly then see the old pool."""
    with torch.cuda.stream(ferry._streams.d2h):
        torch.cuda._sleep(1_000_000_000)


def test_host_read_after_the_verl_optimizer_offload_and_a_stream_sync_sees_the_state():
    """verl reads host copies after synchronising its own stream (``.item()``, ``.cpu()``), which
    ordered the seed's same-stream copies. Before this fix,
    the last state tensor read right after ``offload_fsdp_optimizer`` differed
    from the state (3 of 3 trials on one H200, 12 x 8192^2 AdamW)."""
    from torchferry.integrations.verl import (
        ferry_for,
        load_fsdp_optimizer,
        offload_fsdp_optimizer,
    )

    params, opt = _adamw_with_state()
    offload_fsdp_optimizer(opt)  # a first cycle: the pool then holds this step's state
    load_fsdp_optimizer(opt, torch.cuda.current_device())
    want = _new_state(params, opt)
    ferry = ferry_for(opt)
    _late_copies(ferry)
    offload_fsdp_optimizer(opt)
    assert not ferry.last_handle.done()
    torch.cuda.current_stream().synchronize()  # what verl's code does before a host read
    last = opt.state[params[-1]]
    assert last["exp_avg_sq"].device.type == "cpu"
    got = {k: v.clone() for k, v in last.items()}  # the host read, the last state tensor first
    for k, v in got.items():
        torch.testing.assert_close(v, want[(len(params) - 1, k)], atol=0, rtol=0, msg=k)
    for i, p in enumerate(params):
        for k, v in opt.state[p].items():
            torch.testing.assert_close(v, want[(i, k)], atol=0, rtol=0)
    load_fsdp_optimizer(opt, torch.cuda.current_device())


def test_state_dict_right_after_an_offload_saves_the_state():
    """``torch.save(optimizer.state_dict())`` right after ``offload()``, its copies in flight on
    the D2H stream: ``state_dict()`` waits for them (verl's checkpoint after ``update_actor``)."""
    params, opt = _adamw_with_state()
    ferry = Ferry(opt)
    ferry.offload()
    ferry.reload()
    want = _new_state(params, opt)
    _late_copies(ferry)
    handle = ferry.offload()
    assert not handle.done()  # in flight: what the state_dict() must wait for
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)["state"]
    for (i, k), v in want.items():
        torch.testing.assert_close(saved[i][k], v, atol=0, rtol=0, msg=f"{i}.{k}")
    ferry.reload()
