"""Every read of FSDP2's, DTensor's and torch's internals (private attributes and functions), in one place
(FSDP1's beside it, in ``fsdp1.py``).

A torch upgrade that renames a private attribute touches these two files only; the
rest of torchferry asks them. Written against torch 2.11-2.13
(``torch/distributed/fsdp/_fully_shard/`` and ``torch/distributed/tensor/``).
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import sys

import torch
from torch import nn

from .host_blocks import in_host_pool
from .tree import module_tree

__all__ = [
    "allocator_settings_set",
    "base_held_by_python",
    "comm_streams",
    "dtensor_twin",
    "forward_prefetch_units",
    "fsdp2_offloads_params",
    "fsdp_held",
    "fsdp_modules",
    "idle_and_resharded",
    "is_dtensor",
    "lazy_init_done",
    "local_of",
    "param_groups",
    "released",
    "rehome_sharded_data",
    "repoint_sharded_data",
    "resync_sharded_data",
    "sharded_data_left_behind",
    "sharded_params",
    "reshard",
    "foreach_copy",
    "set_local",
    "sharded_storages",
    "storage_key",
    "storage_refs",
    "swap_impls",
    "swap_local",
    "own_tensors",
    "unit_key",
    "view_base",
    "versions",
]

_PLAIN = (torch.Tensor, nn.Parameter)


def is_dtensor(t: torch.Tensor) -> bool:
    """True if ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it eagerly)."""
    if type(t) in _PLAIN:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose storage moves: a DTensor's local shard, else ``t`` itself."""
    return t if type(t) in _PLAIN else getattr(t, "_local_tensor", t)


def dtensor_twin(t: torch.Tensor, new_local: torch.Tensor) -> torch.Tensor:
    """A new DTensor with ``t``'s spec and ``requires_grad`` over ``new_local``."""
    from torch.distributed.tensor import DTensor

    return DTensor(new_local, t._spec, requires_grad=t.requires_grad)


