"""torchferry.Dock on the CPU: budget arithmetic, eviction order, laziness, prefetch, claimants, errors.

Ferries with ``device="cpu"`` move synchronously, so every decision of the
dock is visible at once in ``ferry.residency`` and ``ferry.stats``.
"""

import random
import weakref

import pytest
import torch

from torchferry import Dock, Ferry, Residency
from torchferry._core._dock import Schedule
from tests.helpers import Mixed, assert_same, snapshot

U = 4096  # bytes per unit of the sizes below (float32: 1024 elements)
IDS = torch.tensor([[1, 5, 7], [32, 0, 3]])


class Set:
    """A state set of ``units * U`` bytes of random float32, offloaded to start with."""

    def __init__(self, units: int, seed: int, *, offloaded: bool = True) -> None:
        self.t = torch.randn(units * U // 4, generator=torch.Generator().manual_seed(seed))
        self.want = self.t.clone()
        self.ferry = Ferry(self.t, device="cpu")
        if offloaded:
            self.ferry.offload()

    @property
    def resident(self) -> bool:
        return not self.ferry.residency.on_host

    @property
    def moves(self) -> tuple[int, int]:
        return self.ferry.stats.offloads, self.ferry.stats.reloads

    def check(self) -> None:
        torch.testing.assert_close(self.t, self.want, atol=0, rtol=0)


def dock_with(budget_units: int, **units: int) -> tuple[Dock, dict[str, Set]]:
    dock = Dock(budget_units * U)
    sets = {name: Set(n, seed=i) for i, (name, n) in enumerate(units.items())}
    for name, s in sets.items():
        dock.add(name, s.ferry)
    return dock, sets


def test_use_evicts_only_as_far_as_the_budget_needs():
    dock, s = dock_with(10, a=4, b=4, c=4)
    assert dock.resident_bytes == 0 and dock.free_bytes == 10 * U
    with dock.use("a"):
        assert s["a"].resident and dock.resident_bytes == 4 * U
    with dock.use("b"):
        pass
    assert dock.resident_bytes == 8 * U and dock.free_bytes == 2 * U
    with dock.use("c"):  # 4 more: 2 are free, one set of 4 must go
        assert dock.in_use == {"c"}
    assert [x.resident for x in s.values()] == [False, True, True]
    assert dock.resident_bytes == 8 * U
    assert s["a"].moves == (2, 1) and s["b"].moves == (1, 1) and s["c"].moves == (1, 1)  # (offloads, reloads)
    st = dock.stats
    assert (st.uses, st.hits, st.loads, st.evictions, st.bytes_loaded, st.bytes_evicted) == (3, 0, 3, 1, 12 * U, 4 * U)
    for x in s.values():
        x.check()


def test_nbytes_come_from_the_ferries_and_claimants():
    dock, s = dock_with(10, a=3)
    dock.add_claimant("kv", 5 * U)
    assert dock.nbytes("a") == s["a"].ferry.state_bytes == 3 * U and dock.nbytes("kv") == 5 * U
    assert dock.budget_bytes == 10 * U and dock.device == torch.device("cpu")
    assert dock.ferry("a") is s["a"].ferry and dock.schedule is None


def test_lru_evicts_the_least_recently_used_set():
    dock, s = dock_with(8, a=4, b=4, c=4)
    for name in ("a", "b", "a"):  # a used last: b is the least recently used
        with dock.use(name):
            pass
    with dock.use("c"):
        pass
    assert not s["b"].resident and s["a"].resident and s["c"].resident
    with dock.use("b"):  # now a is the least recently used
        pass
    assert not s["a"].resident and s["b"].resident and s["c"].resident


def test_schedule_evicts_the_set_used_furthest_ahead():
    """Belady: with the cycle a, b, c and room for two, c evicts b (needed after a), LRU would evict a."""
    dock, s = dock_with(8, a=4, b=4, c=4)
    dock.plan(["a", "b", "c"])
    for name in ("a", "b", "c"):
        with dock.use(name):
            pass
    assert s["a"].resident and not s["b"].resident and s["c"].resident
    before = s["a"].moves
    with dock.use("a"):  # a hit: no move
        pass
    assert s["a"].moves == before and dock.stats.hits == 1
    # Then b c a b c a b c a: Belady hits every other use (the optimum for a cycle of 3 in room for 2;
    # LRU hits none, see the next test): misses b, a, c, b, a; hits c, b, a, c.
    for _ in range(3):
        for name in ("b", "c", "a"):
            with dock.use(name):
                pass
    assert dock.stats.uses == 13 and dock.stats.hits == 1 + 4 and dock.stats.loads == 3 + 5


def test_lru_misses_every_use_of_a_cycle_longer_than_the_budget():
    dock, _ = dock_with(8, a=4, b=4, c=4)
    for _ in range(4):
        for name in ("a", "b", "c"):
            with dock.use(name):
                pass
    assert dock.stats.hits == 0 and dock.stats.loads == 12


def test_schedule_prefers_sets_that_bring_back_fewer_bytes():
    """Both come back once per cycle: evicting the 4-unit set moves half the bytes of the 8-unit one,
    although the 8-unit one is needed further ahead (plain Belady would evict it)."""
    dock, s = dock_with(14, small=4, big=8, new=3)
    dock.plan(["small", "big", "new", "small", "big"])
    with dock.use("small"):
        pass
    with dock.use("big"):
        pass
    with dock.use("new"):  # 1 unit too many: small (needed in 1 phase, 4 units) or big (in 2 phases, 8 units)
        pass
    assert not s["small"].resident and s["big"].resident and s["new"].resident


def test_schedule_evicts_sets_it_never_uses_first():
    dock, s = dock_with(12, a=4, b=4, idle=6)
    dock.plan(["a", "b"])
    with dock.use("idle"):  # not a phase: the position stays, idle is never used ahead
        pass
    with dock.use("a"):
        pass
    with dock.use("b"):  # 2 units over: idle (6 units, never used again) goes, not a (4 units)
        pass
    assert not s["idle"].resident and s["a"].resident and s["b"].resident


def test_schedule_position_follows_uses_that_match_a_phase():
    dock, _ = dock_with(20, a=2, b=2)
    dock.add_claimant("ws", U)
    dock.plan(["a", ("b", "ws")])
    assert dock.schedule == Schedule((frozenset({"a"}), frozenset({"b", "ws"})))
    with dock.use("b"):  # not a phase ("b" alone): the next phase is still the first
        assert dock.prefetch_next() == ("a",)
    with dock.use("a"):
        assert dock.prefetch_next() == ("b", "ws")
    with dock.use("b", "ws"):
        assert dock.prefetch_next() == ("a",)
    dock.plan(None)
    assert dock.schedule is None


def test_sets_that_fit_stay_resident_and_cost_nothing():
    dock, s = dock_with(12, a=4, b=4, c=4)
    for _ in range(5):
        for name in ("a", "b", "c", "a"):
            with dock.use(name):
                s[name].check()
    assert [x.moves for x in s.values()] == [(1, 1)] * 3  # the initial offload and one load each
    assert dock.stats.loads == 3 and dock.stats.evictions == 0 and dock.stats.hits == 20 - 3


def test_prefetch_loads_the_next_set_and_use_finds_it_there():
    dock, s = dock_with(8, a=4, b=4)
    with dock.use("a"):
        assert dock.prefetch("b") == ("b",)
        assert s["b"].resident and s["b"].moves == (1, 1)
    assert dock.stats.prefetch_loads == 1
    with dock.use("b"):
        s["b"].check()
    assert s["b"].moves == (1, 1)  # use() moved nothing more
    st = dock.stats
    assert st.prefetch_hits == 1 and st.hits == 1 and st.loads == 2
    assert [(m.kind, m.name, m.background) for m in dock.moves] == [("load", "a", False), ("load", "b", True)]


def test_prefetch_evicts_only_when_no_victim_is_in_use():
    dock, s = dock_with(8, a=4, b=4, c=4)
    with dock.use("a"), dock.use("b"):
        assert dock.prefetch("c") == ()  # a and b hold the room and are in use: left to use()
        assert not s["c"].resident and dock.stats.evictions == 0
    with dock.use("a"):
        assert dock.prefetch("c") == ("c",)  # b is idle: it leaves, c comes in
    assert [x.resident for x in s.values()] == [True, False, True]
    assert dock.stats.prefetch_evictions == 1 and dock.stats.prefetch_loads == 1


def _grpo_dock(budget_units=99):
    """The GRPO step of the bench, in units: actor params 15, AdamW 30, reference 15, KV cache 45,
    forward workspace 2, update workspace 31; the budget holds everything but half the reference."""
    dock = Dock(budget_units * U)
    sets = {"params": Set(15, 0), "opt": Set(30, 1), "ref": Set(15, 2)}
    for name, x in sets.items():
        dock.add(name, x.ferry)
    calls = []
    dock.add_claimant("rollout", 45 * U, sleep=lambda: calls.append("sleep"), wake=lambda: calls.append("wake"))
    dock.add_claimant("fwd_ws", 2 * U)
    dock.add_claimant("update_ws", 31 * U)
    dock.plan(["rollout", ("ref", "fwd_ws"), ("params", "fwd_ws"), ("params", "opt", "update_ws")])
    return dock, sets, calls


def _grpo_step(dock, peak):
    for phase in dock.schedule.phases:
        names = sorted(phase)
        with dock.use(*names):
            dock.prefetch_next()
            peak.append(dock.resident_bytes)


def test_grpo_step_moves_only_the_reference_in_steady_state():
    """Lazy + schedule: the actor stays through the rollout; per step the reference leaves during
    update_actor (a prefetch for the rollout, overlapping the update) and comes back for ref log-prob."""
    dock, s, calls = _grpo_dock()
    peak = []
    _grpo_step(dock, peak)  # first step: loads
    calls.clear()
    before = {k: x.moves for k, x in s.items()}
    st0 = dock.stats
    for _ in range(3):
        _grpo_step(dock, peak)
    moved = {k: (x.moves[0] - before[k][0], x.moves[1] - before[k][1]) for k, x in s.items()}
    assert moved == {"params": (0, 0), "opt": (0, 0), "ref": (3, 3)}
    assert calls == ["wake", "sleep"] * 3
    st = dock.stats
    assert st.prefetch_evictions - st0.prefetch_evictions == 3  # the reference's evictions all overlap update
    assert max(peak) <= dock.budget_bytes == 99 * U
    evicts = [m for m in dock.moves if m.kind == "evict"]
    assert {m.name for m in evicts} == {"ref"} and all(m.background for m in evicts)
    for x in s.values():
        x.check()


def test_verl_style_release_moves_everything_every_step():
    """The baseline the bench compares with: each set offloaded after its phase (verl)."""
    sets = {"params": Set(15, 0), "opt": Set(30, 1), "ref": Set(15, 2)}
    for _ in range(2):
        for phase in (("ref",), ("params",), ("params", "opt")):
            for n in phase:
                sets[n].ferry.reload()
            for n in phase:
                sets[n].ferry.offload()
    assert {k: x.moves for k, x in sets.items()} == {"params": (5, 4), "opt": (3, 2), "ref": (3, 2)}


def test_claimant_wakes_for_its_use_stays_awake_and_sleeps_when_room_is_needed():
    dock, s = dock_with(10, a=6)
    calls = []
    dock.add_claimant("kv", 5 * U, sleep=lambda: calls.append(("sleep", s["a"].resident)),
                      wake=lambda: calls.append(("wake", s["a"].resident)))
    assert not dock.is_resident("kv")  # starts asleep
    with dock.use("kv"):
        assert calls == [("wake", False)] and dock.resident_bytes == 5 * U
    assert dock.is_resident("kv") and calls == [("wake", False)]  # awake after the use: lazy
    with dock.use("a"):  # 6 + 5 > 10: the claimant sleeps before a comes in
        pass
    assert calls == [("wake", False), ("sleep", False)] and not dock.is_resident("kv")
    with dock.use("kv"):  # a is evicted before the claimant wakes
        pass
    assert calls[-1] == ("wake", False) and not s["a"].resident
    st = dock.stats
    assert (st.wakes, st.sleeps, st.evictions) == (2, 1, 1)
    assert [m.kind for m in dock.moves] == ["wake", "sleep", "load", "evict", "wake"]
    dock.evict("kv")
    assert calls[-1][0] == "sleep" and dock.resident_bytes == 0


def test_byte_count_claimant_counts_only_while_in_use():
    dock, s = dock_with(10, a=6)
    dock.add_claimant("workspace", 4 * U)
    with dock.use("a", "workspace"):
        assert dock.resident_bytes == 10 * U and dock.free_bytes == 0
        assert dock.is_resident("workspace")
    assert dock.resident_bytes == 6 * U and not dock.is_resident("workspace")
    dock.add_claimant("kv", 8 * U)
    with dock.use("kv"):  # a must go for it
        assert not s["a"].resident and dock.resident_bytes == 8 * U
    assert dock.resident_bytes == 0
    dock.evict("kv")  # nothing to do for a byte count


def test_swap_moves_one_set_out_while_the_other_comes_in():
    dock, s = dock_with(4, a=4, b=4)
    with dock.use("a"):
        pass
    with dock.use("b"):
        pass
    assert dock.stats.swaps == 1
    last = dock.moves[-2:]
    assert [(m.kind, m.name, m.swap) for m in last] == [("evict", "a", True), ("load", "b", True)]
    assert s["b"].resident and not s["a"].resident
    s["a"].check()
    s["b"].check()


def test_module_and_optimizer_sets_train_bit_exactly_through_the_dock():
    """Training through evictions gives the bits of training without them (atol=rtol=0)."""

    def run(docked: bool):
        torch.manual_seed(0)
        actor, ref = Mixed(), Mixed()
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
        actor(IDS).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if docked:
            fp, fo, fr = Ferry(actor, device="cpu"), Ferry(opt, device="cpu"), Ferry(ref, device="cpu")
            dock = Dock(fp.state_bytes + fo.state_bytes)  # never all three at once
            for name, f in (("params", fp), ("opt", fo), ("ref", fr)):
                dock.add(name, f)
            dock.plan(["ref", "params", ("params", "opt")])
        for _ in range(3):
            with dock.use("ref") if docked else _null(), torch.no_grad():
                ref(IDS)
            with dock.use("params", "opt") if docked else _null():
                actor(IDS).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        if docked:
            with dock.use("params", "opt"):
                out = snapshot(actor, opt)
            assert dock.stats.evictions >= 3
            return out
        return snapshot(actor, opt)

    assert_same(run(False), run(True))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_random_uses_keep_the_budget_and_every_bit():
    rng = random.Random(0)
    units = {"a": 3, "b": 5, "c": 2, "d": 4, "e": 6}
    dock, s = dock_with(10, **units)
    calls = []
    dock.add_claimant("kv", 4 * U, sleep=lambda: calls.append("sleep"), wake=lambda: calls.append("wake"))
    dock.plan(["a", ("b", "c"), "kv", "d", ("e", "c")])
    names = [*units, "kv"]
    for i in range(60):
        pick = tuple(rng.sample(names, rng.choice((1, 1, 2))))
        if sum(dock.nbytes(n) for n in pick) > dock.budget_bytes:
            continue
        with dock.use(*pick):
            assert all(dock.is_resident(n) for n in pick)
            assert dock.resident_bytes <= dock.budget_bytes
            if i % 3 == 0:
                dock.prefetch(rng.choice(names))
                assert all(dock.is_resident(n) for n in pick)  # a prefetch never evicts what is in use
                assert dock.resident_bytes <= dock.budget_bytes
            for n in pick:
                if n in s:
                    s[n].check()
        if i == 30:
            dock.plan(None)  # the rest under LRU
    assert dock.stats.evictions > 10 and calls.count("wake") - calls.count("sleep") in (0, 1)
    dock.wait()
    for x in s.values():
        x.check()


def test_evict_and_wait():
    dock, s = dock_with(10, a=4, b=4)
    with dock.use("a", "b"):
        pass
    dock.evict("a")
    assert not s["a"].resident and s["b"].resident
    dock.evict()  # every idle one
    dock.wait()
    assert dock.resident_bytes == 0 and [x.ferry.residency for x in s.values()] == [Residency.HOST] * 2


def test_sets_resident_beyond_the_budget_when_added_are_brought_back_within_it():
    dock = Dock(8 * U)
    s = {n: Set(4, i, offloaded=False) for i, n in enumerate("abc")}
    for n, x in s.items():
        dock.add(n, x.ferry)
    assert dock.free_bytes == -4 * U
    with dock.use("c"):
        pass
    assert dock.resident_bytes == 8 * U and not s["a"].resident


# ------------------------------------------------------ the budget counts bytes as they are now
P = 256 * 256 * 4  # bytes of a 256 x 256 float32 weight
X = torch.ones(2, 256)


def _docked_linear(budget: int) -> tuple[Dock, torch.nn.Linear, Ferry]:
    """A dock with one set: a 256 x 256 Linear without bias (``P`` bytes), offloaded."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False)
    ferry = Ferry(model, device="cpu")
    ferry.offload()
    dock = Dock(budget)
    dock.add("params", ferry)
    return dock, model, ferry


def test_budget_counts_grads_kept_by_zero_grad_set_to_none_false():
    """A regression test (failed before its fix): grads kept by ``zero_grad(set_to_none=False)`` were
    not counted (the last plan had the parameters only), so a claimant got room that was not there."""
    dock, model, ferry = _docked_linear(3 * P)
    dock.add_claimant("kv", 3 * P // 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dock.use("params"):
        model(X).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        model(X).sum().backward()  # the next micro-batch accumulates into the kept grads
    want = (model.weight.detach().clone(), model.weight.grad.clone())
    assert ferry.state_bytes == P  # its last plan
    assert dock.nbytes("params") == 2 * P and dock.resident_bytes == 2 * P and dock.free_bytes == P
    with dock.use("kv"):  # 2P + 1.5P > 3P: the set leaves (counted at P, it would have stayed)
        assert not dock.is_resident("params") and dock.resident_bytes == 3 * P // 2
    assert ferry.state_bytes == dock.nbytes("params") == 2 * P  # the grads moved with the set
    assert dock.stats.bytes_evicted == 2 * P and dock.stats.evictions == 1
    with dock.use("params"):
        torch.testing.assert_close((model.weight.detach(), model.weight.grad), want, atol=0, rtol=0)
        assert dock.resident_bytes == 2 * P


def test_budget_counts_an_embedding_resized_while_resident():
    """``resize_token_embeddings``-style: a larger Parameter replaces the weight while resident. Until
    the next offload the ferry's plan still holds the old storage, so both count; then the new one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 256))
    ferry = Ferry(model, device="cpu")
    ferry.offload()
    dock = Dock(4 * P)
    dock.add("emb", ferry)
    dock.add_claimant("kv", 2 * P)
    with dock.use("emb"):
        old = model[0].weight
        model[0].weight = torch.nn.Parameter(torch.cat([old.detach(), torch.randn(256, 256)]))  # 2P bytes
        del old
    want = model[0].weight.detach().clone()
    assert ferry.state_bytes == P and dock.nbytes("emb") == P + 2 * P
    assert dock.resident_bytes == 3 * P and dock.free_bytes == P
    with dock.use("kv"):  # 3P + 2P > 4P: the set leaves (counted at P, it would have stayed)
        assert not dock.is_resident("emb") and dock.resident_bytes == 2 * P
    assert ferry.state_bytes == dock.nbytes("emb") == 2 * P and dock.stats.bytes_evicted == 2 * P
    with dock.use("emb"):
        assert model[0].weight.shape == (512, 256) and dock.resident_bytes == 2 * P
        torch.testing.assert_close(model[0].weight.detach(), want, atol=0, rtol=0)
        model(IDS).sum()  # the resized embedding runs


def test_budget_counts_optimizer_state_created_by_its_first_step():
    """A ferry made before the optimizer's first step plans 0 bytes; the step creates AdamW's
    ``exp_avg`` and ``exp_avg_sq`` (and, on the CPU, a 4-byte float32 ``step``) while resident: the dock
    counts them from the start, as the step will make them ([Note: first-step state])."""
    dock, model, _ = _docked_linear(4 * P)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fo = Ferry(opt, device="cpu")
    assert fo.state_bytes == 0
    dock.add("opt", fo)
    dock.add_claimant("kv", 2 * P)
    with dock.use("params", "opt"):
        assert dock.resident_bytes == 3 * P + 4  # the parameters, and the state the first step will make
        model(X).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = opt.state[model.weight]
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
    assert dock.nbytes("opt") == 2 * P + 4 == sum(t.untyped_storage().nbytes() for t in state.values())
    assert fo.state_bytes == 0 and dock.nbytes("params") == P and dock.resident_bytes == 3 * P + 4
    want = {k: v.clone() for k, v in state.items()}
    with dock.use("params"):  # used last: the LRU takes the optimizer state first
        pass
    with dock.use("kv"):  # 3P + 4 + 2P > 4P: the state leaves (counted at 0 bytes, nothing would)
        assert not dock.is_resident("opt") and dock.is_resident("params") and dock.resident_bytes == 3 * P
    assert fo.state_bytes == 2 * P + 4 and dock.stats.bytes_evicted == 2 * P + 4
    with dock.use("params", "opt"):
        torch.testing.assert_close(dict(opt.state[model.weight]), want, atol=0, rtol=0)
        opt.step()  # no grads: a no-op step, the state is usable
    assert dock.resident_bytes == 3 * P + 4


def test_release_brings_the_dock_back_within_the_budget_when_state_grew_in_use():
    """The update phase grows (grads kept) past the room left beside the awake rollout: at ``release()``
    the idle rollout sleeps, so the next phase starts within the budget. (An optimizer's first step is
    counted before it runs: [Note: first-step state]; this one has stepped already.)"""
    dock, model, _ = _docked_linear(5 * P)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with dock.use("params"):
        model(X).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dock.add("opt", Ferry(opt, device="cpu"))
    calls = []
    dock.add_claimant("rollout", P, sleep=lambda: calls.append("sleep"), wake=lambda: calls.append("wake"))
    with dock.use("rollout"):
        pass
    with dock.use("params", "opt"):
        assert dock.resident_bytes == P + P + (2 * P + 4)  # the rollout stays awake: 4P + 4 fit
        model(X).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        assert dock.resident_bytes == P + 2 * P + (2 * P + 4) and dock.free_bytes == -4
    assert calls == ["wake", "sleep"] and not dock.is_resident("rollout")
    assert dock.resident_bytes == 4 * P + 4 and dock.stats.evictions == 0
    with dock.use("rollout"):  # 4P + 4 + P > 5P: the parameters and their grads (2P) leave
        assert not dock.is_resident("params") and dock.resident_bytes == (2 * P + 4) + P
    assert dock.stats.bytes_evicted == 2 * P and calls == ["wake", "sleep", "wake"]


def test_use_refuses_names_grown_beyond_the_budget_naming_each_and_moves_nothing():
    dock, model, fp = _docked_linear(3 * P)
    other = Ferry(torch.randn(3 * P // 8), device="cpu")  # 1.5P bytes
    other.offload()
    dock.add("other", other)
    with dock.use("params", "other"):  # 2.5P: fits
        pass
    with dock.use("params"):
        model(X).sum().backward()  # grads kept: 2P + 1.5P > 3P, the idle "other" leaves at release
    assert not dock.is_resident("other") and dock.resident_bytes == 2 * P
    moves, grad = len(dock.moves), model.weight.grad.clone()
    with pytest.raises(ValueError, match=r"\['params', 'other'\] need 917504 bytes .* together but the budget is "
                                         r"786432 bytes .*\('params' 524288 bytes \(grew while resident: its last "
                                         r"plan had 262144 bytes\), 'other' 393216 bytes\).*nothing was moved"):
        dock.acquire("params", "other")
    assert len(dock.moves) == moves and dock.in_use == frozenset()
    assert fp.residency is Residency.DEVICE and other.residency is Residency.HOST
    torch.testing.assert_close(model.weight.grad, grad, atol=0, rtol=0)
    model.weight.grad = None  # the caller's fix: the pair fits again
    with dock.use("params", "other"):
        assert dock.resident_bytes == P + 3 * P // 2


def test_a_set_grown_beyond_the_budget_alone_leaves_at_release_with_its_state():
    dock, model, fp = _docked_linear(3 * P // 2)
    with dock.use("params"):
        model(X).sum().backward()  # 2P > 1.5P
        want = (model.weight.detach().clone(), model.weight.grad.clone())
    assert fp.residency is Residency.HOST and dock.resident_bytes == 0
    assert fp.state_bytes == dock.nbytes("params") == 2 * P and dock.stats.bytes_evicted == 2 * P
    with pytest.raises(ValueError, match=r"\['params'\] need 524288 bytes .* budget is 393216 bytes"):
        dock.acquire("params")
    fp.reload()
    torch.testing.assert_close((model.weight.detach(), model.weight.grad), want, atol=0, rtol=0)


# ------------------------------------------------------------------------- one dock per ferry
def test_a_ferry_held_by_another_live_dock_is_refused_and_neither_dock_changes():
    """A regression test (failed before its fix): a ferry in two docks, each evicting it while the other used it."""
    first, s = dock_with(10, a=4)
    second, _ = dock_with(10, b=2)
    with first.use("a"):
        pass
    before = (repr(first), first.stats, repr(second), second.stats)
    with pytest.raises(RuntimeError, match=r"^torchferry: Dock.add: cannot add 'again': its ferry is held by another "
                                           r"dock \(Dock at 0x[0-9a-f]+ with budget_bytes=40960 and sets \['a'\]\) as "
                                           r"'a'; a ferry belongs to one dock: .*dock.remove\('a'\)[^\n]*$"):
        second.add("again", s["a"].ferry)
    assert (repr(first), first.stats, repr(second), second.stats) == before
    assert first.ferry("a") is s["a"].ferry and s["a"].resident
    with pytest.raises(ValueError, match="unknown names"):
        second.nbytes("again")


def test_a_ferry_joins_another_dock_once_removed_closed_or_dropped():
    first, s = dock_with(10, a=4, b=4)
    f = s["a"].ferry
    with first.use("a"):
        with pytest.raises(RuntimeError, match=r"remove: 'a' is in use"):
            first.remove("a")
        with pytest.raises(RuntimeError, match=r"close: \['a'\] in use"):
            first.close()
    first.remove("a")  # stays where it is: resident
    assert f.residency is Residency.DEVICE and first.resident_bytes == 0 and "'a'" not in repr(first)
    second = Dock(10 * U)
    second.add("a2", f)
    with pytest.raises(RuntimeError, match="held by another dock"):
        first.add("a", f)
    first.add("b2", Set(1, 7).ferry)  # the first dock still takes new sets
    second.close()
    second.close()  # idempotent
    with pytest.raises(RuntimeError, match="this dock is closed; make a new Dock"):
        second.add("x", Set(1, 8).ferry)
    third = Dock(10 * U)
    third.add("a3", f)
    gone = weakref.ref(third)
    del third
    assert gone() is None  # a dropped dock lets its ferries go
    fourth = Dock(10 * U)
    fourth.add("a4", f)
    with fourth.use("a4"):
        s["a"].check()
    fourth.evict("a4")
    assert not s["a"].resident and s["a"].moves == (2, 1)


# ------------------------------------------------------------------------ errors
def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="budget_bytes must be an int > 0"):
        Dock(0)
    with pytest.raises(ValueError, match="budget_bytes must be an int > 0"):
        Dock(1.5)  # type: ignore[arg-type]
    dock, s = dock_with(10, a=4)
    with pytest.raises(ValueError, match=r"state set 'big' is 45056 bytes .* budget is 40960 bytes.*could never be resident"):
        dock.add("big", Set(11, 9).ferry)
    with pytest.raises(ValueError, match="'a' is already registered"):
        dock.add("a", Set(1, 9).ferry)
    with pytest.raises(ValueError, match="already added as 'a'"):
        dock.add("again", s["a"].ferry)
    with pytest.raises(TypeError, match="must be a torchferry.Ferry"):
        dock.add("t", torch.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nbytes of 'kv' must be an int >= 0"):
        dock.add_claimant("kv", -1)
    with pytest.raises(ValueError, match=r"claimant 'kv' needs 45056 bytes .* could never fit"):
        dock.add_claimant("kv", 11 * U)
    with pytest.raises(ValueError, match="both sleep and wake, or neither"):
        dock.add_claimant("kv", U, wake=lambda: None)
    with pytest.raises(ValueError, match="unknown names"):
        dock.plan(["a", "nope"])
    with pytest.raises(ValueError, match="not one string"):
        Schedule.of("abc")
    with pytest.raises(ValueError, match=r"^torchferry.Schedule: phase 1 is empty: give each phase a name or names$"):
        Schedule.of(["a", ()])
    with pytest.raises(ValueError, match=r"^torchferry.Schedule: give at least one phase \(a name or names each\)$"):
        dock.plan([])
    with pytest.raises(ValueError, match="non-empty frozenset"):
        Schedule((frozenset(),))  # the dataclass built directly
    with pytest.raises(ValueError, match="more than once"):
        Schedule.of([("a", "a")])
    with pytest.raises(ValueError, match=r"unknown names \['b'\]"), dock.use("b"):
        pass
    with pytest.raises(ValueError, match="repeated"):
        dock.prefetch("a", "a")
    with pytest.raises(RuntimeError, match="no schedule"):
        dock.prefetch_next()
    dock.add("b", Set(4, 3).ferry)
    dock.add("c", Set(4, 4).ferry)
    with pytest.raises(ValueError, match=r"need 49152 bytes .* together but the budget is 40960 bytes"), \
            dock.use("a", "b", "c"):
        pass


def test_no_room_while_the_holders_are_in_use_moves_nothing():
    dock, s = dock_with(10, a=4, b=4, c=4)
    with dock.use("a", "b"):
        before = [x.moves for x in s.values()]
        with pytest.raises(RuntimeError, match=r"cannot make room for 'c' \(16384 bytes.*budget of 40960 bytes.*"
                                                r"in use cannot be evicted \('a' 16384 bytes.*Nothing was moved"), \
                dock.use("c"):
            pass
        assert [x.moves for x in s.values()] == before and dock.in_use == {"a", "b"}
    with dock.use("c"):  # once they are idle it works
        pass


def test_lifecycle_misuse_is_refused():
    dock, _ = dock_with(10, a=4)
    with pytest.raises(RuntimeError, match=r"state set 'a' \(16384 bytes.*\) is evicted to the host; enter `with dock.use\('a'\):`"):
        dock.require("a")
    with pytest.raises(RuntimeError, match="'a' is not in use"):
        dock.release("a")
    with dock.use("a"):
        dock.require("a")
        with pytest.raises(RuntimeError, match=r"\['a'\] in use"):
            dock.evict("a")
    dock.add_claimant("kv", U, sleep=lambda: None, wake=lambda: None)
    with pytest.raises(RuntimeError, match="claimant 'kv' .* is asleep"):
        dock.require("kv")


def test_lru_prefetch_takes_an_idle_set_before_one_in_use():
    dock, s = dock_with(8, a=4, b=4, c=4)
    with dock.use("a"):  # a: least recently used, but in use for the whole block
        with dock.use("b"):
            pass
        assert dock.prefetch("c") == ("c",)
        assert s["a"].resident and not s["b"].resident and s["c"].resident


def test_an_evicted_set_counts_the_storages_its_offload_kept_on_the_device():
    """A tensor the ferry does not know sharing a set's storage keeps it allocated through an eviction
    ([Note: a storage shared with a tensor the ferry does not know]): the dock counts those bytes as held
    until the alias goes, so the room it makes is there (``test_dock_kept.py``: such a set is no victim)."""
    dock, s = dock_with(8, a=4, b=4)
    with dock.use("a"):
        alias = s["a"].t[:10]  # a view the ferry does not know
    dock.evict("a")
    with dock.use("b"):
        assert not s["a"].resident and s["b"].resident
        assert dock.resident_bytes == 8 * U  # b, and a's storage kept for the alias
        assert torch.equal(alias, s["a"].want[:10])
    del alias
    with dock.use("a"):
        pass
    dock.evict("a")
    with dock.use("b"):
        assert dock.resident_bytes == 4 * U  # nothing kept once the alias is gone
    assert s["a"].ferry.reload() is not None and torch.equal(s["a"].t, s["a"].want)
