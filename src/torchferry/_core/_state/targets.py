"""Target adapters: what a module, an optimizer or a tensor holds, walked one way.

One walk (:func:`walk`) serves both planning (with names, for errors) and the
fingerprint (ids only), so their orders cannot drift apart. Modules give their
parameters, each parameter's ``.grad`` (whatever ``requires_grad`` says: a
frozen parameter can still hold one) and buffers; optimizers every tensor in
``optimizer.state`` (LBFGS history lists included) and, for wrappers that keep
an inner optimizer as an attribute (``ZeroRedundancyOptimizer.optim``,
``PostLocalSGDOptimizer.optim``), the inner optimizer's too; tensors
themselves. :func:`check_tensor` refuses, by name, every tensor the engine
cannot move, before anything moves.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .fsdp import is_dtensor, local_of, reshard, storage_key
from .tree import named_tensors, tensors_of

__all__ = ["Targets", "check_tensor", "hidden_optimizer_tensors", "inner_optimizers", "tensors", "walk"]

_PLAIN = (torch.Tensor, nn.Parameter)


def inner_optimizers(opt: torch.optim.Optimizer) -> list[tuple[str, torch.optim.Optimizer]]:
    """``opt`` and the optimizers it wraps as attributes (recursively), with their paths."""
    out: list[tuple[str, torch.optim.Optimizer]] = []
    seen: set[int] = set()

    def visit(path: str, o: torch.optim.Optimizer) -> None:
        if id(o) in seen:
            return
        seen.add(id(o))
        out.append((path, o))
        for attr, value in vars(o).items():
            if isinstance(value, torch.optim.Optimizer):
                visit(f"{path}.{attr}", value)

    visit("optimizer", opt)
    return out


def _state_tensors(value: object, suffix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in an optimizer-state value: a tensor, or lists/tuples of them (LBFGS history)."""
    if isinstance(value, torch.Tensor):
        yield suffix, value
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            yield from _state_tensors(v, f"{suffix}[{j}]")