def swap_local(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchanges the local shards of two DTensors (the Python slot beside the wrapper impl)."""
    a._local_tensor, b._local_tensor = b._local_tensor, a._local_tensor


def set_local(t: torch.Tensor, local: torch.Tensor) -> None:
    """Points the DTensor ``t`` at the local shard ``local`` (the Python slot beside the wrapper impl)."""
    t._local_tensor = local


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's identity: the address of its ``StorageImpl`` (``_cdata``), the same for every storage
    object over it (not ``data_ptr()``: zero-size storages all have pointer 0)."""
    return storage._cdata


def swap_impls(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchanges the ``TensorImpl``s of two tensor objects (``torch._C._swap_tensor_impl``)."""
    torch._C._swap_tensor_impl(a, b)


def foreach_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i`` in one batched launch (``torch._foreach_copy_``), on the
    current stream."""
    torch._foreach_copy_(list(dsts), list(srcs))  # pyright: ignore[reportPrivateImportUsage]  # torch._foreach_copy_ is private; the stubs do not export it


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP units (``fully_shard``-ed modules) in ``module``'s tree, root first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for _, m in module_tree(module) if isinstance(m, FSDPModule)]


def unit_key(unit: nn.Module) -> int:
    """Identifies a unit's FSDP state: ``fully_shard([a, b])`` gives ``a`` and ``b`` one key."""
    return id(unit._get_fsdp_state())  # pyright: ignore[reportCallIssue]  # FSDP2 private _get_fsdp_state/reshard on an FSDPModule; nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs


def reshard(modules: list[nn.Module]) -> None:
    """Reshards every FSDP unit under ``modules``: the sharded parameters are registered."""
    for m in modules:
        for unit in fsdp_modules(m):
            unit.reshard()  # pyright: ignore[reportCallIssue]  # nn.Module attributes (FSDP2 methods, Hugging Face submodules/config) type as Tensor | Module in torch's stubs


def param_groups(state: object) -> list:
    """An ``FSDPState``'s ``FSDPParamGroup``s, each once (torch 2.11: ``_fsdp_param_group``, one or
    ``None``; ``_fsdp_param_groups`` from 2.12)."""
    out: dict[int, object] = {}
    for group in [getattr(state, "_fsdp_param_group", None), *(getattr(state, "_fsdp_param_groups", None) or ())]:
        if group is not None:
            out.setdefault(id(group), group)
    return list(out.values())


def forward_prefetch_units(unit: nn.Module) -> list[nn.Module]:
    """The units whose all-gather FSDP2 issues from ``unit``'s pre-forward (explicit prefetch)."""
    try:
        state = unit._get_fsdp_state()  # pyright: ignore[reportCallIssue]  # FSDP2 private _get_fsdp_state
    except AttributeError:
        return []
    out: list[nn.Module] = []
    for other in getattr(state, "_states_to_forward_prefetch", []) or []:
        out.extend(getattr(other, "_modules", ()) or ())  # the FSDPState's modules
        for group in param_groups(other):
            out.extend(getattr(group, "modules", ()) or ())
    return out


def comm_streams(modules: list[nn.Module]) -> list[torch.cuda.Stream]:
    """FSDP2's all-gather streams for the units under ``modules``, each once.

    FSDP2 makes them wait for the current stream once per iteration, in the
    root's pre-forward (or for its post-optimizer event instead), and then
    lets each unit's all-gather copy-in read the sharded parameters without
    waiting for the current stream again (implicit prefetching,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``,
    ``_root_pre_forward``). A unit's H2D copies must therefore be waited for
    on these streams too, not only on the current stream (measured on 2
    H200s: without it, a unit's all-gather read its shard before its copy
    landed and the loss was NaN).
    """
    out: dict[int, torch.cuda.Stream] = {}
    for m in modules:
        for unit in fsdp_modules(m):
            ctx = getattr(unit._get_fsdp_state(), "_comm_ctx", None)  # pyright: ignore[reportCallIssue]  # FSDP2 private _get_fsdp_state
            for name in ("all_gather_copy_in_stream", "all_gather_stream"):
                stream = getattr(ctx, name, None)
                if stream is not None:
                    out.setdefault(id(stream), stream)
    return list(out.values())


def lazy_init_done(modules: list[nn.Module]) -> bool:
    """FSDP2 initialises lazily at the first forward (and may re-pad shards then): layer-wise
    schedules run only after it, when a unit's shards are left as they are."""
    for m in modules:
        for unit in fsdp_modules(m):
            if getattr(unit._get_fsdp_state(), "_is_root", None) is None:  # pyright: ignore[reportCallIssue]  # FSDP2 private _get_fsdp_state
                return False
    return True


def own_tensors(m: nn.Module) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]]:
    """``m``'s own registered parameters and buffers (``nn.Module._parameters`` / ``_buffers``: no walk, ``None``
    entries included)."""
    return m._parameters, m._buffers  # pyright: ignore[reportReturnType]  # torch types them as dict[str, Parameter | None]


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` views (``t._base``), ``None`` for a tensor that is no view."""
    return t._base if t._is_view() else None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.device == sb.device and sa.data_ptr() == sb.data_ptr()


def sharded_params(modules: list[nn.Module]) -> dict[int, object]:
    """``id()`` of each FSDP2 ``FSDPParam.sharded_param`` under ``modules`` -> its ``FSDPParam``: what
    :func:`repoint_sharded_data` looks its parameters up in (one walk of the trees)."""
    return {id(fp.sharded_param): fp for fp in _fsdp_params(modules) if hasattr(fp, "sharded_param")}


def repoint_sharded_data(modules: list[nn.Module], host_side: dict[int, torch.Tensor],
                         params: dict[int, object] | None = None) -> int:
    """Makes FSDP2's padded shard buffers view the storages their parameters came back on.

    [Note: FSDP2's shard buffer after a move]
    FSDP2 all-gathers a unit's parameters from each ``FSDPParam._sharded_param_data``,
    a 1D view of the padded storage the parameter's local shard is a prefix of. The
    ferry moves that storage itself (freed and re-allocated in place), so the view
    stays valid. But ``nn.Module._apply`` on a ``fully_shard``-ed module (any
    ``module.to(...)``, ``.cpu()``, ``.float()``) calls ``reset_sharded_param()``,
    which points ``_sharded_param_data`` at whatever the local shard is at that
    moment: while the state is offloaded, or reloading layer-wise, that is the host
    view of the pool (a same-device ``to("cpu")`` moves nothing, and verl's LoRA weight
    sync does exactly that in ``collect_lora_params``), and with an uneven shard a new
    padded host copy that replaces the local shard too. After the reload the
    parameter is on the device again, but FSDP2 would gather the stale host bytes:
    training went on from the weights of the offload, silently (found through verl
    0.9.1's LoRA actor: the second mini-batch after a weight sync differed from
    verl's own run; ``tests/cpu/test_fsdp2_module_to.py``). So every reload, whole or
    unit by unit, re-points each moved parameter's ``_sharded_param_data`` that views
    the host side it just left (its parked twin's local shard): a view of the padded
    size over the device storage, or, where that storage is too small for it,
    ``reset_sharded_param()``, FSDP2's own repair, now that the shard is on the device.
    A buffer over another device storage (``p._local_tensor.data = t``, a submodule's
    ``.to()``) is :func:`resync_sharded_data`'s.

    Args:
        modules: the plan's modules (their FSDP2 units are searched).
        host_side: ``id()`` of each DTensor parameter just given its device impl back ->
            the host local shard it had (``Parking.host_locals``).
        params: :func:`sharded_params` of ``modules``, where the caller keeps it for several calls (a
            layer-wise reload, once per group: a walk of every unit per group was its largest host
            cost inside the forward with LoRA's 2,300 modules); made here when ``None``.

    Returns:
        How many buffers were re-pointed (0 in the normal cycle).
    """
    n = 0
    if not host_side:
        return n
    if params is None:
        params = sharded_params(modules)
    for pid, host in host_side.items():
        fp = params.get(pid)
        data = getattr(fp, "_sharded_param_data", None)
        if fp is None or id(fp.sharded_param) != pid or data is None or not _same_storage(data, host):
            continue
        local = fp.sharded_param._local_tensor
        if _same_storage(data, local) or local.is_meta:
            continue
        numel = fp.padded_sharded_param_size.numel()
        storage = local.untyped_storage()
        if local.storage_offset() == 0 and local.is_contiguous() and \
                storage.nbytes() >= numel * local.element_size():
            fp._sharded_param_data = torch.empty(0, dtype=local.dtype, device=local.device).set_(
                storage, 0, (numel,), (1,))
        else:
            fp.reset_sharded_param()
        n += 1
    return n


def resync_sharded_data(modules: list[nn.Module]) -> int:
    """Makes each FSDP2 shard buffer left over an old storage view its parameter's again, as FSDP2 would.

    [Note: FSDP2's shard buffer left by a submodule's move]
    ``nn.Module._apply`` (``.to()``, ``.float()``) of a submodule that is not a unit of its own gives
    the parameters it holds new tensors, but only a unit's own ``_apply`` re-points its
    ``FSDPParam._sharded_param_data`` (``reset_sharded_param()``): the unit above keeps its buffers over
    the old storages, and all-gathers from them. verl's LoRA weight sync does this to the whole model
    below the root unit (``peft_model.base_model.model.to("cpu")``, then back: ``collect_lora_params``),
    so the root unit's embedding and LM head were left twice on the device. verl's own offload repairs
    it without knowing (``model.cpu()`` on the root unit runs FSDP2's repair); an offload that moved the
    parameters' storages and left the old ones to FSDP2 kept them allocated for good (933 MB with
    Qwen2.5-1.5B's tied embedding, every phase of every step after the first sync:
    ``benchmarks/results/verl_step_qwen2.5-1.5b_fsdp2-lora-compute-rich_h100x1_2026-12-07_580eb2a.json``,
    ``left_behind_bytes_per_step``). So a new plan, made while the state is resident, first calls
    ``reset_sharded_param()`` on each parameter whose buffer views another storage on the same device
    (nothing in a ferry's host pool: that shard is offloaded, not stale), as the unit's own ``_apply`` would have
    (``tests/cpu/test_fsdp2_module_to.py``); so does a reload that reconciles a move made while offloaded
    (``_ferry/machine.py``: until the next plan FSDP2 gathered the bytes of the offload,
    ``tests/cpu/test_submodule_move_while_offloaded.py``). The rule is a framework's own load's
    (``model.to(device)`` on the root unit): FSDP2 gathers what the parameters hold, a
    ``p._local_tensor.data = t`` included.

    Args:
        modules: the targets' modules (their FSDP2 units are searched).

    Returns:
        How many buffers were re-pointed (0 unless a submodule was moved).
    """
    n = 0
    for fp in _left_over_old_storages(modules):
        fp.reset_sharded_param()
        n += 1
    return n


def sharded_data_left_behind(modules: list[nn.Module]) -> bool:
    """Whether a submodule's move left an FSDP2 shard buffer over an old storage (what
    :func:`resync_sharded_data` would re-point): one walk, nothing changed."""
    return next(_left_over_old_storages(modules), None) is not None


def _left_over_old_storages(modules: list[nn.Module]):
    for fp in _fsdp_params(modules):
        data = getattr(fp, "_sharded_param_data", None)
        local = getattr(getattr(fp, "sharded_param", None), "_local_tensor", None)
        if not isinstance(data, torch.Tensor) or not isinstance(local, torch.Tensor) or local.is_meta:
            continue
        if data.device != local.device or _same_storage(data, local) or data.untyped_storage().nbytes() == 0:
            continue
        if in_host_pool(local.untyped_storage().data_ptr()) or in_host_pool(data.untyped_storage().data_ptr()):
            continue
        yield fp


def _fsdp_params(modules: list[nn.Module]):
    """Every FSDP2 ``FSDPParam`` of the units under ``modules`` (none for a module without FSDP2 state)."""
    for m in modules:
        for unit in fsdp_modules(m):
            try:
                state = unit._get_fsdp_state()  # pyright: ignore[reportCallIssue]  # FSDP2 private _get_fsdp_state
            except AttributeError:
                continue
            for group in param_groups(state):
                yield from getattr(group, "fsdp_params", ()) or ()


def sharded_storages(module: nn.Module) -> list[torch.UntypedStorage]:
    """The storages of every FSDP2 unit's sharded parameters under ``module`` (``FSDPParam.sharded_param``'s
    local tensor and ``_sharded_param_data``): reachable from ``module.parameters()`` only while resharded."""
    out: list[torch.UntypedStorage] = []
    for fp in _fsdp_params([module]):
        for t in (getattr(getattr(fp, "sharded_param", None), "_local_tensor", None),
                  getattr(fp, "_sharded_param_data", None)):
            if isinstance(t, torch.Tensor):
                out.append(t.untyped_storage())
    return out


def released(t: object) -> bool:
    """A non-empty tensor whose storage an offload released (``resize_(0)``)."""
    return isinstance(t, torch.Tensor) and t.numel() > 0 and t.untyped_storage().nbytes() == 0


def rehome_sharded_data(modules: Sequence[nn.Module]) -> None:
    """Points each FSDP2 shard buffer whose device storage an offload released at its parameter's host shard
    (``reset_sharded_param()``): what a dropped ferry leaves ([Note: a ferry dropped while offloaded] in
    ``_ferry/guards.py``), so the module runs on the host and ``model.to(device)`` copies the host bytes."""
    with torch.no_grad():
        for fp in _fsdp_params(list(modules)):
            local = getattr(getattr(fp, "sharded_param", None), "_local_tensor", None)
            if released(getattr(fp, "_sharded_param_data", None)) and isinstance(local, torch.Tensor) \
                    and local.device.type == "cpu":
                fp.reset_sharded_param()


def fsdp2_offloads_params(module: nn.Module) -> bool:
    """Whether an FSDP2 unit under ``module`` has a ``CPUOffloadPolicy`` (FSDP2 keeps its shards on the host)."""
    units = fsdp_modules(module)
    if not units:
        return False
    from torch.distributed.fsdp import CPUOffloadPolicy

    groups = [g for unit in units for g in param_groups(unit._get_fsdp_state())]  # pyright: ignore[reportCallIssue]
    return any(isinstance(getattr(g, "offload_policy", None), CPUOffloadPolicy) for g in groups)


def idle_and_resharded(model: nn.Module) -> None:
    """Every FSDP2 param group under ``model`` set IDLE, then ``model.reshard()`` (what verl's VeOmni and
    Automodel helpers do before moving a model)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    for module in model.modules():
        for group in param_groups(_get_module_fsdp_state(module)):  # none for a module outside FSDP2
            group._training_state = TrainingState.IDLE
    if callable(getattr(model, "reshard", None)):
        model.reshard()  # pyright: ignore[reportCallIssue]  # FSDP2's reshard on an FSDPModule


@functools.cache
def _storage_object_refs() -> int:
    """What one Python storage object adds to a ``StorageImpl``'s use count (1 on torch 2.11-2.13),
    measured once on a tensor of one impl and its storage object."""
    t = torch.empty(1)
    return torch._C._storage_Use_Count(storage_key(t.untyped_storage())) - 1


def allocator_settings_set() -> str | None:
    """The caching allocator's settings string as torch last took it (``torch._C._accelerator_getAllocatorSettings``:
    the last one set at run time, or the environment's before any); ``None`` where torch does not tell it
    (torch < 2.13) or fails to."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is None:
        return None
    try:
        return get()
    except (RuntimeError, ValueError):  # a setting torch itself cannot parse: the environment decides
        return None


def storage_refs(storage: torch.UntypedStorage) -> int:
    """How many tensor impls (and other C++ owners) hold ``storage``'s ``StorageImpl``, the Python
    storage object ``storage`` not counted: see [Note: a storage shared with a tensor the ferry does
    not know] in ``holders.py``."""
    return torch._C._storage_Use_Count(storage_key(storage)) - _storage_object_refs()


def _base_refcount(view: torch.Tensor) -> int:
    base = view._base
    return sys.getrefcount(base)


@functools.cache
def _unheld_base_refcount() -> int:
    """``sys.getrefcount`` of a view's base that only the view (C++) holds, as :func:`_base_refcount` sees it."""
    return _base_refcount(torch.empty(2)[:1])


def base_held_by_python(view: torch.Tensor) -> bool:
    """Whether a view's ``_base`` is held by a Python reference (a user's variable), not only by its
    views' autograd metadata (C++): compared with a base made and dropped here."""
    return _base_refcount(view) > _unheld_base_refcount()


def fsdp_held(modules: list[nn.Module]) -> list[torch.Tensor]:
    """FSDP2's own tensors over its units' sharded storages, beside the parameters' local shards:
    each ``FSDPParam._sharded_param_data`` and the padded tensor it (and the local shard) views."""
    out: list[torch.Tensor] = []
    for fp in _fsdp_params(modules):
        data = getattr(fp, "_sharded_param_data", None)
        if not isinstance(data, torch.Tensor):
            continue
        out.append(data)
        if data._is_view() and data._base is not None:
            out.append(data._base)
        local = getattr(getattr(fp, "sharded_param", None), "_local_tensor", None)
        if isinstance(local, torch.Tensor) and local._is_view() and local._base is not None:
            out.append(local._base)
    return out


def versions(tensors: list[torch.Tensor]) -> list[object]:
    """Version counters (bumped by every in-place write) of tensors, DTensor local shards included:
    compare them with ``==`` only.

    A DTensor's in-place ops bump the outer counter (``zero_``, ``mul_``) or
    neither (the ``_foreach_`` ops, which optimizers use): both are read, and
    optimizer steps are caught apart (step pre-hooks). A DTensor's entry is the
    pair of counters and its local shard's ``id()``: FSDP2's ``module.to(...)``
    gives a unit a new local shard object over the same bytes, whose counter
    starts again at 0, so a sum of the two could come out equal after a write
    (a write after ``module.to()`` during a layer-wise reload was not copied
    again: ``tests/cpu/test_fsdp2_module_to.py``). Inference tensors have no counter: they count
    as 0 (callers that must see their writes exclude them).
    """
    out: list[object] = []
    for t in tensors:
        if t.is_inference():
            out.append(0)
            continue
        if type(t) not in _PLAIN:
            local = getattr(t, "_local_tensor", None)
            if local is not None:
                out.append((t._version, 0 if local.is_inference() else local._version, id(local)))
                continue
        out.append(t._version)
    return out
