"""torchferry.Dock on the CPU: bytes reserved beside the sets, state loaded behind the dock's back, an optimizer's
first-step state told before it runs, and a ferry closed while docked."""

import pytest
import torch

from torchferry import Dock, Ferry
from torchferry._core._dock.first_step import first_step_bytes
from torchferry._core._state.host_blocks import in_host_pool

U = 4096  # bytes per unit (float32: 1024 elements)


def _set(units: int, seed: int, *, offloaded: bool = True) -> tuple[torch.Tensor, Ferry]:
    t = torch.randn(units * U // 4, generator=torch.Generator().manual_seed(seed))
    f = Ferry(t, device="cpu")
    if offloaded:
        f.offload()
    return t, f


def _trained(n: int = 256, **adam) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    m = torch.nn.Linear(n, n)
    opt = torch.optim.Adam(m.parameters(), **adam)
    m(torch.ones(2, n)).sum().backward()
    opt.step()
    return m, opt


def test_reserved_bytes_count_against_the_budget_and_are_never_evicted():
    dock = Dock(10 * U)
    ta, fa = _set(4, 0)
    tb, fb = _set(4, 1)
    dock.add("a", fa)
    dock.add("b", fb)
    dock.reserve("kept", 2 * U)
    assert dock.resident_bytes == 2 * U and dock.is_resident("kept") and dock.nbytes("kept") == 2 * U
    with dock.use("a"):
        pass
    with dock.use("b"):  # 2 reserved + 4 + 4 = 10: both fit
        pass
    assert dock.resident_bytes == 10 * U and not fa.residency.on_host
    dock.reserve("kept", 4 * U)  # grew: an idle set leaves now
    assert dock.resident_bytes == 8 * U and fa.residency.on_host and not fb.residency.on_host
    dock.evict()  # every idle name: the reserved bytes stay
    assert dock.resident_bytes == 4 * U and dock.is_resident("kept")
    with pytest.raises(ValueError, match=r"need 32768 bytes .* beside 16384 bytes .* reserved"):
        dock.acquire("a", "b")  # 8 units beside 4 reserved: more than 10, nothing moved
    assert fa.residency.on_host and fb.residency.on_host
    dock.remove("kept")
    with dock.use("a", "b"):
        assert dock.resident_bytes == 8 * U


def test_reserve_refuses_bad_sizes_and_names():
    dock = Dock(10 * U)
    _, f = _set(4, 0)
    dock.add("a", f)
    dock.add_claimant("kv", U)
    for bad in (-1, 11 * U, 1.5, True):
        with pytest.raises(ValueError, match="Dock.reserve: 'r' needs an int of bytes"):
            dock.reserve("r", bad)
    for taken in ("a", "kv"):
        with pytest.raises(ValueError, match="already registered"):
            dock.reserve(taken, U)
    dock.reserve("r", 8 * U)
    _, big = _set(4, 1)
    with pytest.raises(ValueError, match=r"beside 32768 bytes .* reserved \(Dock.reserve\)"):
        dock.add("big", big)


def test_optimizer_state_loaded_while_evicted_is_counted_and_the_budget_kept():
    """Reproduces: verl's load_checkpoint after the rollout evicted the optimizer put the loaded AdamW
    state on the device while the dock counted it evicted."""
    m, opt = _trained()
    saved = {k: v for k, v in opt.state_dict().items()}
    saved = {"state": {k: {n: t.clone() for n, t in s.items()} for k, s in saved["state"].items()},
             "param_groups": saved["param_groups"]}
    opt.zero_grad(set_to_none=True)
    p_bytes = sum(p.numel() * 4 for p in m.parameters())
    dock = Dock(3 * p_bytes + 8 + 10 * U)  # parameters, AdamW's two moments and steps, 10 units more
    pf, of = Ferry(m, device="cpu"), Ferry(opt, device="cpu")
    dock.add("params", pf)
    dock.add("opt", of)
    dock.add_claimant("kv", 40 * U, sleep=lambda: None, wake=lambda: None)
    dock.evict("opt")  # the rollout's room, as verl's dock gives it
    with dock.use("kv"):
        pass
    assert of.residency.on_host and not pf.residency.on_host and dock.resident_bytes == p_bytes + 40 * U
    opt.load_state_dict(saved)  # a checkpoint: new state on the parameters' device, the set evicted
    assert dock.stats.adoptions == 1  # counted where it was, then the budget kept: an idle set left again
    on_device = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                 for t in [*m.parameters(), *(x for s in opt.state.values() for x in s.values())]
                 if t.numel() and not in_host_pool(t.data_ptr())}
    held = sum(on_device.values()) + (40 * U if dock.is_resident("kv") else 0)
    assert held == dock.resident_bytes <= dock.budget_bytes  # what the device holds is what the dock counts
    with dock.use("params", "opt"):
        for k, st in opt.state_dict()["state"].items():
            assert all(torch.equal(st[n], saved["state"][k][n]) for n in st)
        m(torch.ones(2, 256)).sum().backward()
        opt.step()
    assert torch.equal(opt.state[m.weight]["step"], torch.tensor(2.0))


