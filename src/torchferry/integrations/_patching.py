"""Replacing a framework's offload helpers by name, checked first and undone exactly.

The machinery behind every ``torchferry.integrations.<name>.patch()``: an
integration names its framework's helper module, the package whose modules
may have bound the helpers by name (``from <module> import <helper>``), the
helpers with the parameter names the replacements were written for, and a
function that builds the replacements from the framework's originals. That
declaration is a :class:`HelperSet`; a :class:`Patcher` over it does the rest,
the same way for every framework:

* ``patch()`` imports the helper module, checks every helper's parameters
  (and any other attribute the replacements use) before touching anything,
  then replaces each helper wherever a module of the package holds the
  original object: the helper module itself and every module that bound it
  by name. It is idempotent.
* ``unpatch()`` puts the exact original function objects back, also in
  modules of the package imported after ``patch()`` (which bound the
  replacements by their own ``from ... import``).

[Note: replacements remember their originals]
Each replacement is a fresh wrapper (``functools.wraps`` of the torchferry
helper, so ``__wrapped__`` is that helper) carrying
``__torchferry_original__`` (the framework's function it replaced) and
``__torchferry_integration__`` (which integration made it). ``unpatch()``
restores from the first what ``patch()`` did not record itself: a module
imported after ``patch()`` binds the wrapper, not the original, and without
the tag would keep torchferry's helper after ``unpatch()`` (the late-import
report in ``tests/cpu/test_integration_verl.py``). The second keeps one
integration's ``unpatch()`` from restoring another's names.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

__all__ = ["ACTIVE", "HelperSet", "Patcher"]

ACTIVE: contextvars.ContextVar[str | None] = contextvars.ContextVar("torchferry_integration", default=None)
"""The integration whose replacement is running (``"verl"``, ``"skyrl"``; set by the wrappers
:class:`Patcher` installs, ``None`` outside them): whose ``patch()`` settings the shared helpers
read ([Note: each integration's settings] in ``integrations._helpers``)."""

Replacements = Callable[[ModuleType, Mapping[str, Callable]], Mapping[str, Callable]]
"""``(helper module, {name: framework's original}) -> {name: replacement}``, one per helper."""


@dataclass(frozen=True, kw_only=True)
class HelperSet:
    """What one integration replaces: the only part that differs between frameworks."""

    integration: str
    """The integration's name, as in ``torchferry.integrations.<integration>`` (error messages)."""
    framework: str
    """The framework as a user knows it (``"verl"``, ``"skyrl"``), for error messages."""
    module: str
    """The module defining the helpers, e.g. ``"verl.utils.fsdp_utils"``."""
    package: str
    """Every module of this package (``package`` or ``package.*``) that holds a helper by name
    gets the replacement."""
    helpers: Mapping[str, tuple[str, ...]]
    """helper name -> the parameter names it must have for the replacement to fit."""
    replacements: Replacements
    """Builds the replacements from the helper module and the originals (see :data:`Replacements`)."""
    call_sites: tuple[str, ...] = ()
    """Modules that import the helpers by name, imported by ``patch()`` (when asked) so their
    names are replaced at once; one that fails to import is skipped."""
    requires: tuple[str, ...] = ()
    """Other attributes of ``module`` the replacements use (checked by ``patch()``)."""
    catch: tuple[type[BaseException], ...] = (ImportError,)
    """What importing ``module`` may raise for ``patch()`` to report the framework as not importable."""

    def __post_init__(self) -> None:
        if not self.helpers:
            raise ValueError(f"torchferry.integrations.{self.integration}: HelperSet(helpers=...) is empty")
        if not (self.module == self.package or self.module.startswith(self.package + ".")):
            raise ValueError(
                f"torchferry.integrations.{self.integration}: HelperSet(module={self.module!r}) is not in "
                f"package {self.package!r}"
            )

    def error(self, what: str) -> str:
        """A one-line message, ``torchferry.integrations.<integration>: <what>``."""
        return f"torchferry.integrations.{self.integration}: {what}"


class Patcher:
    """``patch()`` / ``unpatch()`` / ``is_patched()`` for one :class:`HelperSet`.

    Args:
        helper_set: what to replace.
    """

    def __init__(self, helper_set: HelperSet) -> None:
        self.helper_set = helper_set
        # (module name, attribute, original) for every attribute patch() replaced, in order.
        self._patched: list[tuple[str, str, object]] = []

    def is_patched(self) -> bool:
        """True between :meth:`patch` and :meth:`unpatch`."""
        return bool(self._patched)

    def names(self) -> list[str]:
        """The ``module.attribute`` names the last :meth:`patch` replaced (empty when not patched)."""
        return [f"{m}.{a}" for m, a, _ in self._patched]

    def check(self) -> ModuleType:
        """Imports the helper module and checks the helpers; changes nothing.

        Returns:
            The helper module.

        Raises:
            RuntimeError: the framework is not importable, a helper or required attribute is
                missing, or a helper has other parameters than ``HelperSet.helpers`` names.
        """
        hs = self.helper_set
        try:
            module = importlib.import_module(hs.module)
        except hs.catch as e:
            raise RuntimeError(hs.error(f"{hs.framework} is not importable ({type(e).__name__}: {e})")) from e
        for name, params in hs.helpers.items():
            fn = getattr(module, name, None)
            if fn is None:
                raise RuntimeError(hs.error(f"{hs.module}.{name} is missing; {hs.framework} changed"))
            got = tuple(inspect.signature(fn).parameters)
            if got != params:
                raise RuntimeError(hs.error(
                    f"{hs.module}.{name}{got} does not have the parameters {params} this integration "
                    f"was written for; {hs.framework} changed"
                ))
        for name in hs.requires:
            if not hasattr(module, name):
                raise RuntimeError(hs.error(f"{hs.module}.{name} is missing; {hs.framework} changed"))
        return module

    def patch(self, *, import_call_sites: bool = True) -> list[str]:
        """Replaces the helpers in the helper module and every package module that bound them by name.

        Idempotent: a second call replaces nothing and returns the same names.

        Args:
            import_call_sites: import ``HelperSet.call_sites`` first, so the names they bound
                are replaced too. Without it, only modules already imported are patched;
                modules imported later bind the replacements anyway.

        Returns:
            The ``module.attribute`` names replaced.

        Raises:
            RuntimeError: as :meth:`check`; nothing is replaced then.
        """
        if self._patched:
            return self.names()
        module = self.check()
        hs = self.helper_set
        originals = {name: getattr(module, name) for name in hs.helpers}
        built = hs.replacements(module, originals)
        new = {name: self._tagged(built[name], originals[name]) for name in hs.helpers}
        for mod_name in hs.call_sites if import_call_sites else ():
            try:
                importlib.import_module(mod_name)
            except Exception:  # an optional call site whose own dependencies are missing
                pass
        for mod_name, mod in self._package_modules():
            for name, orig in originals.items():
                if getattr(mod, name, None) is orig:
                    setattr(mod, name, new[name])
                    self._patched.append((mod_name, name, orig))
        return self.names()

    def unpatch(self) -> None:
        """Puts the framework's own helpers back, also in modules imported after :meth:`patch`.

        Idempotent. See [Note: replacements remember their originals].
        """
        while self._patched:
            mod_name, name, orig = self._patched.pop()
            mod = sys.modules.get(mod_name)
            if mod is not None:
                setattr(mod, name, orig)
        tag = self.helper_set.integration
        for _, mod in self._package_modules():
            for name in self.helper_set.helpers:
                fn = getattr(mod, name, None)
                original = getattr(fn, "__torchferry_original__", None)
                if original is not None and getattr(fn, "__torchferry_integration__", tag) == tag:
                    setattr(mod, name, original)

    def _package_modules(self) -> list[tuple[str, ModuleType]]:
        pkg = self.helper_set.package
        return [(n, m) for n, m in list(sys.modules.items())
                if m is not None and (n == pkg or n.startswith(pkg + "."))]

    def _tagged(self, fn: Callable, original: Callable) -> Callable:
        """A wrapper of ``fn`` that remembers ``original`` ([Note: replacements remember their originals])."""

        integration = self.helper_set.integration

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            token = ACTIVE.set(integration)  # see [Note: each integration's settings]
            try:
                return fn(*args, **kwargs)
            finally:
                ACTIVE.reset(token)

        wrapper.__torchferry_original__ = original  # type: ignore[attr-defined]
        wrapper.__torchferry_integration__ = self.helper_set.integration  # type: ignore[attr-defined]
        return wrapper
