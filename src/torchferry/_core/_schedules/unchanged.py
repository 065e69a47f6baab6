"""Unchanged storages: an offload skips the D2H copy of a storage whose host copy is still exact.

[Note: unchanged storages]
After a reload the host pool still holds every storage's bytes. With
``Ferry(skip_unchanged=True)`` the next offload copies only the storages
written on the device since and releases the others without a copy (a frozen
base model, a reference model that is never trained). A write missed here
would be lost at the next reload, so the decision rests on a content hash of
each storage's bytes; cheaper host checks only send storages straight to the
copy, never past it:

1. Baseline: the hash of each eligible storage (some bytes, viewed by no
   ``.grad`` and no optimizer state: those are written every step) is taken
   where its device bytes are known to equal its slot's: on the current
   stream right after a plain reload's copies (before any later kernel), or,
   in a layer-wise reload, on the H2D stream right after the group's own
   copies (a write through an old view before the unit's forward is then a
   change, not part of the baseline). The version counters of the tensors
   viewing it, and of their parked host twins, are recorded when they become
   resident.
2. Pre-filter at the offload, on the host: a storage is copied without
   hashing when a tensor viewing it has a new version counter (in-place ops,
   ``copy_`` under ``no_grad``, ``load_state_dict``, BatchNorm statistics,
   optimizer steps on plain tensors, writes through views), when any
   optimizer stepped since the baseline and a tensor viewing it requires
   grad (a conservative rule for DTensors, whose ``_foreach_`` updates bump
   no counter), when its host twin's counter moved (an in-place write to a
   host tensor kept from an earlier offload, e.g. a ``state_dict()`` taken
   while offloaded: it wrote the slot), when it was copied early
   (``offload_during_forward``), and for all storages when the plan, the pool
   block or its views changed (``p.data = t``, a re-plan, ``release_host()``,
   ``share_memory_()`` on a slot: ``HostViews.intact``).
3. The hash again, for the survivors, after the current stream's pending
   work; one ``.tolist()`` brings the comparison back (the offload's only
   host sync). Equal: skipped. This is what sees the writes no counter does:
   through ``p.data``, ``_foreach_`` ops on DTensors, inference tensors,
   FSDP2's padded ``_sharded_param_data``, compiled graphs.

A baseline serves one offload: taken at a reload, consumed by the next
offload whatever it decides (an offload that fails copies everything next
time). Any failure to hash at a reload (no device memory) drops the baseline;
at an offload it copies everything.

The hash (``_schedules/hash``): the storage's 8-byte words (the tail, < 8 bytes, as
single values after them); two lanes each map word ``w`` at position ``p`` to
``mix(w + (p + 1) * G)``, where ``mix`` multiplies by an odd constant,
xor-shifts right, multiplies, xor-shifts right (the finalisers of SplitMix64
and of Murmur3, less their first xor-shift), and sum the results with wrapping
64-bit additions: 128 bits per storage. The right shifts fold high bits into
low ones (a flip of the sign bit of two float64s must not cancel in the
sums). Each step is a bijection of the word for a fixed position, so a change
confined to one word or tail byte always changes both sums: it is caught with
certainty. A change to several words goes unseen only if the per-word
differences sum to 0 modulo 2**64 in both lanes; modelling the mixed words as
independent uniform values, 2**-128 per storage and offload. It is not
cryptographic: a write crafted with knowledge of the constants can keep both
sums. On GPUs one Triton kernel hashes every storage of a call in one launch
(each byte read once: ~4 ms for 15 GB at 3.5 TB/s, against ~270 ms for the
copy it saves at 55 GB/s); elsewhere plain torch ops (some 50 bytes of memory
traffic per hashed byte, at most ``4 * HASH_PIECE`` of temporaries). A
baseline is compared only with a hash of its own kind.

Not seen: a write to the *host pool* between the reload and the offload that
bumps no counter (through ``.data`` of a kept host tensor; or through
``.data`` or a DTensor ``_foreach_`` op to a unit's host tensor during a
layer-wise reload, which that reload does not copy again either): a skipped
storage keeps those bytes where a full offload would overwrite them with the
device's. ``TORCHFERRY_VERIFY_SKIPS=1`` (tests) copies every storage judged
unchanged to a scratch buffer and compares it with its slot, raising on a
difference.

[Note: the reload's hash beside its copies]
A whole-set reload's baseline used to be one hash of every eligible storage on
the current stream after the reload's last copy: GPU time added to every
reload (6.2 GB of Qwen2.5-1.5B parameters: reload() 1.5-2 ms slower than
without ``skip_unchanged``, one H200). Now the reload records an event on the
H2D stream once at most 1/16 of its bytes (and at least 64 MiB) are left to
copy; the current stream waits for it and hashes the storages copied before
it, as a new baseline, while the tail is still copying (the hash reads device
memory at some 3 TB/s, the copy writes it at 55 GB/s: 15/16 of the bytes hash
in less time than the last 1/16 copies), then waits for the last copy and
hashes the rest. Both hashes run on the current stream before any kernel the
caller queues after ``reload()``, each after its storages' copies: the rule of
step 1 holds for every storage. The early hash's table goes up at the mark on
the H2D stream itself (``UnchangedStorages.stage``; kept with
``record_stream`` until the hash ran): put on the current stream, that small
copy waited behind the whole reload in the copy engine ([Note: switch
points]), and the early hash ran after the last copy anyway.

Measured at dc0385b (``benchmarks/frameworks.py``, one H200,
``benchmarks/results/frameworks_qwen2.5-1.5b_h200x1_2026-12-01_dc0385b.json``):
SkyRL's forward-only 1.5B model reloads in 0.117 s and a trained one in
0.119 s, against 0.114 s for SkyRL's own load; what is left over is not where
the hash runs, and is not found yet.

Swap: the outgoing ferry's skipped storages are released at once (no copy
reads them; ``ReleaseSchedule.hold``). The incoming ferry of a swap with
``gpu_budget_bytes`` takes no baseline (its hash temporaries would be
allocated beyond the budget, while the outgoing state is still held): its
next offload copies everything.

[Note: a baseline carried across a re-plan]
A baseline belongs to one plan and its host views, and a re-plan made a new
plan: the loop order ``zero_grad(set_to_none=True)`` / forward / backward /
``step()`` / ``offload()`` drops the last step's gradients while resident, the
ferry forgets its plan to free them ([Note: state dropped while resident] in
``_ferry/watch.py``), and every offload after it copied every storage, a
frozen base included (AReaL's ``train_batch`` zeroes its gradients first). The
skip rests on one fact: the slot still holds the bytes hashed at the baseline,
and the device's bytes hash alike now. Neither needs the old plan: a slot is
its pool block (``HostPool.block_id``, a new number for each block), address
and size. So a re-plan keeps, per hashed storage, its slot and hash row
(:meth:`UnchangedStorages.carry`), and the plan's host twins stay watched from
their versions at the baseline ([Note: host tensors of earlier plans]); the
next offload hashes each eligible storage of its new plan whose slot is one of
those, over which no watched twin wrote and no tensor of which requires grad
(a conservative rule: those train), and skips it where the hashes are equal. Whatever storage now sits in
that slot, equal hashes mean its bytes are already there. A new baseline, an
offload (it consumes what was carried), an armed ``offload_during_forward()``
(its copies write slots) or a forgotten baseline drops it.

[Note: host tensors of earlier plans]
A host tensor kept from an offload (``state_dict()`` while offloaded) views
its slot through the host impl its plan's twin parks; a write to it bumps that
twin's version counter, which the baseline checks. A re-plan drops the twins
and the next baseline watches the new plan's only, so a tensor kept under an
older plan could write a slot unseen and its bytes were skipped
(``kept.add_(1)`` two offloads later came back in the weight). So the twins of
every plan a ferry drops are kept, with their slot's pool block and byte range
(:meth:`UnchangedStorages.retire`), while that block stays; their versions are
read at each new baseline, and an offload copies any storage whose slot
overlaps one whose twin was written since. A retired twin nothing else views
any more (no caller kept a tensor of it) is let go at the next offload. The
pool taking a new block or being given back (``release_host()``) drops them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable

import torch

from .._state.fsdp import local_of, storage_refs, versions
from .._state.host_blocks import in_host_pool
from .hash import hash_kind, hash_storages, stage_rows
from .._host.layout import HostViews
from .._state.plan import Plan
from .skip_check import Carried, Retired, Rules, hashed_alike, rules_of
from .step_hooks import GlobalStepHook

__all__ = ["UnchangedStorages"]

logger = logging.getLogger("torchferry")



# Any optimizer step marks the trainable storages of every baseline as written.
_STEPS = GlobalStepHook()


class UnchangedStorages:
    """One ferry's ``skip_unchanged`` (see [Note: unchanged storages]): hashes taken where the
    device bytes equal the pool's, and version counters, used by the next offload.

    The one object handed to whoever copies (the whole-set reload and offload, a layer-wise
    reload's groups, an offload during forward); ``None`` where ``skip_unchanged`` is off. What it
    decides is one set of storage indices, ``unchanged``: their pool slots already hold their
    bytes, so the offload copies them not at all.

    Args:
        hash_choice: ``CoreSettings.hash``, the hash's implementation (``hash.hash_kind``).
        verify: ``CoreSettings.verify_skips`` (tests): compare every storage judged unchanged with its pool
            slot (``skip_check.hashed_alike``).
    """

    def __init__(self, *, hash_choice: str = "auto", verify: bool = False) -> None:
        self._hash, self._verify = hash_choice, verify
        self._rules: Rules | None = None
        self._baseline: set[int] = set()  # storage indices holding a baseline hash now
        ref = weakref.ref(self)
        self._step_key = id(self)
        self._on_step = lambda: (me := ref()) is not None and me._stepped()
        weakref.finalize(self, _STEPS.discard, self._step_key)
        self._retired: list[Retired] = []
        self.forget()

    def forget(self, keep_carried: bool = False) -> None:
        """Drops the baseline (a re-plan, a reconcile, the host views dropped, an offload), and what a
        re-plan carried unless ``keep_carried``."""
        if not keep_carried:
            self._carried: Carried | None = None
        self._plan: Plan | None = None
        self._views: HostViews | None = None
        self._kind: str | None = None  # the hash that took the baseline: compared with itself only
        self._hashes: torch.Tensor | None = None  # [storages, 2] int64 on the device
        self._versions: dict[int, object] = {}  # tensor index -> version at the baseline
        self._host_versions: dict[int, object] = {}  # tensor index -> its host twin's version then
        self._step_seen = False  # an optimizer stepped since the baseline
        self._baseline.clear()
        _STEPS.discard(self._step_key)

    def drop_rules(self, keep_carried: bool = False) -> None:
        """Also drops the per-plan tables (they hold the plan and the host views)."""
        self.forget(keep_carried)
        self._rules = None

    def retire(self, plan: Plan, twins: list[torch.Tensor | None], block: int) -> None:
        """Keeps the host twins of ``plan``, which the ferry drops, with their slots' ranges in pool block
        ``block`` ([Note: host tensors of earlier plans]); the twins of the baseline's plan are read as
        they were at the baseline, so a write since then is seen."""
        # Only twins over the pool watch a slot: a tensor assigned while offloaded (``p.data = t``,
        # a submodule's ``.to()``) leaves its twin over the assigned bytes after the reconcile, and
        # keeping that twin kept those bytes allocated at every later offload (a holder the
        # ferry does not know: tests/cpu/test_skip_unchanged_assigned_while_offloaded.py).
        held = [(ti, t) for ti, t in enumerate(twins) if t is not None and local_of(t).untyped_storage().nbytes()
                and in_host_pool(local_of(t).untyped_storage().data_ptr())]
        now = versions([t for _, t in held]) if held else []
        at_baseline = self._host_versions if plan is self._plan else {}
        for (ti, t), v in zip(held, now, strict=True):
            st = local_of(t).untyped_storage()
            self._retired.append(Retired(t, block, st.data_ptr(), st.data_ptr() + st.nbytes(), at_baseline.get(ti, v)))

    def drop_retired(self) -> None:
        """Lets the retired twins go (the pool's block is given back or replaced)."""
        self._retired = []

    def _written_retired(self, block: int) -> list[tuple[int, int]]:
        """The slot ranges of ``block`` a retired twin wrote since it was last read; lets go of the twins
        nothing else views."""
        keep, written = [], []
        now = versions([r.twin for r in self._retired]) if self._retired else []
        for r, v in zip(self._retired, now, strict=True):
            if r.block == block and v != r.seen:
                written.append((r.lo, r.hi))
            if storage_refs(local_of(r.twin).untyped_storage()) > 1:  # a tensor besides the twin views it
                keep.append(r)
        self._retired = keep
        return written

    def _refresh_retired(self) -> None:
        """A new baseline: what retired twins wrote before it is in the device's bytes now."""
        if self._retired:
            now = versions([r.twin for r in self._retired])
            self._retired = [r._replace(seen=v) for r, v in zip(self._retired, now, strict=True)]

    def drop_carried(self) -> None:
        """Drops what a re-plan carried (the pool is about to take a new block)."""
        self._carried = None

    def carry(self) -> None:
        """Keeps the baseline for the offload after a re-plan ([Note: a baseline carried across a
        re-plan]): per hashed storage, its slot and hash row. Call it before the plan's host views go,
        and :meth:`retire` its twins with it (they watch the slots)."""
        plan, views, hashes, kind = self._plan, self._views, self._hashes, self._kind
        if plan is None or views is None or hashes is None or kind is None or not self._baseline:
            return
        if not views.intact():
            return
        rules = self._rules_for(plan, views)
        slots = {(views.block, views.slots[si].data_ptr(), plan.nbytes[si]): si for si in sorted(self._baseline)
                 if all(ti in self._host_versions for ti in rules.members[si])}  # twins' versions recorded
        if slots:
            self._carried = Carried(kind, hashes, slots)

    def holds(self, si: int) -> bool:
        """Whether storage ``si`` holds a baseline hash now (an offload during forward leaves it to
        the offload's hash instead of copying it early)."""
        return si in self._baseline

    def reloaded(self, plan: Plan, views: HostViews, sources: list[torch.Tensor], host_versions: list[object],
                 early: list[int] | None = None) -> None:
        """Takes a new baseline after a whole-set reload: the current stream waited for its copies
        and no kernel was queued since. ``host_versions``: per ``plan.tensors`` entry, its host
        twin's version counter. ``early``: the storages :meth:`copied_in` hashed already, as a new
        baseline, while the rest were still copying (see [Note: the reload's hash beside its
        copies]); the others are hashed now. Never raises (as :meth:`copied_in`)."""
        if early is None:
            self.copied_in(plan, views, sources)
        elif plan is self._plan and views is self._views:  # else the early hash failed: no baseline
            done = set(early)
            self.copied_in(plan, views, sources, [si for si in range(len(plan.storages)) if si not in done],
                           fresh=False)
        self.resident(plan, views, host_versions)

    def _stepped(self) -> None:
        self._step_seen = True

    def _rules_for(self, plan: Plan, views: HostViews) -> Rules:
        if self._rules is None or self._rules.plan is not plan or self._rules.views is not views:
            self._rules = rules_of(plan, views)
        return self._rules

    def _begin(self, plan: Plan, views: HostViews, fresh: bool) -> None:
        if fresh or plan is not self._plan or views is not self._views:
            self.forget()
            self._refresh_retired()
            self._plan, self._views = plan, views
            self._kind = hash_kind(plan.device, self._hash)
            self._hashes = torch.empty(len(plan.storages), 2, dtype=torch.int64, device=plan.device)
            _STEPS.add(self._step_key, self._on_step)

    @torch.inference_mode(False)
    def stage_rows(self, plan: Plan, views: HostViews) -> dict[int, tuple[int, ...]] | None:
        """What a reload uploads at its mark for a later :meth:`copied_in` of the storages copied
        before it (``issue_h2d``'s ``mark.rows``, per eligible storage; [Note: the reload's hash beside
        its copies]): uploaded on the H2D stream, in its order, so the upload does not wait behind the
        bulk copies as it would on the current stream. ``None``: nothing to upload (the torch ops), or
        any error (that hash then uploads its own)."""
        try:
            rules = self._rules_for(plan, views)
            todo = [si for si in range(len(plan.storages)) if rules.eligible[si]]
            return stage_rows(hash_kind(plan.device, self._hash), todo, plan.nbytes)
        except Exception:
            logger.debug("torchferry: could not stage the hash's table", exc_info=True)
            return None

    @torch.inference_mode(False)  # the hooks of a layer-wise reload may run in inference mode
    def copied_in(self, plan: Plan, views: HostViews, sources: list[torch.Tensor],
                  storages: Iterable[int] | None = None, *, fresh: bool | None = None,
                  staged: tuple[list[int], torch.Tensor | None] | None = None) -> None:
        """Hashes storages whose device bytes equal their slots now (all of ``plan`` if
        ``storages`` is ``None``), on the current stream: right after their H2D copies on the
        same stream, or after the current stream waited for them. ``fresh`` (default: whether
        ``storages`` is ``None``) starts a new baseline; otherwise they join the one under way.
        ``staged``: what :meth:`stage` returned for these ``storages``.

        Never raises: on any error (the hash's temporaries out of device memory) the baseline is
        dropped and the next offload copies everything; the reload itself is complete.
        """
        try:
            self._begin(plan, views, storages is None if fresh is None else fresh)
            rules = self._rules_for(plan, views)
            if staged is not None and staged[1] is not None and self._kind == hash_kind(plan.device, self._hash):
                todo, table = staged
            else:
                todo, table = [si for si in (range(len(plan.storages)) if storages is None else storages)
                               if rules.eligible[si]], None
            hash_storages(self._kind, self._hashes, todo, sources, views.chunks, rules.packed_at, table)  # pyright: ignore[reportArgumentType]  # _kind, _hashes and the base are set by _begin() before any hash
            if table is not None:  # made on the H2D stream, read here: not reused before the hash ran
                table.record_stream(torch.cuda.current_stream(table.device))
            self._baseline.update(todo)
        except Exception:
            self.forget()
            logger.warning("torchferry: could not hash the reloaded state; the next offload copies all of it",
                           exc_info=True)

    def resident(self, plan: Plan, views: HostViews, host_versions: list[object],
                 tensors: Iterable[int] | None = None) -> None:
        """Records the version counters of ``tensors`` (all of ``plan``'s if ``None``), now resident,
        and ``host_versions``, their host twins' (same order)."""
        if plan is not self._plan or views is not self._views:
            return  # no baseline to go with them
        ts = list(range(len(plan.tensors)) if tensors is None else tensors)
        self._versions.update(zip(ts, versions([plan.tensors[i].tensor for i in ts]), strict=False))
        self._host_versions.update(zip(ts, host_versions, strict=False))

    @torch.inference_mode(False)
    def take(self, plan: Plan, views: HostViews, sources: list[torch.Tensor], host_versions: list[object],
             rewritten: Iterable[int] = ()) -> set[int]:
        """Storage indices whose pool slots still hold their exact bytes (consumes the baseline).

        Args:
            plan, views, sources: what the offload moves, its host views, its device views.
            host_versions: per ``plan.tensors`` entry, its host twin's version counter now.
            rewritten: storages whose slots were written since the baseline (early copies).

        Raises:
            RuntimeError: in verify mode, a storage judged unchanged differs from its slot.
        """
        hashed, base, kind = set(self._baseline), self._hashes, self._kind
        recorded, host_recorded, stepped = self._versions, self._host_versions, self._step_seen
        valid = plan is self._plan and views is self._views and views.intact()
        carried = self._carried
        self.forget()
        if not valid and carried is not None and views.intact():
            return self._take_carried(carried, plan, views, sources, set(rewritten))
        if not valid or not hashed:
            return set()
        rules = self._rules_for(plan, views)
        now = versions([r.tensor for r in plan.tensors])
        rewritten = set(rewritten)
        trained = {r.storage_index for r in plan.tensors if r.tensor.requires_grad} if stepped else set()
        cand = [si for si in sorted(hashed) if si not in rewritten and si not in trained
                and all(recorded.get(ti) == now[ti] and host_recorded.get(ti) == host_versions[ti]
                        for ti in rules.members[si])]
        return hashed_alike(kind, base, cand, cand, plan, views, sources, rules,  # pyright: ignore[reportArgumentType]  # _kind, _hashes and the base are set by _begin() before any hash
                            self._written_retired(views.block), hash_storages, verify=self._verify)


    def _take_carried(self, carried: Carried, plan: Plan, views: HostViews, sources: list[torch.Tensor],
                      rewritten: set[int]) -> set[int]:
        """:meth:`take` for a plan made after the baseline: the storages whose slot a re-plan carried
        ([Note: a baseline carried across a re-plan])."""
        if carried.kind != hash_kind(plan.device, self._hash):
            return set()
        rules = self._rules_for(plan, views)
        cand, rows = [], []
        for si in range(len(plan.storages)):
            if not rules.eligible[si] or si in rewritten:
                continue
            if any(plan.tensors[ti].tensor.requires_grad for ti in rules.members[si]):
                continue
            row = carried.slots.get((views.block, views.slots[si].data_ptr(), plan.nbytes[si]))
            if row is not None:  # a write through the slot's twins since the baseline: _written_retired
                cand.append(si)
                rows.append(row)
        return hashed_alike(carried.kind, carried.hashes, rows, cand, plan, views, sources, rules,
                            self._written_retired(views.block), hash_storages, verify=self._verify)
