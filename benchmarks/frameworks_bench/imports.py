"""The frameworks' code made importable here: SkyRL's FSDP helpers, the Ray stand-in, AReaL."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import sys

from frameworks_bench.common import FSDP_UTILS, HERE, ROOT, _error


# --------------------------------------------------------------------------------------------- imports
def import_skyrl_fsdp_utils():
    """SkyRL's ``fsdp_utils`` and how it was imported.

    Natively first (Python >= 3.12: ``skyrl.backends.__init__`` imports the Tinker engine backend,
    pydantic and cloudpathlib among its needs). Where that fails (Python 3.11: pydantic refuses
    the backend's ``typing.TypedDict``), ``skyrl.backends`` is registered as the bare package it is
    on disk, its ``__init__`` not run; every module under it is SkyRL's own file.
    """
    try:
        return importlib.import_module(FSDP_UTILS), "native"
    except Exception as e:  # SkyRL's own import-time errors, or an ImportError
        first = _error(e)
    for name in [n for n in sys.modules if n == "skyrl.backends" or n.startswith("skyrl.backends.")]:
        del sys.modules[name]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.cpu.skyrl_import import apply  # the CPU tests' shim: skyrl.backends as a bare package

    if importlib.util.find_spec("skyrl") is None:
        raise ImportError(f"skyrl is not installed ({first})")
    apply(force=True)
    module = importlib.import_module(FSDP_UTILS)
    return module, (f"skyrl.backends registered bare (its __init__, the Tinker engine backend, not run); "
                    f"the native import failed: {first[:300]}")


def use_ray_stub_if_needed() -> bool:
    """``benchmarks/verl_raystub`` on sys.path when ray does not import (AReaL's modules import it at
    module level; nothing here uses it); whether the stand-in is used."""
    try:
        import ray
    except ImportError:
        for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
            del sys.modules[name]
        stub = str(HERE / "verl_raystub")
        if stub not in sys.path:
            sys.path.insert(0, stub)  # only where ray itself did not import
        import ray
    return bool(getattr(ray, "STUB", False))


def import_areal():
    stub = use_ray_stub_if_needed()
    module = importlib.import_module("areal.engine.fsdp_engine")
    return module, stub