def test_an_evicted_set_given_device_state_is_counted_at_the_next_decision():
    m, opt = _trained(64)
    dock = Dock(10**6)
    of = Ferry(opt, device="cpu")
    dock.add("opt", of)
    dock.evict("opt")
    for s in opt.state.values():  # behind the dock's back, not through load_state_dict
        s["exp_avg"] = torch.zeros_like(s["exp_avg"])
    moments = sum(p.numel() * 4 for p in m.parameters())
    assert dock.resident_bytes == moments  # a reading counts the new exp_avg where it is and moves nothing
    assert of.residency.on_host and dock.stats.adoptions == 0 and dock.stats.loads == 0
    with dock.use("opt"):  # the next decision: the set taken in (the new exp_avg stays), the rest brought back
        assert dock.resident_bytes == 2 * moments + 8 and dock.stats.adoptions == 1
    assert all(torch.count_nonzero(s["exp_avg"]) == 0 and torch.count_nonzero(s["exp_avg_sq"]) > 0
               for s in opt.state.values())


@pytest.mark.parametrize("make,per_param,scalars", [
    (lambda ps: torch.optim.Adam(ps), 2, 1),
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), 3, 1),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True, foreach=True), 3, 1),
    (lambda ps: torch.optim.AdamW(ps, fused=True), 2, 1),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0, 0),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1, 0),
    (lambda ps: torch.optim.RMSprop(ps, momentum=0.5, centered=True), 3, 1),
    (lambda ps: torch.optim.NAdam(ps), 2, 2),
    (lambda ps: torch.optim.ASGD(ps), 1, 3),
])
def test_first_step_bytes_match_what_the_first_step_allocates(make, per_param, scalars):
    m = torch.nn.Linear(32, 16)
    opt = make(m.parameters())
    told = first_step_bytes(opt, torch.device("cpu"))  # on a CPU device the host's 0-dim steps count too
    m(torch.ones(2, 32)).sum().backward()
    opt.step()
    made = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))
    assert told == per_param * (32 * 16 + 16) * 4 + scalars * 2 * 4 == made


def test_first_step_bytes_on_a_gpu_count_the_steps_only_where_the_optimizer_puts_them():
    meta = torch.nn.Linear(32, 16, device="meta")  # a device other than the CPU, without one
    params = (32 * 16 + 16) * 4
    assert first_step_bytes(torch.optim.AdamW(meta.parameters()), torch.device("meta")) == 2 * params
    assert first_step_bytes(torch.optim.AdamW(meta.parameters(), capturable=True),
                            torch.device("meta")) == 2 * params + 2 * 4
    assert first_step_bytes(torch.optim.ASGD(meta.parameters()), torch.device("meta")) == params + 3 * 2 * 4


def test_first_step_bytes_of_an_unknown_optimizer_are_none():
    m = torch.nn.Linear(4, 4)
    assert first_step_bytes(torch.optim.LBFGS(m.parameters()), torch.device("cpu")) is None


