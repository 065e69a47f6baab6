"""A Ctrl-C held during a move is raised once the move is done ([Note: all or nothing] in
``_core/_ferry/interrupts.py``): a caller that records the move after it returns must hold it too, or the
record is skipped. Each test sends a real SIGINT in the middle of the move and checks the caller's records."""

from __future__ import annotations

import signal

import pytest
import torch
from torch import nn

import torchferry._core._state.parking as parking
from torchferry import Dock, Ferry
from torchferry._core._dock.phase_dock import PhaseDock


@pytest.fixture
def sigint_in_the_next_move(monkeypatch):
    """Python's SIGINT handler, and ``arm()``: a SIGINT sent at the first tensor exchanged by the next move."""
    real, sent, armed = parking._exchange, [], []

    def exchange(a, b, dtensor):
        real(a, b, dtensor)
        if armed and not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(parking, "_exchange", exchange)
    yield lambda: armed.append(True)
    signal.signal(signal.SIGINT, previous)


def _two_sets() -> tuple[Dock, list[nn.Module], list[Ferry]]:
    torch.manual_seed(0)
    models = [nn.Linear(64, 64), nn.Linear(64, 64)]
    ferries = [Ferry(m, device="cpu") for m in models]
    dock = Dock(ferries[0].state_bytes + 64, device="cpu")  # room for one set
    for name, f in zip("ab", ferries, strict=True):
        dock.add(name, f)
    return dock, models, ferries


def test_a_sigint_while_use_makes_room_leaves_no_name_in_use(sigint_in_the_next_move):
    """The Ctrl-C was raised by ``acquire()`` before ``use()``'s ``try``: 'b' stayed in use for good, and every
    later ``use('a')`` was refused."""
    dock, models, ferries = _two_sets()
    want = [m.weight.detach().clone() for m in models]
    with dock.use("a"):
        pass
    sigint_in_the_next_move()
    with pytest.raises(KeyboardInterrupt):
        with dock.use("b"):  # evicts 'a': the SIGINT arrives in that move
            pytest.fail("the block ran")
    assert dock.in_use == set()
    with dock.use("a"):
        assert torch.equal(models[0].weight, want[0])
    with dock.use("b"):
        assert torch.equal(models[1].weight, want[1])


def test_a_sigint_while_a_phase_opens_closes_it_again(sigint_in_the_next_move):
    """verl's dock phase entry caught only ``ValueError`` / ``RuntimeError``: a Ctrl-C raised by the dock's
    ``acquire()`` left the phase's names in use, and every later phase 'did not fit its budget'."""
    torch.manual_seed(0)
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    fa, fb = Ferry(a, device="cpu"), Ferry(b, device="cpu")
    cpu = torch.device("cpu")
    pd = PhaseDock(fa.state_bytes + 4096, label="test dock")
    pd.enter(a, "eval", device=cpu, params=fa)
    pd.leave(a, "eval")
    sigint_in_the_next_move()
    with pytest.raises(KeyboardInterrupt):
        pd.enter(b, "eval", device=cpu, params=fb)  # evicts a's set: the SIGINT arrives in that move
    assert pd.dock is not None and pd.dock.in_use == set() and not pd.engine(b).open
    for key, ferry in ((a, fa), (b, fb), (a, fa)):  # both phases open and close again
        pd.enter(key, "eval", device=cpu, params=ferry)
        assert not ferry.residency.on_host
        pd.leave(key, "eval")
    pd.dock.close()
