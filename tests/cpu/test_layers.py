"""The package's layout holds its rules: each module imports only from its own layer or the ones
below it, no import cycle, at most 8 entries at the top of the package, no module over 500 lines.

Layers, low to high, as ``src/torchferry/_core/__init__.py`` and ``docs/how-it-works.md`` say.
Every ``import`` counts, also one inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import os

import torchferry

PKG = os.path.dirname(torchferry.__file__)
LAYERS = ["_core._api", "_core._state", "_core._host", "_core._transfer", "_core._schedules", "_core._ferry",
          "_core._dock", "__init__", "integrations", "compat", "bench", "cli", "__main__"]  # __init__: the public face


def _modules() -> dict[str, str]:
    """Dotted name (``torchferry._core._ferry.ferry``) -> file path, for every module of the package."""
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for fn in files:
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, fn), os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, fn)
    return out


def _layer(mod: str) -> int:
    rest = mod[len("torchferry."):] if mod != "torchferry" else "__init__"
    for i, name in enumerate(LAYERS):
        if rest == name or rest.startswith(name + "."):
            return i
    if rest == "_core":
        return -1  # the folder's docstring only
    raise AssertionError(f"{mod} belongs to no layer: add it to LAYERS")


def _imports(mod: str, path: str, modules: dict[str, str]) -> set[str]:
    """The torchferry modules ``mod`` imports (a ``from pkg import name`` of a submodule counts as it)."""
    tree = ast.parse(open(path).read(), path)
    pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("torchferry")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("torchferry"):
                target = node.module
            else:
                continue
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules}
            out |= subs if subs and len(subs) == len(node.names) else {target} | subs
    return {m for m in out if m in modules and m != mod}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_module_imports_only_its_own_layer_or_below():
    upward = [f"{m} ({LAYERS[_layer(m)]}) imports {t} ({LAYERS[_layer(t)]})"
              for m, targets in _graph().items() for t in targets if _layer(t) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_imports_form_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if t in ("torchferry",) or t.endswith("__init__"):
                continue
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [m, t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                visit(t, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "\n".join(cycles)


def test_the_top_level_of_the_package_is_small():
    top = [e for e in os.listdir(PKG) if e != "__pycache__"]
    assert len(top) <= 8, sorted(top)


MAX_LINES = 500


def test_no_module_is_over_500_lines():
    """A module that grows past this is doing two jobs: split it along its layer."""
    sizes = {name: sum(1 for _ in open(path, encoding="utf-8")) for name, path in _modules().items()}
    assert sizes, "no modules found"
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, over


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rules above can fail: a module of ``_api`` importing the ``Ferry`` is an upward import."""
    fake = tmp_path / "m.py"
    fake.write_text("from .._ferry.ferry import Ferry\n")
    targets = _imports("torchferry._core._api.m", str(fake), _modules())
    assert targets == {"torchferry._core._ferry.ferry"}
    assert _layer("torchferry._core._ferry.ferry") > _layer("torchferry._core._api.m")
