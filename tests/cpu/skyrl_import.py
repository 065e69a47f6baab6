"""Importing the real SkyRL 0.4.0 on the test venv's Python 3.11 (SkyRL declares >=3.12).

SkyRL's FSDP code (``skyrl.backends.skyrl_train.distributed.fsdp_utils``) runs on 3.11, but the
package ``skyrl.backends``'s ``__init__`` imports the Tinker engine backend, whose pydantic models
use ``typing.TypedDict`` (pydantic refuses it before Python 3.12: ``PydanticUserError``). On
Python < 3.12, :func:`apply` registers ``skyrl.backends`` as the bare package it is on disk, its
``__init__`` (the Tinker backend) not run; every module under it is SkyRL's own installed file,
unchanged. On Python >= 3.12 it does nothing.

:func:`stub_flash_attn` lets ``fsdp_strategy`` (which imports ``flash_attn.bert_padding`` through
its model wrapper; flash-attn builds only with CUDA) import on a CPU machine: a module with the
two names, no code. Only in fresh processes: transformers sees ``flash_attn`` in ``sys.modules``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

FSDP_UTILS = "skyrl.backends.skyrl_train.distributed.fsdp_utils"
FSDP_STRATEGY = "skyrl.backends.skyrl_train.distributed.fsdp_strategy"


def apply(force: bool = False) -> None:
    """Makes ``skyrl.backends.*`` importable on Python < 3.12 (see the module docstring), or on any
    Python with ``force`` (``benchmarks/frameworks.py``, where the native import failed). Idempotent.

    Also usable as a Ray ``worker_process_setup_hook`` (``tests.cpu.skyrl_import.apply``).
    """
    if (sys.version_info >= (3, 12) and not force) or "skyrl.backends" in sys.modules:
        return
    spec = importlib.util.find_spec("skyrl")
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the import below fails with the real ImportError
    import skyrl

    path = os.path.join(list(spec.submodule_search_locations)[0], "backends")
    bare = importlib.machinery.ModuleSpec("skyrl.backends", None, is_package=True)
    bare.submodule_search_locations = [path]
    pkg = importlib.util.module_from_spec(bare)
    pkg.__path__ = [path]
    sys.modules["skyrl.backends"] = pkg
    skyrl.backends = pkg  # type: ignore[attr-defined]


def stub_flash_attn() -> None:
    """A ``flash_attn.bert_padding`` with ``pad_input`` / ``unpad_input`` (never called here)."""
    if "flash_attn" in sys.modules:
        return
    fa = types.ModuleType("flash_attn")
    fa.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    fa.__path__ = []
    bp = types.ModuleType("flash_attn.bert_padding")
    bp.pad_input = bp.unpad_input = None  # type: ignore[attr-defined]
    fa.bert_padding = bp  # type: ignore[attr-defined]
    sys.modules["flash_attn"], sys.modules["flash_attn.bert_padding"] = fa, bp


def import_fsdp_utils():
    """SkyRL's ``fsdp_utils`` module, or a skip naming why it cannot import (pytest)."""
    import pytest

    try:
        apply()
        return importlib.import_module(FSDP_UTILS)
    except Exception as e:  # ImportError, or SkyRL's own import-time errors
        pytest.skip(f"SkyRL's fsdp_utils cannot import: {type(e).__name__}: {e}", allow_module_level=True)