def test_a_ferry_closed_in_a_dock_is_refused_naming_the_set_and_the_dock():
    dock = Dock(4 * U)
    _, fa = _set(4, 0, offloaded=False)
    _, fb = _set(4, 1)
    dock.add("a", fa)
    dock.add("b", fb)
    fa.close()
    with pytest.raises(RuntimeError, match=r"the ferry of state set 'a' was closed while in the dock \(Dock at 0x"
                                           r".*sets \['a', 'b'\]\); dock.remove\('a'\)") as e:
        dock.acquire("b")
    assert "\n" not in str(e.value) and fb.residency.on_host and not dock.in_use
    dock.remove("a")
    with dock.use("b"):
        pass
    with pytest.raises(RuntimeError, match="Dock.add: the ferry given for 'a' is closed"):
        dock.add("a", fa)


def test_an_optimizers_first_step_is_counted_before_it_runs_so_a_claimant_sleeps_first():
    """A plain Dock over a model and an optimizer that has not stepped (``Adam(amsgrad=True)``: three
    tensors per parameter), beside a claimant: the use that runs the first step makes room for the state
    it will make, so the device never holds more than the budget while the claimant is awake."""
    n = 128
    torch.manual_seed(0)
    m = torch.nn.Linear(n, n)
    opt = torch.optim.Adam(m.parameters(), amsgrad=True)
    params = sum(p.numel() * 4 for p in m.parameters())
    made = first_step_bytes(opt, torch.device("cpu"))
    assert made == 3 * params + 2 * 4  # exp_avg, exp_avg_sq, max_exp_avg_sq; a 0-dim step per parameter
    m(torch.ones(2, n)).sum().backward()  # the gradients exist before the dock: counted with the model
    kv_bytes = params
    dock = Dock(2 * params + made + kv_bytes - 1)  # all do not fit: the claimant must sleep for the step
    dock.add("m", Ferry(m, device="cpu"))
    dock.add("o", Ferry(opt, device="cpu"))
    assert dock.nbytes("o") == made  # counted before the step made it
    awake: list[bool] = []
    dock.add_claimant("kv", kv_bytes, sleep=lambda: awake.append(False), wake=lambda: awake.append(True))
    with dock.use("kv"):
        pass
    before = [p.detach().clone() for p in m.parameters()]
    with dock.use("m", "o"):
        assert awake[-1] is False  # the claimant slept before the step
        opt.step()
        assert dock.resident_bytes <= dock.budget_bytes
        assert dock.nbytes("o") == made  # now measured: as told
    assert len(opt.state) == 2 and all(not torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))


def test_a_set_whose_plan_the_watch_forgot_counts_what_it_holds():
    """The resident watch forgets a plan whose gradients were dropped ([Note: state dropped while resident]);
    the dock then counted ``max(device bytes, state_bytes)``: the dropped gradients' bytes, 2P for the P the
    parameters hold, and evicted the module to make room that was there."""
    import gc

    m, opt = _trained(64)
    P = sum(p.numel() * p.element_size() for p in m.parameters())
    fm = Ferry(m, device="cpu")
    fm.offload()
    fm.reload()  # the plan (grads included) cached, the watch armed
    to, fo = _set(1, 0)
    o_bytes = to.numel() * 4
    dock = Dock(2 * P + o_bytes - 1)
    dock.add("m", fm)
    dock.add("o", fo)
    assert dock.nbytes("m") == 2 * P
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        m(torch.ones(2, 64))  # the watch's forward pre-hook: the plan goes, and the gradients with it
    gc.collect()
    assert fm._set.cache is None and all(p.grad is None for p in m.parameters())
    assert fm.state_bytes == 2 * P
    assert dock.nbytes("m") == P
    with dock.use("o"):
        assert dock.resident_bytes == P + o_bytes
    assert not fm.residency.on_host and fm.stats.offloads == 1  # not evicted: the room was there
