"""``patch(dock=...)``'s side in verl: the budget read and checked, verl's classes checked, the engine
context and the worker's ``init_model`` replaced ([Note: verl under a Dock] in ``._dock``)."""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import re
from collections.abc import Callable
from typing import Any

import torch

from ..._core._api.env import OFF, parse_bytes
from .. import _helpers as compat
from . import _dock
from ._dock import VerlDock, dock_rollout

__all__ = ["DOCK_ENV", "DockPatch", "budget_spec", "parse_budget", "verl_targets"]

logger = logging.getLogger("torchferry")

DOCK_ENV = "TORCHFERRY_VERL_DOCK"
_FRACTION = re.compile(r"[0-9]*\.[0-9]+|[0-9]+\.")  # a str read as a fraction: ASCII digits and a point


MIN_BUDGET_BYTES = 1 << 20  # below this a byte count is a slip (TORCHFERRY_VERL_DOCK=1 read as "on"), not a budget


def parse_budget(value: object, where: str) -> int | float | None:
    """A dock budget: bytes (an integer >= :data:`MIN_BUDGET_BYTES`, or a whole float above 1 such as
    ``40e9``), a fraction of the device's memory (a float in (0, 1]), or ``None`` / ``0`` / ``0.0`` /
    ``""`` (no dock). A str is a byte count as every other (``_api/env.parse_bytes``: ASCII digits or
    ``40e9``), a fraction in ASCII digits with a point (``0.6``), or an off spelling of a switch
    (``0, false, no, off``, any case: no dock); numpy numbers count as ints and floats.

    Raises:
        ValueError: anything else, naming ``where`` (a bool, a negative or non-finite number, a non-whole
            float above 1, fewer than :data:`MIN_BUDGET_BYTES` bytes).
    """
    hint = "give bytes (e.g. 40000000000 or 40e9) or a fraction of the device's memory (a float in (0, 1], e.g. 0.6)"
    if value is None:
        return None
    raw = value
    if isinstance(value, str):
        text = value.strip()
        if text == "" or text.lower() in OFF:  # the off spellings of every switch (_api/env.OFF)
            return None
        try:
            value = parse_bytes(text, where)  # [Note: one parser for byte counts]
        except ValueError:
            value = float(text) if _FRACTION.fullmatch(text) else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"torchferry: {where}: {raw!r} is not a dock budget: {hint}")
    if isinstance(value, numbers.Integral):
        n = int(value)
        if n == 0:
            return None
        if n >= MIN_BUDGET_BYTES:
            return n
        why = "1 is one byte, not 'on': 1.0 is the whole device" if n == 1 else f"{n} bytes is no GPU budget"
        raise ValueError(f"torchferry: {where}: {raw!r} is not a dock budget ({why}): {hint}")
    x = float(value)
    if x == 0.0:
        return None
    if math.isfinite(x) and 0.0 < x <= 1.0:
        return x
    if math.isfinite(x) and x >= MIN_BUDGET_BYTES and x.is_integer():
        return int(x)
    raise ValueError(f"torchferry: {where}: {raw!r} is not a dock budget: {hint}")


def budget_spec(choice: object) -> int | float | None:
    """``patch(dock=...)``'s choice, else ``TORCHFERRY_VERL_DOCK`` (``None``: no dock).

    Raises:
        ValueError: a malformed budget (see :func:`parse_budget`).
    """
    import os

    if choice is not None:
        return parse_budget(choice, "patch(dock=...)")
    return parse_budget(os.environ.get(DOCK_ENV), DOCK_ENV)


def _signature_check(obj: Callable, params: tuple[str, ...], what: str) -> None:
    try:
        names = tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError) as e:
        raise RuntimeError(f"torchferry: verl dock: cannot read the signature of {what}: {e}") from e
    if names[:len(params)] != params:
        raise RuntimeError(f"torchferry: verl dock: {what} takes {names}, not {params} as in verl 0.9.1; "
                           "this verl is not supported by patch(dock=...) (nothing was replaced)")


def verl_targets() -> dict[str, Any]:
    """What the dock mode replaces or reads in verl, checked.

    Raises:
        RuntimeError: verl is not 0.9.x, or one of these changed (nothing is replaced then).
    """
    try:
        import verl
        from verl.workers import engine_workers
        from verl.workers.engine import base
        from verl.workers.engine.fsdp import transformer_impl
    except Exception as e:  # verl's modules or what they import are missing
        raise RuntimeError(f"torchferry: verl dock: verl's engine modules do not import: {e}") from e
    version = str(getattr(verl, "__version__", "?"))
    if not version.startswith("0.9."):
        raise RuntimeError(f"torchferry: verl dock: written for verl 0.9.x, this is verl {version}; "
                           "nothing was replaced (patch() without dock= still works where its helpers match)")
    ctx = getattr(base, "BaseEngineCtx", None)
    worker = getattr(engine_workers, "ActorRolloutRefWorker", None)
    engine = getattr(transformer_impl, "FSDPEngine", None)
    if ctx is None or worker is None or engine is None:
        raise RuntimeError("torchferry: verl dock: BaseEngineCtx, ActorRolloutRefWorker or FSDPEngine is missing "
                           f"in verl {version}; nothing was replaced")
    _signature_check(ctx.__init__, ("self", "engine", "mode"), "BaseEngineCtx.__init__")
    _signature_check(ctx.__exit__, ("self", "exc_type", "exc_val", "exc_tb"), "BaseEngineCtx.__exit__")
    _signature_check(worker.init_model, ("self",), "ActorRolloutRefWorker.init_model")
    return {"ctx": ctx, "worker": worker, "engine": engine}