def walk(targets: Sequence[object]) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Every tensor behind ``targets``, in a fixed order, with where it was found.

    Yields ``(where, tensor)``; ``where`` is cheap to make and turned into a
    name by :func:`describe` only when one is needed. A tensor reachable twice
    is yielded twice (the planner deduplicates).

    Raises:
        TypeError: a target that is not a module, optimizer or tensor.
        NotImplementedError: a TorchScript module.
    """
    for i, target in enumerate(targets):
        yield from _walk_one(i, target)


def tensors(targets: Sequence[object]) -> list[torch.Tensor]:
    """The tensors of :func:`walk` in its order, without where each was found: what every offload's
    fingerprint and every reload's check for replaced state read
    (``tests/cpu/test_targets.py::test_tensors_are_the_walks_tensors``).

    Raises:
        As :func:`walk`.
    """
    out: list[torch.Tensor] = []
    for i, target in enumerate(targets):
        if isinstance(target, nn.Module) and not isinstance(target, torch.jit.ScriptModule):
            params, buffers = tensors_of(target)
            for p in params:
                out.append(p)
                g = p.grad
                if g is not None:
                    out.append(g)
            out.extend(buffers)
        elif isinstance(target, torch.Tensor):
            out.append(target)
        else:  # an optimizer (its paths and order), or a target walk() refuses
            out.extend(t for _, t in _walk_one(i, target))
    return out


def _walk_one(i: int, target: object) -> Iterator[tuple[tuple, torch.Tensor]]:
    """:func:`walk` of ``targets[i]`` alone (errors name it as ``targets[i]``)."""
    if isinstance(target, nn.Module):
        if isinstance(target, torch.jit.ScriptModule):
            raise NotImplementedError(
                f"torchferry: targets[{i}] is a TorchScript module; its forward cannot be guarded while "
                "offloaded. Make the ferry over the eager module."
            )
        params, buffers = named_tensors(target)
        for name, p in params:
            yield (i, name), p
            g = p.grad
            if g is not None:
                yield (i, name, ".grad"), g
        for name, b in buffers:
            yield (i, name), b
    elif isinstance(target, torch.optim.Optimizer):
        for path, opt in inner_optimizers(target):
            order = {id(p): k for k, p in enumerate(p for g in opt.param_groups for p in g["params"])}
            # Every entry of optimizer.state, also of parameters no longer in a group.
            for n, (p, state) in enumerate(opt.state.items()):
                for key, value in state.items():
                    for suffix, t in _state_tensors(value, ""):
                        yield (i, path, order.get(id(p), f"extra{n}"), key, suffix), t
    elif isinstance(target, torch.Tensor):
        yield (i,), target
    else:
        hint = ""
        if isinstance(target, (list, tuple, dict)) or hasattr(target, "__next__"):
            hint = " (pass tensors as separate arguments: Ferry(*tensors), or pass the module itself)"
        raise TypeError(
            "torchferry: a target must be an nn.Module, a torch.optim.Optimizer "
            f"or a torch.Tensor; targets[{i}] is {type(target).__name__}{hint}"
        )


def describe(targets: Sequence[object], where: tuple) -> str:
    """A readable name for a :func:`walk` position: ``"Linear.weight.grad"``,
    ``"optimizer.state[0]['exp_avg']"``, ``"tensors[2]"``."""
    i = where[0]
    target = targets[i]
    if isinstance(target, nn.Module):
        prefix = type(target).__name__ if len(targets) == 1 else f"targets[{i}]"
        return f"{prefix}.{where[1]}" + (where[2] if len(where) > 2 else "")
    if isinstance(target, torch.optim.Optimizer):
        _, path, index, key, suffix = where
        return f"{path}.state[{index}][{key!r}]{suffix}"
    return f"tensors[{i}]"


def hidden_optimizer_tensors(opt: torch.optim.Optimizer, device: torch.device,
                             known_storages: set[int]) -> list[tuple[str, int]]:
    """Device tensors an optimizer holds outside ``optimizer.state`` and its parameters.

    Looks at the optimizer's attributes (and lists, tuples and dicts in them,
    one level down) for tensors on ``device`` whose storage is neither a
    parameter's nor in ``known_storages`` (``StorageImpl`` addresses). Such
    state would silently stay on the device.

    Returns:
        ``(attribute path, bytes)`` per such tensor.
    """
    params = {storage_key(p.untyped_storage()) for g in opt.param_groups for p in g["params"]
              if isinstance(p, torch.Tensor) and type(p) in _PLAIN}
    params |= {storage_key(local_of(p).untyped_storage()) for g in opt.param_groups for p in g["params"]
               if is_dtensor(p)}
    found: list[tuple[str, int]] = []

    def check(path: str, t: object) -> None:
        if not isinstance(t, torch.Tensor) or type(t) not in _PLAIN or t.device != device:
            return
        st = t.untyped_storage()
        if storage_key(st) not in params and storage_key(st) not in known_storages and st.nbytes():
            found.append((path, st.nbytes()))

    for attr, value in vars(opt).items():
        if attr in ("state", "param_groups") or isinstance(value, torch.optim.Optimizer):
            continue
        items = (value.items() if isinstance(value, dict)
                 else enumerate(value) if isinstance(value, (list, tuple)) else ())
        check(attr, value)
        for k, v in items:
            check(f"{attr}[{k!r}]", v)
            if isinstance(v, (list, tuple)):
                for j, w in enumerate(v):
                    check(f"{attr}[{k!r}][{j}]", w)
    return found


def check_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """Validates ``t`` and returns the plain tensor whose storage moves.

    Raises:
        NotImplementedError: meta, nested, sparse and other non-strided,
            quantized, conjugate/negative-bit and shared-memory tensors,
            tensor subclasses other than DTensor, and DTensors whose local
            shard is itself a subclass (NF4, float8).
        RuntimeError: the tensor's storage is not there (offloaded by another
            ferry, or released).
    """
    if t.is_meta:
        raise NotImplementedError(
            f"torchferry: {name} is a meta tensor ({t.shape=}); it has no data to "
            "move. Materialise it (e.g. module.to_empty(device=...)) first."
        )
    local = t
    if is_dtensor(t):
        local = local_of(t)
        if type(local) not in _PLAIN:
            raise NotImplementedError(
                f"torchferry: {name} is a DTensor whose local shard is a {type(local).__name__} "
                "(a tensor subclass such as NF4 or float8); only plain local shards move"
            )
    elif type(t) not in _PLAIN and not isinstance(t, nn.Parameter):
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if is_traceable_wrapper_subclass(t):
            raise NotImplementedError(
                f"torchferry: {name} is a {type(t).__name__}; of the tensor "
                "subclasses only DTensor is supported"
            )
    if local.is_nested:
        raise NotImplementedError(f"torchferry: {name} is a nested tensor; only strided, non-nested tensors move")
    if local.layout != torch.strided:
        raise NotImplementedError(
            f"torchferry: {name} has layout {local.layout}; only strided tensors move"
        )
    if local.is_meta:
        raise NotImplementedError(f"torchferry: {name} has a meta local shard ({local.shape=})")
    if local.is_quantized:
        raise NotImplementedError(f"torchferry: {name} is a quantized tensor ({local.dtype}); not supported")
    if local.is_conj() or local.is_neg():
        raise NotImplementedError(
            f"torchferry: {name} has the conjugate or negative bit set; call .resolve_conj() / "
            ".resolve_neg() on it first"
        )
    if local.device.type == "cpu" and local.is_shared():
        raise NotImplementedError(
            f"torchferry: {name} is in shared memory (share_memory_(), a file mapped by torch.from_file(...), "
            "or a tensor received from another process through torch.multiprocessing); releasing it would break "
            "the other processes' (or the file's) view of it. Give it memory of its own first "
            "(t.data = t.data.clone()); nothing was moved"
        )
    _check_backed(name, local)
    return local


def _check_backed(name: str, local: torch.Tensor) -> None:
    """Refuses tensors whose storage is not there: offloaded by another ferry, or released."""
    from .host_blocks import in_host_pool

    if local.numel() == 0:
        return
    st = local.untyped_storage()
    if local.device.type == "cpu" and in_host_pool(st.data_ptr()):
        raise RuntimeError(
            f"torchferry: {name} is already offloaded by another Ferry (it views that ferry's "
            "host pool); reload that ferry first, or, if it was dropped while offloaded, move the "
            "state off its pool by ordinary copies (model.to(device))"
        )
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(local.shape, local.stride(), strict=False))
    needed = (local.storage_offset() + extent) * local.element_size()
    if st.nbytes() < needed:
        raise RuntimeError(
            f"torchferry: the storage of {name} holds {st.nbytes()} bytes but the tensor needs "
            f"{needed}: its memory was released (offloaded by another Ferry, or resize_(0)); "
            "reload it first"
        )


class Targets:
    """A ferry's targets: modules and optimizers by weak reference, tensors held.

    A ferry must not keep a model alive that its user dropped; a tensor target
    has no other owner to keep it.
    """

    def __init__(self, targets: Sequence[object]) -> None:
        self._refs: list[object] = [
            weakref.ref(t) if isinstance(t, (nn.Module, torch.optim.Optimizer)) else t for t in targets
        ]
        self._kinds = [f"{type(t).__name__} {'module' if isinstance(t, nn.Module) else 'optimizer'}"
                       for t in targets]  # for the message once one is gone

    def dead(self) -> str | None:
        """``"targets[i] (a <type> module|optimizer)"`` of the first module or optimizer target that was
        garbage collected, else ``None``."""
        for i, t in enumerate(self._refs):
            if isinstance(t, weakref.ref) and t() is None:
                return f"targets[{i}] (a {self._kinds[i]})"
        return None

    def refuse_reload_if_dead(self) -> None:
        """Raises ``RuntimeError`` naming a target collected while the state was offloaded, and the way out
        (``close()``: [Note: a target collected while offloaded] in ``_ferry/guards.py``)."""
        gone = self.dead()
        if gone is not None:
            raise RuntimeError(
                f"torchferry: {gone} of this ferry was garbage collected while its state was offloaded, so "
                "reload() cannot bring the state back; call close(): what was offloaded stays on the host as CPU "
                "tensors (an optimizer's step() works on them), and .to(device) moves them back by ordinary copies")

    def live(self) -> list[object]:
        """The targets.

        Raises:
            RuntimeError: a module or optimizer target was garbage collected
                (the ferry holds them weakly), named by position and type.
        """
        out = [t() if isinstance(t, weakref.ref) else t for t in self._refs]
        if any(t is None for t in out):
            raise RuntimeError(
                f"torchferry: {self.dead()} of this ferry was garbage collected: a ferry holds its modules and "
                "optimizers by weak reference, so keep a reference to it (model = ...; Ferry(model)) while the "
                "ferry is used"
            )
        return out

    def resharded(self) -> list[object]:
        """The live targets, their FSDP units resharded (the sharded parameters registered)."""
        targets = self.live()
        reshard([m for m in targets if isinstance(m, nn.Module)])
        return targets

    def ids(self) -> list[int]:
        """``id`` of every tensor the targets hold now, in walk order (who is there, not where)."""
        return [id(t) for t in tensors(self.live())]
