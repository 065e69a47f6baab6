"""Hooks installed while offloaded: use of the state fails loudly instead of running on the
host, and ``state_dict()`` waits for the offload's copies ([Note: state_dict() waits for the
offload]).

[Note: state_dict() waits for the offload]
``offload()`` returns with its D2H copies in flight on the D2H stream, the targets' tensors
already host tensors viewing the pool; a host read before the copies finish reads the pool's
old bytes. Synchronising the caller's stream does not order it (verl's seed copied on the
caller's stream, so its ``.item()``, ``.cpu()`` or ``current_stream().synchronize()`` did).
The bug this prevents: a corrupt checkpoint from verl's ``FSDPCheckpointManager``
(``optimizer.state_dict()``, then ``torch.save``) right after the optimizer's offload; on one
H200 (12 x 8192^2 AdamW, 6.4 GB of state) the last state tensor read on the host right after
the offload differed from the state in 3 of 3 trials. While offloaded, every module and
optimizer target therefore has a state-dict pre-hook that waits (on the
host) for the offload's handle, so ``state_dict()``, and DCP's ``get_model_state_dict`` /
``get_optimizer_state_dict`` which call it, return tensors whose bytes are in the pool. A
module's ``load_state_dict()`` waits too: it writes the pool in place, and a copy still in
flight would overwrite what it wrote. The hooks go on the targets themselves (one each, not
one per submodule: a few microseconds per offload), so a submodule's own ``state_dict()``
does not wait. They hold the handle, not the ferry, so they still wait after the ferry is
dropped; once the copies are seen complete a hook is an attribute check, and nothing is
installed while the state is resident. Host reads by other means (``p.sum().item()``,
``p.numpy()``, ``torch.save`` of tensors taken from ``parameters()``) need ``handle.wait()``.

[Note: FSDP1's state dict while offloaded]
An FSDP1 (``FullyShardedDataParallel``) model's ``state_dict()`` and ``load_state_dict()`` run FSDP1's own
pre-hooks first: they all-gather the flat parameters (NCCL takes no host tensor) and, with
``use_orig_params=True``, write the original parameters back into the flat parameter's storage, which the
offload released. On 2 gloo ranks that raised PyTorch's ``setStorage: ... out of bounds for storage of size 0``
and left FSDP1 inside its unshard context, so every later ``state_dict()``, after ``reload()`` too, failed
(``AssertionError: Entering the _unshard_fsdp_state_params context but _unshard_params_ctx[module] is not
None``): checkpointing broken for the rest of the run. So every FSDP1 unit of a target (the root and the
units inside it, whose own ``state_dict()`` does the same) refuses both calls while offloaded, in hooks placed
before FSDP1's (``run_first`` in ``_state/fsdp1.py``): nothing of FSDP1 has run,
and after ``reload()`` both work (verl's checkpoint manager loads the model before it saves or loads). Test:
``tests/cpu/test_integration_verl_fsdp1.py::test_an_fsdp1_state_dict_while_offloaded_is_refused_and_fsdp1_stays_usable``.
``nn.Module._apply`` (``.to()``, ``.float()``, a parent's ``.double()``) of a unit with ``use_orig_params=True``
is the same kind: FSDP1 exposes its flat parameter, which is not a registered parameter (the ferry re-points
the original ones), and the cast read its released storage (a segfault on 2 gloo ranks). It is refused too,
by an ``_apply`` on the unit itself while offloaded (``refuse_fsdp1_call``):
``tests/cpu/test_fsdp1_submodule_move.py``. So is FSDP1's ``apply(fn)`` (any ``use_orig_params``), which
unshards first and, with ``use_orig_params=False``, left ``state_dict()`` failing after ``reload()``
(``tests/cpu/test_fsdp_ferry_dropped_while_offloaded.py``).
"""

from __future__ import annotations

import logging
import weakref

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._api.handle import TransferHandle
from .._api.hooks import Uncopyable
from .._state.fsdp import local_of, own_tensors, rehome_sharded_data
from .._state.fsdp1 import fsdp1_units, refuse_fsdp1_call, rehome_flat_params, run_first
from .._state.tree import module_tree

__all__ = ["OffloadGuards", "dropped"]


def _owns_state(m: nn.Module) -> bool:
    """Whether ``m`` directly holds a parameter or buffer (``None`` entries do not count)."""
    params, buffers = own_tensors(m)  # most modules of a large model hold neither
    return bool(params) and any(v is not None for v in params.values()) or (
        bool(buffers) and any(v is not None for v in buffers.values()))


