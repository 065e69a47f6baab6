"""Replacing a framework's functions or a class's methods by name, checked first and undone exactly ([Note:
replacements remember their originals] in ``docs/integrations.md``): what in a :class:`HelperSet`, how in a
:class:`Patcher`."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType

__all__ = ["HelperSet", "Patcher", "routed"]

Replacements = Callable[[ModuleType, Mapping[str, Callable]], Mapping[str, Callable]]
"""``(module, {name: framework's original}) -> {name: replacement}``, one per name."""


@dataclass(frozen=True, kw_only=True)
class HelperSet:
    """What one integration replaces in one module or class: the only part that differs between frameworks."""

    integration: str  # as in torchferry.integrations.<integration> (error messages)
    framework: str  # the framework as a user knows it ("verl", "AReaL"), for error messages
    module: str  # the module defining the functions (or the class), e.g. "verl.utils.fsdp_utils"
    package: str  # every module of it holding a function by name gets the replacement; also for error messages
    helpers: Mapping[str, tuple[str, ...]]  # name -> the parameter names it must have for the replacement to fit
    replacements: Replacements
    cls: str | None = None  # a class of module whose methods helpers names (replaced on the class), or None
    call_sites: tuple[str, ...] = ()  # modules binding the functions by name, imported by patch() when they can
    requires: tuple[str, ...] = ()
    """Other attributes the replacements use, dotted from ``module`` (``"dist"``, ``"FSDPEngine._ensure_ready"``)."""
    catch: tuple[type[BaseException], ...] = (ImportError,)  # what importing module may raise: "not importable"

    def __post_init__(self) -> None:
        object.__setattr__(self, "helpers", MappingProxyType(dict(self.helpers)))  # a table, read only

    def error(self, what: str) -> str:
        return f"torchferry.integrations.{self.integration}: {what}"

    @property
    def key(self) -> str:
        """Identifies the set in its integration's patch state: two sets of one module name different functions."""
        return f"{self.module}:{self.cls}:{','.join(self.helpers)}"

    @property
    def owner(self) -> str:
        """Where the names live, for messages: ``module`` or ``module.Class``."""
        return self.module if self.cls is None else f"{self.module}.{self.cls}"


def routed(public: Callable, call: Callable) -> Callable:
    """``call`` (a replacement's own function, made for it) under the name and docstring of torchferry's
    ``public`` helper (``__wrapped__``: ``public``)."""
    return functools.wraps(public)(call)


class Patcher:
    """``patch()`` / ``unpatch()`` for one :class:`HelperSet`; the integration's patch state holds it."""

    def __init__(self, helper_set: HelperSet) -> None:
        self.helper_set = helper_set
        # (module name or class, attribute, original) for every attribute patch() replaced, in order.
        self._patched: list[tuple[str | type, str, object]] = []

    def names(self) -> list[str]:
        """The ``module.attribute`` names the last :meth:`patch` replaced (empty when not patched)."""
        return [f"{o.__module__}.{o.__qualname__}.{a}" if isinstance(o, type) else f"{o}.{a}"
                for o, a, _ in self._patched]

    def check(self) -> tuple[ModuleType, object]:
        """Imports the module and checks the names, changing nothing; returns the module and the names' owner.

        Raises:
            RuntimeError: the framework is not importable, a name or required attribute is missing, or a
                function has other parameters than ``HelperSet.helpers`` names.
        """
        hs = self.helper_set
        try:
            module = importlib.import_module(hs.module)
        except hs.catch as e:
            raise RuntimeError(hs.error(f"{hs.package} is not importable ({type(e).__name__}: {e})")) from e
        owner: object = module if hs.cls is None else getattr(module, hs.cls, None)
        if not isinstance(owner, (ModuleType, type)):
            raise RuntimeError(hs.error(f"{hs.owner} is missing; {hs.framework} changed"))
        for name, params in hs.helpers.items():
            fn = getattr(owner, name, None) if hs.cls is None else owner.__dict__.get(name)
            if fn is None or (hs.cls is not None and not inspect.isfunction(fn)):
                raise RuntimeError(hs.error(f"{hs.owner}.{name} is missing; {hs.framework} changed"))
            got = tuple(inspect.signature(fn).parameters)
            if got != params:
                raise RuntimeError(hs.error(f"{hs.owner}.{name}{got} does not have the parameters {params} this "
                                            f"integration was written for; {hs.framework} changed"))
        for path in hs.requires:
            obj: object = module
            for part in path.split("."):
                obj = getattr(obj, part, None)
            if obj is None or ("." in path and not callable(obj)):
                raise RuntimeError(hs.error(f"{hs.module}.{path} is missing; {hs.framework} changed"))
        return module, owner

    def patch(self, *, import_call_sites: bool = True) -> list[str]:
        """Replaces the names on the class (so on its subclasses) or wherever a module of the package holds the
        original (``call_sites`` imported first, with ``import_call_sites``); returns them. Idempotent.

        Raises:
            RuntimeError: as :meth:`check`; nothing is replaced then.
        """
        if self._patched:
            return self.names()
        module, owner = self.check()
        hs = self.helper_set
        originals = {name: getattr(owner, name) if hs.cls is None else owner.__dict__[name] for name in hs.helpers}
        built = hs.replacements(module, originals)
        new = {name: built[name] for name in hs.helpers}
        for name, fn in new.items():  # [Note: replacements remember their originals]
            fn.__torchferry_original__ = originals[name]  # type: ignore[attr-defined]
            fn.__torchferry_integration__ = hs.integration  # type: ignore[attr-defined]
        if isinstance(owner, type):
            for name, fn in new.items():
                self._patched.append((owner, name, originals[name]))
                setattr(owner, name, fn)
            return self.names()
        for mod_name in hs.call_sites if import_call_sites else ():
            with contextlib.suppress(Exception):  # an optional call site whose own dependencies are missing
                importlib.import_module(mod_name)
        for mod_name, mod in self._package_modules():
            for name, orig in originals.items():
                if getattr(mod, name, None) is orig:
                    setattr(mod, name, new[name])
                    self._patched.append((mod_name, name, orig))
        return self.names()

    def unpatch(self) -> None:
        """Puts the framework's own objects back, also in modules imported after :meth:`patch` ([Note:
        replacements remember their originals]). Idempotent."""
        while self._patched:
            where, name, orig = self._patched.pop()
            target = where if isinstance(where, type) else sys.modules.get(where)
            if target is not None:
                setattr(target, name, orig)
        if self.helper_set.cls is not None:
            return
        tag = self.helper_set.integration
        for _, mod in self._package_modules():
            for name in self.helper_set.helpers:
                fn = getattr(mod, name, None)
                original = getattr(fn, "__torchferry_original__", None)
                if original is not None and getattr(fn, "__torchferry_integration__", tag) == tag:
                    setattr(mod, name, original)

    def _package_modules(self) -> list[tuple[str, ModuleType]]:
        pkg = self.helper_set.package
        return [(n, m) for n, m in list(sys.modules.items()) if m is not None and (n == pkg or n.startswith(pkg + "."))]
