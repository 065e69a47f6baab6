"""torchferry for AReaL 1.0.4: ``FSDPEngine.offload()`` / ``onload()`` through ferries, in one line, in the process
that runs an AReaL FSDP engine (the trainer script under AReaL's SPMD launchers; each worker process under its
single-controller schedulers)::

    import torchferry.integrations.areal as tf_areal
    tf_areal.patch()     # FSDPEngine.offload / onload now go through torchferry
    tf_areal.unpatch()   # offloaded engines back on the device; AReaL's own methods again

What they do: :mod:`._patch` and ``docs/integrations.md``. areal is imported by :func:`patch`, not by this package.
"""

from ._patch import ferry_for, is_patched, patch, unpatch

__all__ = ["ferry_for", "is_patched", "patch", "unpatch"]
