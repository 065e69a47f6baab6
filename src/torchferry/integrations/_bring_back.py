"""``unpatch()`` with state offloaded: what an integration's replacements hold on the host comes back first.

[Note: unpatch() brings the state back]
Between an integration's ``patch()`` and ``unpatch()`` the framework's offload helpers (verl's
``offload_fsdp_model_to_cpu`` / ``offload_fsdp_optimizer``, SkyRL's ``offload_fsdp2_model_to_cpu``,
AReaL's ``FSDPEngine.offload``; verl's dock evicting a set) move state into a ferry's pool: the
targets' tensors become CPU tensors viewing the pool, guarded so that a forward or ``step()``
raises, and only the ferry can put the device storages back. The framework's own load helpers
cannot: verl's and SkyRL's ``model.to(device)`` / ``state[key].to(device_id)`` leave the ferry
offloaded and its guards in place (on the CPU the forward after verl's own load still raised),
AReaL's ``onload()`` resumes a torch_memory_saver that paused nothing. ``unpatch()`` used to
restore the originals anyway, silently, and the state was stranded in the pool.

So every ``unpatch()`` first brings back, with :func:`bring_back`, each ferry its replacements
made that is not resident (offloaded, its offload in flight, or a layer-wise reload under way),
synchronously (the copies are done when ``unpatch()`` returns, as after the frameworks' own
loads, which are synchronous or ordered on the caller's stream), and all or nothing: a reload
that fails (the device out of memory, the usual case) offloads again the ferries this call
brought back, restores nothing and raises ``RuntimeError`` naming the cause and what stays
offloaded; the integration stays patched, its helpers hold the state as before, and
``unpatch()`` may be called again once there is room. Only then are the originals restored,
and the ferries closed (their pools returned; a later ``patch()`` makes new ones), but those a
verl dock holds, which the dock keeps for a later ``patch(dock=...)`` of its budget
(``integrations.verl._dock_patch.DockPatch``). Bringing the state back, rather than refusing,
because ``unpatch()`` comes at teardown or to hand the state to the framework's own helpers, which
expect it resident between their own calls; refusing would leave the caller to reload through
the helpers it is removing. verl's ``unpatch(keep_offloaded=True)`` does neither, for a process
that switches to verl's own helpers for other models and patches again later (the turns of
``benchmarks/verl_actor.py``): the state waits in its ferries for that ``patch()``.
``tests/cpu/test_integration_verl.py`` (and the SkyRL, AReaL and verl dock tests) check both paths.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .._core._api.residency import Residency
from .._core._ferry.ferry import Ferry
from .._core._transfer.switch import whole_copies

__all__ = ["Held", "away", "bring_back"]


class Held(NamedTuple):
    """One ferry an integration's replacements made, and what it is for messages."""

    what: str
    """E.g. ``"model Mixed (1200 bytes)"``, ``"verl dock set engine0.params (...)"``."""
    ferry: Ferry


_AWAY = (Residency.D2H_IN_FLIGHT, Residency.HOST, Residency.PREFETCHING)


def away(ferry: Ferry) -> bool:
    """Whether some of ``ferry``'s state is in its pool, not on its device: offloaded (copies in
    flight or done), or a layer-wise reload under way."""
    return ferry.residency in _AWAY


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def bring_back(integration: str, held: Iterable[Held]) -> list[Held]:
    """Reloads every ferry of ``held`` that is :func:`away`, synchronously, all or nothing
    ([Note: unpatch() brings the state back]).

    Args:
        integration: the integration's name, as in ``torchferry.integrations.<integration>``.
        held: the ferries its replacements made (resident ones are skipped).

    Returns:
        Those brought back, in order.

    Raises:
        RuntimeError: a reload failed (the message names it, the cause and everything that stays
            offloaded); the ferries brought back before it were offloaded again, so every ferry
            is where it was (a layer-wise reload under way: offloaded).
    """
    todo = [h for h in held if away(h.ferry)]
    done: list[Held] = []
    for h in todo:
        try:
            with whole_copies():  # waited for at once: [Note: whole copies where the caller waits]
                h.ferry.reload().wait()
        except BaseException as err:
            undo = _offload_again(done)
            if not isinstance(err, Exception):  # Ctrl-C: as it is, after the undo
                raise
            left = [x.what for x in todo if away(x.ferry)]
            raise RuntimeError(
                f"torchferry.integrations.{integration}: unpatch() could not bring {h.what} back to "
                f"{h.ferry.device} ({_first_line(err)}); nothing was unpatched: {', '.join(left)} stay offloaded "
                f"in torchferry's pool, which the framework's own helpers cannot reload; free device memory and "
                f"call unpatch() again{undo}"
            ) from err
        done.append(h)
    return done


def _offload_again(done: list[Held]) -> str:
    """Offloads ``done`` again (the undo of a failed :func:`bring_back`); ``""``, or what could not be undone."""
    failed = []
    for h in reversed(done):
        try:
            with whole_copies():
                h.ferry.offload().wait()
        except Exception as err:  # noqa: BLE001  (the state is resident and intact: say so, go on)
            failed.append(f"{h.what} ({_first_line(err)})")
    if not failed:
        return ""
    return f" (offloading again what it had brought back failed for {', '.join(failed)}: they are on the device)"
