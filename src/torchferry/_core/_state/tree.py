"""Walking module trees: PyTorch's order, without its per-level generators, once per operation.

[Note: module walks]
An offload walks the targets' module trees several times: to reshard the
FSDP units, to fingerprint the state, to install the forward guards (and a
reload once more, to find replaced state). ``nn.Module.named_modules``
resumes one generator per level of nesting for every module it yields; a 7B
peft LoRA model has about 2,000 modules up to 10 deep, and these walks were
the largest host cost of an offload that copies almost nothing (2 x H200,
``torchferry bench-lora``: 35 ms to offload 7.9 GB of parameters copying 0
bytes). :func:`module_tree` makes the same list with a stack, and inside
:func:`tree_memo` (each ``Ferry.offload()`` / ``reload()``, which run no user
code in between) a root is walked once. A module class overriding
``named_modules``, ``named_parameters`` or ``named_buffers`` (FSDP1, some peft
layers) in the tree gets PyTorch's module walk, and a root overriding
``named_parameters`` or ``named_buffers`` is asked for them itself (an override's extra
tensors were left behind:
``tests/cpu/test_targets.py::test_a_root_overriding_named_parameters_and_buffers_is_asked_for_them``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["members", "module_tree", "named_tensors", "tensors_of", "tree_memo"]

_STANDARD = (nn.Module.named_modules, nn.Module.named_parameters, nn.Module.named_buffers, nn.Module.named_children)
_memo = threading.local()


@contextlib.contextmanager
def tree_memo() -> Iterator[None]:
    """Within the block, :func:`module_tree` walks each root once (the trees must not change)."""
    outer = getattr(_memo, "trees", None)
    if outer is None:
        _memo.trees = {}
    try:
        yield
    finally:
        if outer is None:
            _memo.trees = None


def module_tree(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(root.named_modules())``: the same modules in the same order (pre-order, each once).

    Made with a stack; memoised inside :func:`tree_memo`. See [Note: module walks].
    """
    trees = getattr(_memo, "trees", None)
    if trees is not None:
        hit = trees.get(id(root))
        if hit is not None and hit[0] is root:
            return hit[1]
    out = _walk(root)
    if trees is not None:
        trees[id(root)] = (root, out)
    return out


def _walk(root: nn.Module) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack = [("", root)]
    while stack:
        prefix, m = stack.pop()
        if id(m) in seen:
            continue
        cls = type(m)
        if (cls.named_modules, cls.named_parameters, cls.named_buffers, cls.named_children) != _STANDARD:
            return list(root.named_modules())
        seen.add(id(m))
        out.append((prefix, m))
        children = list(m.named_children())  # public: the private _modules is read in fsdp.py only
        if children:
            dot = prefix + "." if prefix else ""
            stack.extend((dot + k, c) for k, c in reversed(children))
    return out


Named = Iterator[tuple[str, torch.Tensor]]


def named_tensors(root: nn.Module) -> tuple[Named, Named]:
    """``(root.named_parameters(), root.named_buffers())``, from one :func:`module_tree` where the
    root's class does not override them."""
    standard_p, standard_b, tree = _standard(root)
    return (members(tree, "_parameters") if standard_p else root.named_parameters(),
            members(tree, "_buffers") if standard_b else root.named_buffers())


def _standard(root: nn.Module) -> tuple[bool, bool, list[tuple[str, nn.Module]]]:
    """Whether ``root``'s class keeps PyTorch's ``named_parameters`` and ``named_buffers``, and the
    :func:`module_tree` their stand-ins read (none where both are overridden)."""
    cls = type(root)
    standard_p = cls.named_parameters is nn.Module.named_parameters
    standard_b = cls.named_buffers is nn.Module.named_buffers
    return standard_p, standard_b, module_tree(root) if standard_p or standard_b else []


def members(tree: list[tuple[str, nn.Module]], kind: str) -> Named:
    """``named_parameters()`` (``kind="_parameters"``) or ``named_buffers()`` (``"_buffers"``) over a
    :func:`module_tree`: the same names and order, each tensor once, ``None`` entries skipped."""
    seen: set[int] = set()
    for prefix, m in tree:
        for k, t in getattr(m, kind).items():
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield (prefix + "." + k if prefix else k), t


def tensors_of(root: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors :func:`named_tensors` yields, without their names: ``(parameters, buffers)`` in the same
    order, each once. For the checks every offload and reload repeats (fingerprint, ids), where making a
    name per tensor was most of the walk's cost."""
    standard_p, standard_b, tree = _standard(root)
    return (_member_list(tree, "_parameters") if standard_p else [t for _, t in root.named_parameters()],
            _member_list(tree, "_buffers") if standard_b else [t for _, t in root.named_buffers()])


def _member_list(tree: list[tuple[str, nn.Module]], kind: str) -> list[torch.Tensor]:
    """:func:`members` without the names."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for _, m in tree:
        found = getattr(m, kind)
        if not found:
            continue
        for t in found.values():
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            out.append(t)
    return out
