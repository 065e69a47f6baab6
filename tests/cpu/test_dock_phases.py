"""PhaseOrder (``_core/_dock/phases.py``): a trainer's step learnt as the order of its phases and the
dock planned with it ([Note: a step's phases learnt])."""

from torchferry._core._dock.phases import PhaseOrder


class _Dock:
    def __init__(self) -> None:
        self.plans: list[object] = []

    def plan(self, phases) -> None:
        self.plans.append(phases)


def _learn(order: PhaseOrder, dock: _Dock, *phases: tuple[str, ...]) -> None:
    for names in phases:
        order.record(dock, names)  # pyright: ignore[reportArgumentType]  # a stand-in: plan() is all it calls


def test_a_cycle_closes_when_its_first_phase_comes_again_after_another():
    order, dock = PhaseOrder(), _Dock()
    _learn(order, dock, ("kv",), ("params",), ("params", "opt"))
    assert not order.planned and dock.plans == []
    _learn(order, dock, ("kv",))
    assert order.planned and dock.plans == [[frozenset({"kv"}), frozenset({"params"}), frozenset({"params", "opt"})]]
    _learn(order, dock, ("params",), ("kv",))  # planned: nothing more is recorded or planned
    assert len(dock.plans) == 1 and len(order.cycle) == 3


def test_the_same_phase_again_alone_closes_no_cycle():
    order, dock = PhaseOrder(), _Dock()
    _learn(order, dock, ("params",), ("params",), ("params",))
    assert not order.planned and dock.plans == []


def test_a_set_made_during_a_phase_joins_it():
    order, dock = PhaseOrder(), _Dock()
    _learn(order, dock, ("kv",), ("params",))
    order.joins("opt")  # the optimizer's first step made its state
    _learn(order, dock, ("kv",))
    assert dock.plans == [[frozenset({"kv"}), frozenset({"params", "opt"})]]


def test_a_name_added_after_planning_makes_the_order_learnt_again():
    order, dock = PhaseOrder(), _Dock()
    _learn(order, dock, ("kv",), ("params",), ("kv",))
    order.added(dock)  # type: ignore[arg-type]
    assert not order.planned and order.cycle == [] and dock.plans[-1] is None


def test_names_removed_while_learning_drop_what_was_learnt_with_them():
    order, dock = PhaseOrder(), _Dock()
    _learn(order, dock, ("e0.params",), ("e1.params",))
    order.removed(dock, ["e1.params"])  # type: ignore[arg-type]
    assert order.cycle == [] and dock.plans == []
    _learn(order, dock, ("e0.params",), ("kv",), ("e0.params",))
    assert order.planned and dock.plans == [[frozenset({"e0.params"}), frozenset({"kv"})]]
    order.removed(dock, ["unrelated"])  # type: ignore[arg-type]
    assert not order.planned and dock.plans[-1] is None  # planned: learnt again
