"""``state_dict()`` of a target whose offload is in flight waits for its copies (CPU).

On the CPU the copies are synchronous, so an offload "in flight" is made here: the offload's
handle gets a stand-in event (:class:`CopiesInFlight`) and the host copies are overwritten
with 0xFF bytes, what a GPU's unfinished DMA leaves in the pool; ``synchronize()`` lands the
right bytes. Before this fix, verl's
checkpoint (``optimizer.state_dict()``, ``torch.save``) right after the optimizer's offload
read the state before its copies had landed (3 of 3 trials on one H200).
"""

from __future__ import annotations

import io
import weakref

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)

import torchferry._core._ferry.ferry
from tests.helpers import trained
from torchferry import Ferry
from torchferry._core._api.handle import TransferHandle


class CopiesInFlight:
    """The D2H event of an offload whose copies have not landed until :meth:`synchronize`."""

    def __init__(self) -> None:
        self.synchronized = 0  # host waits seen
        self.landed = False
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (1D uint8 slot, its bytes)

    def unland(self, tensors: list[torch.Tensor]) -> None:
        """Overwrites the host copies of ``tensors`` with 0xFF until :meth:`synchronize`."""
        seen: set[int] = set()
        for t in tensors:
            if t.device.type != "cpu" or not t.untyped_storage().nbytes() or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            slot = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            self._pending.append((slot, slot.clone()))
            slot.fill_(0xFF)

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.synchronized += 1
        if not self.landed:
            for slot, right in self._pending:
                slot.copy_(right)
            self.landed = True


@pytest.fixture
def in_flight(monkeypatch):
    """Offloads from now on return handles whose copies are in flight; yields their events."""
    events: list[CopiesInFlight] = []

    def handle(direction, nbytes, event, *args, **kwargs):
        if direction == "d2h" and event is None and nbytes:
            event = CopiesInFlight()
            events.append(event)
        return TransferHandle(direction, nbytes, event, *args, **kwargs)

    monkeypatch.setattr(torchferry._core._ferry.moves, "TransferHandle", handle)  # where offloads make theirs
    return events


def _state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p for p in m.parameters()] + [p.grad for p in m.parameters() if p.grad is not None]
    out += list(m.buffers())
    return out + [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def _tensors(obj: object, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict / list, by path."""
    if torch.is_tensor(obj):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_tensors(v, f"{path}/{k}"))
    return out


def _saved(state_dict: dict) -> dict[str, torch.Tensor]:
    """What ``torch.save`` writes of ``state_dict`` now, loaded back."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return _tensors(torch.load(buf, weights_only=True))


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        assert got[k].dtype == w.dtype, k
        assert torch.equal(got[k].view(-1).view(torch.uint8), w.view(-1).view(torch.uint8)), k


STATE_DICTS = {
    "module": lambda m, opt: m.state_dict(),
    "optimizer": lambda m, opt: opt.state_dict(),
    "dcp_model": lambda m, opt: get_model_state_dict(m),
    "dcp_optimizer": lambda m, opt: get_optimizer_state_dict(m, opt),
}


@pytest.mark.parametrize("which", list(STATE_DICTS))
def test_state_dict_waits_for_the_offload_in_flight(in_flight, which):
    m, opt = trained()
    state_dict = STATE_DICTS[which]
    want = _saved(state_dict(m, opt))
    ferry = Ferry(m, opt)
    handle = ferry.offload()
    (event,) = in_flight
    event.unland(_state(m, opt))
    assert not handle.done()
    got = _saved(state_dict(m, opt))  # torch.save reads the host copies here
    _assert_bit_exact(got, want)
    assert event.synchronized == 1
    ferry.reload()


def test_module_load_state_dict_waits_for_the_offload_before_writing(in_flight):
    """A module's load_state_dict() writes the pool in place: the copy still in flight must not
    land over it."""
    m, opt = trained()
    new = {k: v.clone() for k, v in trained(seed=1)[0].state_dict().items()}
    ferry = Ferry(m)
    ferry.offload()
    (event,) = in_flight
    event.unland(_state(m, opt))
    m.load_state_dict(new)
    event.synchronize()  # the copies have landed by now at the latest
    ferry.reload()
    _assert_bit_exact(_tensors(m.state_dict()), _tensors(new))


def test_state_dict_still_waits_after_the_ferry_is_dropped(in_flight):
    m, opt = trained()
    want = _saved(opt.state_dict())
    ferry = Ferry(m, opt)
    ferry.offload()
    (event,) = in_flight
    event.unland(_state(m, opt))
    ref = weakref.ref(ferry)
    del ferry
    assert ref() is None  # by reference counting alone: the hooks do not hold the ferry
    _assert_bit_exact(_saved(opt.state_dict()), want)
    assert event.synchronized == 1


def test_state_dict_hooks_only_while_offloaded_and_free_once_complete(in_flight):
    m, opt = trained()
    ferry = Ferry(m, opt)

    def hooks() -> tuple[int, int, int]:
        return len(m._state_dict_pre_hooks), len(m._load_state_dict_pre_hooks), len(opt._optimizer_state_dict_pre_hooks)

    resident = hooks()
    ferry.offload()
    (event,) = in_flight
    assert hooks() == tuple(n + 1 for n in resident)
    m.state_dict()
    opt.state_dict()
    assert event.synchronized == 1  # seen complete: later calls do not wait again
    ferry.reload()
    assert hooks() == resident
