"""Dock: state sets and other claimants of GPU memory, resident on demand under one budget.

In colocated RL the GPUs take turns: the rollout engine (weights and KV
cache), the reference model, the critic and the actor (parameters and
optimizer state). A :class:`Dock` holds every state set (one
:class:`~torchferry.Ferry` each) and every external claimant of GPU memory (a
rollout engine's KV cache: a byte count, or ``sleep``/``wake`` callbacks)
under one GPU budget in bytes, and moves state only when the budget needs it:

    dock = torchferry.Dock(budget_bytes=99 << 30)
    dock.add("actor_params", torchferry.Ferry(actor))
    dock.add("actor_opt", torchferry.Ferry(optimizer))
    dock.add("ref", torchferry.Ferry(ref))
    dock.add_claimant("rollout", kv_bytes, sleep=engine.sleep, wake=engine.wake_up)
    dock.reserve("critic", critic_bytes)  # kept on the device by its framework: counted, never moved
    dock.plan(["rollout", "ref", "actor_params", ("actor_params", "actor_opt")])
    with dock.use("ref"):
        dock.prefetch_next()          # the next phase's sets start coming in
        ref_log_prob = ref(batch)

It is a layer above ``Ferry`` (it calls ``offload()``, ``reload()``,
``residency``, ``state_bytes`` and :func:`torchferry.swap`, and ``measure``
reads the storages a ferry holds now, [Note: a set counts its bytes now]).
A ferry belongs to one dock at a time ([Note: one dock per ferry]).

The package is a stack, each module calling only those above it in this list:
``measure`` (a set's bytes as they are now, [Note: state loaded behind the
dock's back]), ``first_step`` (the bytes an optimizer's first step will
allocate, [Note: first-step state]), ``records`` (the stats, moves and
per-name records), ``schedule`` (the schedule, budget arithmetic and the
choice of victims, [Note: choosing victims]), ``mover`` (the :class:`Mover`
that carries out the moves and keeps their record, [Note: prefetch hand-off]),
``engine`` (the :class:`DockEngine`: the dock's state, accounting and
decisions, [Note: dock accounting], [Note: one dock per ferry], [Note:
prefetch], [Note: released without a copy]), ``admit`` (what a set must be to join: ``Dock.add``'s
checks) and ``dock`` (the public
:class:`Dock`, which checks the arguments and holds its engine as
``_engine``).
"""

from .dock import Dock
from .records import DockStats, Move
from .schedule import Schedule

__all__ = ["Dock", "DockStats", "Move", "Schedule"]