def _rollout_bytes(worker: Any) -> tuple[int, int]:
    """An estimate of the rollout's weights and KV cache bytes on one device (verl's vLLM / SGLang
    config): the actor's parameters in bf16 over the rollout's tensor parallel size, and
    ``gpu_memory_utilization`` of the device's memory less them."""
    cfg = worker.config.rollout
    tp = int(cfg.get("tensor_model_parallel_size", 1) or 1)
    util = float(cfg.get("gpu_memory_utilization", 0.5) or 0.5)
    module = worker.actor.engine.module
    weights = sum(p.numel() for p in module.parameters()) * 2 // tp
    cuda = torch.cuda.is_available()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else 0
    return int(weights), int(max(0, util * total - weights))


class DockPatch:
    """Replaces ``BaseEngineCtx.__enter__`` / ``__exit__`` and wraps ``ActorRolloutRefWorker.init_model``.

    ``unpatch()`` puts them back and keeps each :class:`~._dock.VerlDock` made, one per budget (its sets
    where it left them): a later ``patch(dock=...)`` of that budget takes it up again; a set held by
    the dock of another budget moves to the one in use at its next phase (``VerlDock.forget``).
    """

    def __init__(self) -> None:
        self.saved: list[tuple[type, str, Any]] = []
        self.kept: dict[tuple[str, int | float], VerlDock] = {}  # budget -> its dock, also after unpatch()

    def _take(self, budget: int | float) -> None:
        key = (type(budget).__name__, budget)  # 1 (a byte) and 1.0 (the device) are two budgets
        if key not in self.kept:
            self.kept[key] = VerlDock(budget)
        _dock.ACTIVE = compat.DOCK_ROUTER = self.kept[key]

    def patch(self, budget: int | float) -> None:
        targets = verl_targets()  # raises before anything is replaced
        if self.saved:  # patched already: the dock of this budget from now on
            self._take(budget)
            return
        ctx, worker, engine_cls = targets["ctx"], targets["worker"], targets["engine"]
        enter, exit_, init_model = ctx.__enter__, ctx.__exit__, worker.init_model

        def dockable(c) -> bool:
            eng = c.engine
            # every flag: what verl keeps resident is reserved ([Note: verl's offload flags under a Dock])
            return (_dock.ACTIVE is not None and isinstance(eng, engine_cls) and not c.disable_auto_offload
                    and not eng.engine_config.forward_only)

        def __enter__(c):
            if not dockable(c):
                return enter(c)
            active = _dock.ACTIVE
            assert active is not None
            active.enter(c.engine, c.mode, model=c.engine.is_param_offload_enabled,
                         optimizer=c.mode == "train" and c.engine.is_optimizer_offload_enabled)
            c._torchferry_dock = active  # its exit leaves this dock, also if patch(dock=...) changed it since
            c.engine.mode = c.mode  # after the dock took the phase: a refused phase leaves it as it was

        def __exit__(c, exc_type, exc_val, exc_tb):
            entered = c.__dict__.pop("_torchferry_dock", None)
            if entered is None and not dockable(c):
                return exit_(c, exc_type, exc_val, exc_tb)
            active = entered if entered is not None else _dock.ACTIVE
            assert active is not None
            try:
                active.leave(c.engine, c.mode)
            finally:
                c.engine.mode = None

        def init_model_docked(w, *args, **kwargs):
            out = init_model(w, *args, **kwargs)
            rollout = getattr(w, "rollout", None)
            if _dock.ACTIVE is not None and rollout is not None and getattr(w, "actor", None) is not None:
                dock_rollout(rollout, *_rollout_bytes(w))
            return out

        for cls, name, fn in ((ctx, "__enter__", __enter__), (ctx, "__exit__", __exit__),
                              (worker, "init_model", init_model_docked)):
            self.saved.append((cls, name, cls.__dict__[name]))
            fn.__wrapped__ = cls.__dict__[name]  # type: ignore[attr-defined]
            setattr(cls, name, fn)
        self._take(budget)

    def unpatch(self) -> None:
        for cls, name, fn in reversed(self.saved):
            setattr(cls, name, fn)
        self.saved.clear()
        if _dock.ACTIVE is not None:  # a phase still open now exits through verl's own code
            _dock.ACTIVE.close_phases()
        _dock.ACTIVE = compat.DOCK_ROUTER = None  # the dock is kept as it is, the rollout's claimants too