# FSDP1 calls refused while offloaded: (the method, the call, what FSDP1 would read), see
# [Note: FSDP1's state dict while offloaded]
_FSDP1_CALLS = (
    ("_apply", ".to() / .float() / .cuda() (nn.Module._apply)",
     "FSDP1's _apply reads its flat parameter (use_orig_params=True)"),
    ("apply", "apply(fn)", "FSDP1's apply unshards the flat parameters"),
)


class OffloadGuards:
    """Forward, step and state-dict pre-hooks, installed while offloaded.

    Every module in a target's tree that directly owns parameters or buffers
    gets a forward pre-hook (prepended, so it runs before FSDP2's all-gather),
    and every optimizer target a step pre-hook. Both raise ``RuntimeError``
    naming what to call. Each module target (its ``state_dict()`` and
    ``load_state_dict()``) and each optimizer target (its ``state_dict()``)
    gets a pre-hook that waits for :attr:`pending` ([Note: state_dict() waits
    for the offload]). None of these is installed while the state is resident (a
    resident ferry's only hooks are its watch's: [Note: state dropped while resident] in
    ``watch.py``).

    Attributes:
        pending: the transfer a ``state_dict()`` waits for (the ferry's last,
            set as it is issued), or ``None``.
    """

    def __init__(self, describe: Callable[[], str]) -> None:
        self._describe = describe  # e.g. "Ferry(..., residency=HOST)"
        self._handles: list[RemovableHandle] = []
        self._roots: list[weakref.ref[nn.Module]] = []  # the module targets, while installed
        self.pending: TransferHandle | None = None

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        if self._handles:
            return
        during = lambda: f"its state is offloaded ({self._describe()})"  # noqa: E731
        wait, step = Uncopyable(self._wait_hook, during), Uncopyable(self._step_hook, during)
        refuse = Uncopyable(self._fsdp1_state_dict_hook, during)
        self._roots = [weakref.ref(m) for m in modules]
        for root in modules:  # hooks refuse copies: [Note: a module copied while its state is away] in _api/hooks
            for name, m in module_tree(root):
                if m is root or _owns_state(m):
                    guard = Uncopyable(self._forward_hook(name), during)
                    self._handles.append(m.register_forward_pre_hook(guard, prepend=True))
            # The root's hooks run before any submodule's state is read or written.
            self._handles.append(root.register_state_dict_pre_hook(wait))
            self._handles.append(root.register_load_state_dict_pre_hook(wait))
            for unit in fsdp1_units(root):  # see [Note: FSDP1's state dict while offloaded]
                first = unit.register_state_dict_pre_hook(refuse), unit.register_load_state_dict_pre_hook(refuse)
                self._handles.extend(first)
                run_first(unit, *first)
                for method, call, why in _FSDP1_CALLS:
                    hook = Uncopyable(self._fsdp1_call_hook(unit, call, why), during)
                    applied = refuse_fsdp1_call(unit, method, hook)
                    if applied is not None:
                        self._handles.append(applied)  # pyright: ignore[reportArgumentType]  # has remove()
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(step))
            self._handles.append(opt.register_state_dict_pre_hook(wait))

    def roots(self) -> list[nn.Module]:
        """The module targets the guards were installed on that are still alive."""
        return [m for m in (r() for r in self._roots) if m is not None]

    def remove(self) -> None:
        self._roots = []
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()

    def _forward_hook(self, name: str):
        def hook(module: nn.Module, args: object) -> None:
            where = f"{type(module).__name__} '{name}'" if name else f"the {type(module).__name__} target"
            raise RuntimeError(
                f"torchferry: forward of {where} while its state is offloaded to host "
                f"memory ({self._describe()}); call ferry.reload() (with the verl helpers: "
                "load_fsdp_model_to_gpu(model)) before running it"
            )

        return hook

    def _wait_hook(self, *args: object) -> None:
        # See [Note: state_dict() waits for the offload].
        pending = self.pending
        if pending is not None:
            pending.wait()  # returns at once once seen complete

    def _fsdp1_state_dict_hook(self, module: nn.Module, *args: object) -> None:
        raise RuntimeError(
            f"torchferry: state_dict() / load_state_dict() of the FSDP1 model {type(module).__name__} while its "
            f"state is offloaded ({self._describe()}): FSDP1's own state-dict hooks read and write the device "
            "storages the offload released; call ferry.reload() (with the verl helpers: "
            "load_fsdp_model_to_gpu(model)) first"
        )

    def _fsdp1_call_hook(self, unit: nn.Module, call: str, why: str):
        name = type(unit).__name__

        def hook(*args: object, **kwargs: object) -> None:
            raise RuntimeError(
                f"torchferry: {call} of the FSDP1 unit {name} while its state is offloaded ({self._describe()}): "
                f"{why}, whose device storage the offload released; refused before FSDP1 read it. Call "
                "ferry.reload() (with the verl helpers: load_fsdp_model_to_gpu(model)) first"
            )

        return hook

    def _step_hook(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if _changes_nothing(optimizer):  # see [Note: a step that changes nothing]
            self._wait_hook()  # it reads and writes the pool's views: after the offload's copies into them
            return
        raise RuntimeError(
            f"torchferry: {type(optimizer).__name__}.step() while its state is "
            f"offloaded to host memory ({self._describe()}); call ferry.reload() first"
        )


def _changes_nothing(optimizer: torch.optim.Optimizer) -> bool:
    """[Note: a step that changes nothing]
    DCP's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` of an optimizer that has not stepped make its
    state with one step (``_init_optim_state``: every ``.grad`` zeros, every ``lr`` a group has 0) and put the
    ``lr`` back only after it. Refused, that step left ``lr`` at 0 and zero ``.grad``s behind. So a step of an
    optimizer without state, every ``lr`` 0 (where a group has one) and every gradient zero runs while offloaded, as
    it would without torchferry: its state is made where the parameters are (the pool's views, once the offload's
    copies into them are done) and taken to the device by the reload, as state a ``load_state_dict`` gives while
    offloaded (``tests/cpu/test_dcp_state_dict_while_offloaded.py``, ``tests/cpu/test_step_guard_noop_step.py``)."""
    if optimizer.state:
        return False
    groups = optimizer.param_groups  # DCP zeroes every lr a group has (None too); a group without one keeps none
    if any("lr" in g and not (isinstance(g["lr"], (int, float, torch.Tensor)) and float(g["lr"]) == 0.0)
           for g in groups):
        return False
    return all(p.grad is None or not local_of(p.grad).any() for g in groups for p in g["params"])


def dropped(guards: OffloadGuards, warn: bool = True) -> None:
    """Called when a ``Ferry`` is garbage-collected (a ``weakref.finalize``).

    [Note: a ferry dropped while offloaded]
    Its state stays where it is: on the host, as CPU tensors viewing the pool (which stays mapped
    while any of them lives), bit-exact. Its guards would refuse every forward and step with a
    message naming a ``reload()`` nobody can call any more, so they go with the ferry, once its
    last offload's copies are complete (the ``state_dict()`` hooks waited for them: now nothing
    would); the module then runs on the host, or ``model.to(device)`` brings it back by ordinary
    copies. FSDP's own tensors that no target holds (FSDP2's shard buffers, FSDP1's local shard and, with
    ``use_orig_params=True``, its flat parameter) viewed the released device storages: a forward segfaulted, a
    ``.to()`` or ``state_dict()`` raised; they are pointed at the host state first (``rehome_sharded_data``,
    ``rehome_flat_params``: ``tests/cpu/test_fsdp_ferry_dropped_while_offloaded.py``).
    Not at the interpreter's exit (the finalizer's ``atexit`` is off): a ferry still alive
    then goes with the process, and a warning about it would only be noise after a program's output.

    [Note: a target collected while offloaded]
    A module (or optimizer) target collected while its state is offloaded leaves the state no
    ``reload()`` can bring back (the ferry finds its tensors through its targets). Its optimizer, still
    alive, refused ``step()`` naming ``reload()``, ``reload()`` refused naming the collected target, and
    ``close()`` refused naming ``reload()``: a loop. Now ``reload()`` names
    ``close()``, and ``close()`` of such a ferry leaves the state as a dropped ferry does (above, no
    warning: the caller asked), so the optimizer steps on the host tensors
    (``tests/cpu/test_misuse.py::test_a_model_collected_while_offloaded_has_a_way_out``).
    """
    if not guards.installed:
        return
    if guards.pending is not None:
        guards.pending.wait()
    roots = guards.roots()  # FSDP's own tensors over released storages: at the host state
    rehome_sharded_data(roots)
    rehome_flat_params(roots)
    guards.remove()
    if warn:
        logging.getLogger("torchferry").warning(
            "torchferry: a Ferry was dropped while its state was offloaded; the state stays on the host as CPU "
            "tensors (model.to(device) brings it back)")
