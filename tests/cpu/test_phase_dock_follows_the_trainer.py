"""A phase dock (the core's, behind verl's ``patch(dock=...)`` and SkyRL's helpers) follows the trainer: a set whose
objects were all dropped (an evicted optimizer the trainer re-created) leaves before any decision would move it, a
framework's load outside a phase and another engine's phase exit included (before: ``RuntimeError: targets[0] (a
AdamW optimizer) of this ferry was garbage collected`` from every decision until the next entry); and its budget's
refusals are ``OverBudget`` (``_core/_dock/records.py``) wherever they come from, a phase's exit and a wake included
(before: plain ``ValueError``s there)."""

import gc

import pytest
import torch

from torchferry import Ferry
from torchferry._core._dock.phase_dock import PhaseDock
from torchferry._core._dock.records import OverBudget

pytestmark = pytest.mark.usefixtures("own_ledger")

N = 128
P = (N * N + N) * 4
DEV = torch.device("cpu")


class Eng:
    def __init__(self):
        self.module = torch.nn.Linear(N, N)
        self.optimizer = torch.optim.AdamW(self.module.parameters())


def _step(e):
    e.module(torch.ones(2, N)).sum().backward()
    e.optimizer.step()
    e.optimizer.zero_grad(set_to_none=True)


def _two_engines():
    pd = PhaseDock(4 * P + P // 2)  # two engines' params and AdamW state (3P each) do not fit together
    a, b = Eng(), Eng()
    fa, fb = Ferry(a.module, device="cpu"), Ferry(b.module, device="cpu")
    for e, f in ((a, fa), (b, fb)):
        pd.enter(e, "train", device=DEV, params=f)
        _step(e)
        pd.leave(e, "train", optimizer=Ferry(e.optimizer, device="cpu"))
    assert not pd.dock.is_resident("engine0.optimizer")  # evicted for engine1's phase
    return pd, a, b, fa, fb


def test_a_load_outside_a_phase_after_an_evicted_optimizer_was_replaced_and_dropped():
    pd, a, b, fa, fb = _two_engines()
    a.optimizer = torch.optim.AdamW(a.module.parameters())  # re-created; the old one is collected
    gc.collect()
    pd.dock.evict("engine1.params")
    pd.load(fb, "load_fsdp_model_to_gpu")  # raises RuntimeError "... targets[0] (a AdamW optimizer) ... collected"
    assert pd.dock.is_resident("engine1.params")
    assert pd.dock.resident_bytes <= pd.dock.budget_bytes


def test_another_engines_phase_leaves_after_an_evicted_optimizer_was_replaced_and_dropped():
    pd, a, b, fa, fb = _two_engines()
    pd.enter(b, "eval", device=DEV, params=fb)
    a.optimizer = torch.optim.AdamW(a.module.parameters())  # engine0's optimizer re-created while engine1 runs
    gc.collect()
    b.module(torch.ones(2, N))
    pd.leave(b, "eval")  # raises RuntimeError "... targets[0] (a AdamW optimizer) ... garbage collected"
    assert not pd.dock.in_use


def test_an_optimizer_state_over_the_budget_at_a_phase_exit_is_an_over_budget_refusal():
    pd = PhaseDock(P + P // 2)  # the parameters fit; AdamW's state (2P) never can
    e = Eng()
    pd.enter(e, "train", device=DEV, params=Ferry(e.module, device="cpu"))
    e.module(torch.ones(2, N)).sum().backward()
    e.optimizer.step()
    with pytest.raises(OverBudget, match="could never be resident") as ei:  # before: a plain ValueError
        pd.leave(e, "train", optimizer=Ferry(e.optimizer, device="cpu"))
    assert "\n" not in str(ei.value)
    assert not pd.dock.in_use and set(pd.sets) == {"engine0.params"}


def test_claimants_larger_than_the_budget_at_a_wake_are_an_over_budget_refusal():
    pd = PhaseDock(2 * P)
    with pytest.raises(OverBudget, match="more than the budget"):  # before: a plain ValueError
        pd.wake({"kv_cache": 10 * P}, DEV, "the rollout's")
    assert not pd.awake
