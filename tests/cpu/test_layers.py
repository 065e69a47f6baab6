"""The package's layout holds its rules: each module imports only from its own layer or the ones
below it, no import cycle, at most 8 entries at the top of the package, no module over 500 lines.

Layers, low to high, as ``src/torchferry/_core/__init__.py`` and ``docs/how-it-works.md`` say.
Every ``import`` counts, also one inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import functools
import os

import pytest

import torchferry

PKG = os.path.dirname(torchferry.__file__)
LAYERS = ["_core._api", "_core._state", "_core._host", "_core._transfer", "_core._schedules", "_core._ferry",
          "_core._dock", "_public", "__init__", "integrations", "compat", "bench", "cli", "__main__"]  # __init__: the public face


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


def _from_target(node: ast.ImportFrom, pkg: str) -> str:
    """The module ``from ... import`` reads in package ``pkg`` (a relative import resolved)."""
    if not node.level:
        return node.module or ""
    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str, path: str, modules: dict[str, str]) -> set[str]:
    """The torchferry modules ``mod`` imports (a ``from pkg import name`` of a submodule counts as it)."""
    tree = ast.parse(open(path).read(), path)
    pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("torchferry")}
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, pkg)
            if not target.startswith("torchferry"):
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


# The core's run-time promises (the layer folders' docstrings): each kind of call below is made by one
# place only. The checker reads every module's syntax tree; each rule is a finder and the modules
# allowed to do it.

CORE = "torchferry._core."
TORCH_PRIVATE = {"_cdata", "_local_tensor", "_spec", "_sharded_param_data", "_swap_tensor_impl", "_foreach_copy_",
                 "_parameters", "_buffers", "_modules", "_is_view", "_base"}  # torch's, FSDP2's, DTensor's the core needs
ENV_PARSERS = {"env_flag", "env_int", "env_bytes", "env_choice"}  # _public/env's generic readers


def _attr_chain(node: ast.AST) -> str:
    """``torch.cuda.Stream`` for that expression; ``""`` for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _copies(tree: ast.AST) -> list[tuple[int, str]]:
    """Copies queued: ``x.copy_(...)``, ``switch.copy(dst, src)``, ``switch.copy_by_pointer(...)``, a pinned staging
    (``x.pin_memory()``), any call with ``non_blocking=``, ``torch.tensor(..., device=...)`` (an upload)."""
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        attr = n.func.attr if isinstance(n.func, ast.Attribute) else ""
        keywords = {k.arg for k in n.keywords}
        if (attr in ("copy_", "copy_by_pointer", "pin_memory") or (attr == "copy" and n.args)
                or "non_blocking" in keywords
                or (_attr_chain(n.func) in ("torch.tensor", "torch.as_tensor") and "device" in keywords)):
            out.append((n.lineno, attr or _attr_chain(n.func)))
    return out


def _streams(tree: ast.AST) -> list[tuple[int, str]]:
    """Streams and events made: ``torch.cuda.Stream(...)``, ``torch.cuda.Event(...)``, ``torch.Stream(...)``."""
    return [(n.lineno, _attr_chain(n.func)) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and _attr_chain(n.func).split(".")[-1] in ("Stream", "Event")]


def _internals(tree: ast.AST) -> list[tuple[int, str]]:
    """torch's private names: ``x._cdata``, ``getattr(x, "_local_tensor")``, ``torch._C...``, ``torch._foo``."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and (n.attr in TORCH_PRIVATE or
                                             (_attr_chain(n.value) == "torch" and n.attr.startswith("_"))):
            out.append((n.lineno, n.attr))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "setattr", "hasattr") and len(n.args) > 1
              and isinstance(n.args[1], ast.Constant) and n.args[1].value in TORCH_PRIVATE):
            out.append((n.lineno, n.args[1].value))
    return out


def _environment(tree: ast.AST) -> list[tuple[int, str]]:
    """Reads of the environment: ``os.environ``, ``os.getenv``, ``environ`` imported, the generic parsers."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv", "putenv"):
            out.append((n.lineno, n.attr))
        elif isinstance(n, ast.ImportFrom) and n.module == "os":
            out += [(n.lineno, a.name) for a in n.names if a.name in ("environ", "getenv")]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ENV_PARSERS | {"getenv"}:
            out.append((n.lineno, n.func.id))
    return out


PROMISES = {  # rule -> (finder, the modules allowed to do it)
    "copies are queued only by _transfer": (_copies, lambda m: m.startswith(CORE + "_transfer.")),
    "streams and events are made only in _transfer/streams": (_streams, {CORE + "_transfer.streams"}.__contains__),
    "torch's internals are read only in _state/fsdp": (_internals,
                                                        {CORE + "_state.fsdp", CORE + "_state.fsdp1"}.__contains__),
    "the core reads no environment": (_environment, lambda m: not m.startswith(CORE)),
}


def _breaches(rule: str, mod: str, source: str) -> list[str]:
    find, allowed = PROMISES[rule]
    if allowed(mod):
        return []
    return [f"{mod}:{line}: {what}" for line, what in find(ast.parse(source))]


def _core_breaches(rule: str) -> list[str]:
    return [b for mod, path in sorted(_modules().items()) if mod.startswith(CORE)
            for b in _breaches(rule, mod, open(path, encoding="utf-8").read())]


def test_copies_are_queued_only_by_the_transfer_layer():
    """Layer 4's promise: the schedules hand ``_transfer`` what to copy (``batches``, ``gates``); no
    module above or below it calls ``copy_``, a switch's ``copy`` or ``copy_by_pointer``."""
    assert not (found := _core_breaches("copies are queued only by _transfer")), "\n".join(found)


def test_streams_and_events_are_made_only_in_streams():
    """[Note: torchferry streams]: ``_transfer/streams`` makes every stream and event (``side_stream``
    for the dock's prefetch)."""
    assert not (found := _core_breaches("streams and events are made only in _transfer/streams")), "\n".join(found)


def test_torch_internals_are_read_only_in_state_fsdp():
    """Layer 2's promise: ``_cdata``, ``_local_tensor``, ``torch._C`` and the other private names of
    torch, FSDP2 and DTensor are read by ``_state/fsdp`` only; the rest of the core asks it."""
    assert not (found := _core_breaches("torch's internals are read only in _state/fsdp")), "\n".join(found)


def test_the_core_reads_no_environment():
    """The core is handed its settings (``CoreSettings`` (``_core/_api/settings.py``)); no module of it reads
    ``os.environ`` or calls the generic parsers: ``torchferry/_public/env`` reads the core's variables
    ([Note: one parser for the environment])."""
    assert not (found := _core_breaches("the core reads no environment")), "\n".join(found)


def test_the_public_face_reads_the_environment_only_in_public_env():
    found = [f"{m}:{line}: {what}" for m, path in sorted(_modules().items())
             if m.startswith("torchferry._public.") and m != "torchferry._public.env"
             for line, what in _environment(ast.parse(open(path, encoding="utf-8").read()))]
    assert not found, "\n".join(found)


def test_the_core_settings_are_read_from_nine_variables_and_the_core_names_no_other():
    """Every ``TORCHFERRY_*`` name in the core's code (not its docstrings) is one of ``CORE_ENV``, the nine
    variables ``_public/env.core_settings`` reads."""
    from torchferry._public.env import CORE_ENV

    assert len(set(CORE_ENV)) == 9
    named = {n.value for mod, path in _modules().items() if mod.startswith(CORE)
             for n in ast.walk(ast.parse(open(path, encoding="utf-8").read()))
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("TORCHFERRY_")
             and " " not in n.value}
    assert named <= set(CORE_ENV), sorted(named - set(CORE_ENV))


@pytest.mark.parametrize(("rule", "planted"), [
    ("copies are queued only by _transfer", "def f(slots, src):\n    slots[0].copy_(src)\n"),
    ("copies are queued only by _transfer", "def f(sw, q, a, b):\n    sw.copy_by_pointer(q, a, b, 8)\n"),
    ("copies are queued only by _transfer",
     "def f(s, sw, d, x):\n    with torch.cuda.stream(s):\n        sw.copy(d, x)\n"),
    ("copies are queued only by _transfer", "def f(t, dev):\n    return t.pin_memory().to(dev)\n"),
    ("copies are queued only by _transfer", "def f(t, dev):\n    return t.to(dev, non_blocking=True)\n"),
    ("copies are queued only by _transfer", "def f(vals, dev):\n    return torch.tensor(vals, device=dev)\n"),
    ("streams and events are made only in _transfer/streams", "s = torch.cuda.Stream(0)\n"),
    ("streams and events are made only in _transfer/streams", "e = torch.cuda.Event(enable_timing=True)\n"),
    ("torch's internals are read only in _state/fsdp", "k = st._cdata\n"),
    ("torch's internals are read only in _state/fsdp", "t = p._local_tensor\n"),
    ("torch's internals are read only in _state/fsdp", "t = getattr(p, '_local_tensor', p)\n"),
    ("torch's internals are read only in _state/fsdp", "torch._C._swap_tensor_impl(a, b)\n"),
    ("torch's internals are read only in _state/fsdp", "ps = m._parameters\n"),
    ("torch's internals are read only in _state/fsdp", "b = t._base if t._is_view() else None\n"),
    ("the core reads no environment", "import os\nx = os.environ.get('TORCHFERRY_HASH')\n"),
    ("the core reads no environment", "import os\nx = os.getenv('TORCHFERRY_HASH')\n"),
    ("the core reads no environment", "from os import environ\n"),
    ("the core reads no environment", "x = env_flag('TORCHFERRY_VERIFY_SKIPS', False)\n"),
])
def test_the_promise_checkers_see_a_planted_breach(rule, planted):
    """Each checker above can fail: the breach planted in a ``_schedules`` module is reported, and the
    same source in the one module allowed to do it (for the environment: one above the core) is not."""
    assert _breaches(rule, CORE + "_schedules.planted", planted), planted
    home = {"copies": "_transfer.copies", "streams": "_transfer.streams", "torch's": "_state.fsdp",
            "the": None}[rule.split()[0]]
    if home is not None:
        assert not _breaches(rule, CORE + home, planted)
    else:  # the core reads the environment nowhere: the same source above it is not reported
        assert _breaches(rule, CORE + "_api.settings", planted)
        assert not _breaches(rule, "torchferry._public.env", planted)


def test_the_promise_checkers_pass_the_dict_copy_and_index_copy():
    """Not every call named like a copy is one: ``d.copy()`` (no argument) and ``out.index_copy_(...)``."""
    src = "def f(d, out, i, h):\n    e = d.copy()\n    out.index_copy_(0, i, h)\n"
    assert not _breaches("copies are queued only by _transfer", CORE + "_schedules.planted", src)



# No callback into a higher layer: a module hands a lower layer data (a schedule, the batches to copy), never
# its own code to call back. A call of a function or class imported from a lower layer, or of a method only a
# lower layer defines, is refused an argument that is a lambda, a ``functools.partial``, a function of the
# calling module or one of its methods (``self._hook``), and any argument for a parameter the callee annotates
# ``Callable`` (a callback handed on). ``Uncopyable`` adapts a hook that torch calls, not ``_api``;
# ``add_done_callback`` is a ``concurrent.futures.Future``'s here.
HOOK_ADAPTERS = {"Uncopyable", "add_done_callback"}


def _imported(mod: str, tree: ast.AST, modules: set[str], package: bool) -> dict[str, str]:
    """Local name -> the torchferry module it comes from (``from .x import f``: ``f`` -> ``x``'s module)."""
    pkg = mod if package else mod.rpartition(".")[0]
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _from_target(node, pkg)
            for a in node.names:
                out[a.asname or a.name] = f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
    return {name: m for name, m in out.items() if m in modules}


def _methods(tree: ast.AST) -> set[str]:
    """The names of the methods the classes of a module define (properties aside)."""
    return {f.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not any(_attr_chain(d).endswith("property") for d in f.decorator_list)}


@functools.cache
def _callable_params(mod: str, name: str) -> tuple[tuple[int, str], ...]:
    """(position, name) of each parameter that ``mod``'s function ``name`` (a class: its ``__init__``, without
    ``self``) annotates ``Callable``; position -1: keyword only."""
    tree = ast.parse(open(_modules()[mod], encoding="utf-8").read())
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
    skip = 0
    if isinstance(node, ast.ClassDef):
        node, skip = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None), 1
    if node is None:
        return ()
    hands = lambda a: a.annotation is not None and "Callable" in ast.unparse(a.annotation)  # noqa: E731
    return (tuple((i, a.arg) for i, a in enumerate([*node.args.posonlyargs, *node.args.args][skip:]) if hands(a))
            + tuple((-1, a.arg) for a in node.args.kwonlyargs if hands(a)))


@functools.cache
def _methods_by_layer() -> dict[str, set[int]]:
    """Method name -> the layers whose modules define one so named."""
    out: dict[str, set[int]] = {}
    for mod, path in _modules().items():
        for name in _methods(ast.parse(open(path, encoding="utf-8").read())):
            out.setdefault(name, set()).add(_layer(mod))
    return out


def _callbacks(mod: str, source: str, package: bool = False) -> list[str]:
    """The callbacks module ``mod`` hands a lower layer: ``line: callee(callback)``."""
    tree, modules, layer = ast.parse(source), set(_modules()), _layer(mod)
    imported = _imported(mod, tree, modules, package)
    bound = ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
             | {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)})
    in_class = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
    functions = {f.name for f in ast.walk(tree)
                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(f) not in in_class} - bound
    methods = _methods(tree)

    def lower(func: ast.AST) -> str | None:
        if isinstance(func, ast.Name) and func.id in imported:
            return func.id if _layer(imported[func.id]) < layer else None
        if isinstance(func, ast.Attribute):
            if _attr_chain(func.value) in imported:
                return func.attr if _layer(imported[_attr_chain(func.value)]) < layer else None
            layers = _methods_by_layer().get(func.attr, set())
            return func.attr if layers and max(layers) < layer else None
        return None

    def handed_on(call: ast.Call) -> list[ast.AST]:
        """The arguments ``call`` gives the parameters its callee (imported by name) annotates ``Callable``."""
        func = call.func
        where = (imported.get(func.id) if isinstance(func, ast.Name) else
                 imported.get(_attr_chain(func.value)) if isinstance(func, ast.Attribute) else None)
        if where is None:
            return []
        params = _callable_params(where, func.id if isinstance(func, ast.Name) else func.attr)  # type: ignore[union-attr]
        return ([a for i, a in enumerate(call.args) if any(i == pos for pos, _ in params)]
                + [k.value for k in call.keywords if any(k.arg == p for _, p in params)])

    def code(arg: ast.AST) -> bool:
        return (isinstance(arg, ast.Lambda) or (isinstance(arg, ast.Name) and arg.id in functions)
                or (isinstance(arg, ast.Attribute) and _attr_chain(arg.value) in ("self", "cls")
                    and arg.attr in methods)
                or (isinstance(arg, ast.Call) and _attr_chain(arg.func).split(".")[-1] == "partial"))

    return [f"{mod}:{n.lineno}: {callee}({ast.unparse(arg)})" for n in ast.walk(tree) if isinstance(n, ast.Call)
            if (callee := lower(n.func)) is not None and callee not in HOOK_ADAPTERS
            for arg in [*n.args, *(k.value for k in n.keywords)] if code(arg) or arg in handed_on(n)]


def test_no_module_of_the_core_hands_a_lower_layer_a_callback():
    """Layer 4's promise, for every layer: ``issue_h2d`` gets its gates as data ([Note: torchferry streams])."""
    modules = _modules()
    found = [b for mod, path in sorted(modules.items()) if mod.startswith(CORE)
             for b in _callbacks(mod, open(path, encoding="utf-8").read(), path.endswith("__init__.py"))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("planted", [
    "from .._transfer.h2d import issue_h2d\ndef f(plan):\n    issue_h2d(plan, lambda: None)\n",
    "from .._transfer import h2d\ndef g():\n    pass\ndef f(plan):\n    h2d.issue_h2d(plan, on_done=g)\n",
    "from .._transfer.h2d import issue_h2d\nclass R:\n    def f(self, plan):\n        issue_h2d(plan, self.step)\n"
    "    def step(self):\n        pass\n",
    "import functools\nfrom .._transfer.gates import upload_rows\ndef f(s, r, a):\n"
    "    upload_rows(s, r, functools.partial(a, 1))\n",
])
def test_the_callback_checker_sees_a_planted_breach(planted):
    """A ``_schedules`` module handing ``_transfer`` a lambda, a function, a method or a partial is reported; the
    same module handing it data, or a callback to its own layer, is not."""
    assert _callbacks(CORE + "_schedules.planted", planted), planted
    fine = ("from .._transfer.h2d import issue_h2d\nfrom .step_hooks import GlobalStepHook\nclass R:\n"
            "    def f(self, plan, gates):\n        issue_h2d(plan, gates)\n"
            "        GlobalStepHook().add(1, self.f)\n")
    assert not _callbacks(CORE + "_schedules.planted", fine)


def test_the_callback_checker_sees_a_callback_handed_on():
    """A parameter handed on to one ``_transfer`` annotates ``Callable`` (``upload_rows``'s ``address``) is a
    callback whatever the argument is; the function's other arguments are data."""
    planted = "from .._transfer.gates import upload_rows\ndef f(storages, rows, address):\n" \
              "    upload_rows(storages, rows, address)\n    upload_rows(storages, rows=rows, address=address)\n"
    assert _callbacks(CORE + "_schedules.planted", planted) == [
        f"{CORE}_schedules.planted:3: upload_rows(address)", f"{CORE}_schedules.planted:4: upload_rows(address)"]


def test_the_callback_checker_sees_a_method_only_a_lower_layer_defines():
    """``stage_rows`` is a method of ``_schedules`` only: ``_ferry`` handing it ``self._hash`` is reported."""
    planted = "class S:\n    def f(self, plan):\n        self.unchanged.stage_rows(plan, self._hash)\n" \
              "    def _hash(self):\n        pass\n"
    assert _callbacks(CORE + "_ferry.planted", planted) == [f"{CORE}_ferry.planted:3: stage_rows(self._hash)"]

# The integrations' rules ([Note: each integration's settings] in ``docs/integrations.md``): a
# framework folder (``verl/``, ``skyrl/``, ``areal/``) builds on ``torchferry``'s public names and
# ``integrations._base`` only; no module of ``integrations`` keeps mutable state at module level (the one
# registry, ``_base/registry.REGISTRY``, aside); the environment is read in ``_base/settings`` only (the core's
# variables through ``torchferry/_public/env``).

INTEGRATIONS = "torchferry.integrations."
FRAMEWORKS = ("verl", "skyrl", "areal")
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "deque", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet",
                 "ContextVar", "Registry", "Patcher", "PatchState", "OrderedDict", "Counter", "Queue", "SimpleQueue",
                 "local", "Lock", "RLock", "Dock", "PhaseDock", "VerlDock", "Ferry", "bytearray"}


def _framework_breaches(mod: str, source: str, modules: set[str], package: bool = False) -> list[str]:
    """What framework module ``mod`` (a package's ``__init__`` with ``package``) imports of torchferry besides
    its own folder, ``torchferry`` and ``_base``."""
    folder = INTEGRATIONS + mod[len(INTEGRATIONS):].split(".")[0]
    allowed = ("torchferry", INTEGRATIONS + "_base")
    pkg = mod if package else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            target = _from_target(node, pkg)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for t in names:
            if t.startswith("torchferry") and t not in allowed and not (t == folder or t.startswith(folder + ".")):
                out.append(f"{mod}:{node.lineno}: imports {t}")
    return sorted(set(out))


def _module_state(mod: str, source: str) -> list[str]:
    """Module-level mutable objects: ``global`` rebinding, a module-level call of a mutable container (or a
    holder of state), a module-level dict / list / set display (a table is a ``MappingProxyType``, a tuple or a
    ``frozenset``; ``__all__`` aside)."""
    tree = ast.parse(source)
    out = [f"{mod}:{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]  # ``A, B = ...`` too
        values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
        for value in values:
            called = _attr_chain(value.func).split(".")[-1] if isinstance(value, ast.Call) else ""
            display = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
            if called in MUTABLE_CALLS or (display and any(not n.startswith("__") for n in names)):
                out.append(f"{mod}:{node.lineno}: {', '.join(names)} = {called or type(value).__name__}")
    return out


def _integration_sources() -> dict[str, str]:
    return {m: open(p, encoding="utf-8").read() for m, p in sorted(_modules().items()) if m.startswith(INTEGRATIONS)}


def test_a_framework_folder_imports_only_torchferrys_public_names_and_base():
    modules = _modules()
    found = [b for m, src in _integration_sources().items() if m[len(INTEGRATIONS):].split(".")[0] in FRAMEWORKS
             for b in _framework_breaches(m, src, set(modules), modules[m].endswith("__init__.py"))]
    assert not found, "\n".join(found)


def test_the_integrations_stay_within_2000_lines_and_verls_dock_adapter_within_250():
    """A framework folder says only what differs; growth past these is shared logic repeated (it belongs in ``_base``
    or the core)."""
    sizes = {m: sum(1 for _ in open(p, encoding="utf-8")) for m, p in _modules().items() if m.startswith(INTEGRATIONS)}
    assert sum(sizes.values()) <= 2000, sorted(sizes.items(), key=lambda kv: -kv[1])
    assert sizes[INTEGRATIONS + "verl._dock"] <= 250, sizes[INTEGRATIONS + "verl._dock"]


def test_no_integration_module_keeps_mutable_state_at_module_level():
    found = [b for m, src in _integration_sources().items() if m != INTEGRATIONS + "_base.registry"
             for b in _module_state(m, src)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("rule", ["copies are queued only by _transfer",
                                  "streams and events are made only in _transfer/streams",
                                  "torch's internals are read only in _state/fsdp"])
def test_the_integrations_and_compat_keep_the_cores_run_time_promises(rule):
    """``integrations`` and ``compat`` copy, make streams and read FSDP2's internals through the core
    (``_base`` hands them ``local_of``, ``idle_and_resharded``, ...), as the core's own layers above do."""
    found = [b for mod, path in sorted(_modules().items()) if mod.startswith((INTEGRATIONS, "torchferry.compat"))
             for b in _breaches(rule, mod, open(path, encoding="utf-8").read())]
    assert not found, "\n".join(found)


def test_the_integrations_read_the_environment_only_in_base_settings():
    found = [f"{m}:{line}: {what}" for m, src in _integration_sources().items() if m != INTEGRATIONS + "_base.settings"
             for line, what in _environment(ast.parse(src))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("planted", [
    "from ..._core._ferry.ferry import Ferry\n",
    "from torchferry._core._dock.dock import Dock\n",
    "from .._base.settings import Settings\n",
    "import torchferry.integrations.skyrl._patch\n",
    "from ..skyrl import patch\n",
])
def test_the_framework_import_checker_sees_a_planted_breach(planted):
    """A module of ``verl/`` importing the core's private modules, a ``_base`` submodule or another framework's
    folder is reported; the same module importing ``torchferry`` or ``_base`` is not."""
    modules = set(_modules())
    assert _framework_breaches(INTEGRATIONS + "verl.planted", planted, modules), planted
    fine = "from torchferry import Ferry\nfrom .._base import REGISTRY\nfrom ._dock import docked\n"
    assert not _framework_breaches(INTEGRATIONS + "verl.planted", fine, modules)


@pytest.mark.parametrize("planted", [
    "import weakref\n_ferries = weakref.WeakKeyDictionary()\n",
    "import contextvars\nACTIVE = contextvars.ContextVar('x', default=None)\n",
    "_originals: dict = {}\n",
    "_patcher = Patcher(HELPER_SET)\n",
    "def f():\n    global _x\n    _x = 1\n",
    "HELPERS = {'a': ('model',)}\n",
    "NAMES: list[str] = ['a']\n",
    "DOCK = VerlDock(1 << 30)\n",
    "import queue\nPENDING = queue.Queue()\n",
    "import threading\nSEEN = threading.local()\n",
    "A, B = [], {}\n",
])
def test_the_module_state_checker_sees_a_planted_breach(planted):
    assert _module_state(INTEGRATIONS + "verl.planted", planted), planted
    fine = "HELPERS = MappingProxyType({'a': ('model',)})\nN = 3\nT = ('a',)\nF = frozenset({'a'})\n__all__ = ['N']\n"
    assert not _module_state(INTEGRATIONS + "verl.planted", fine)
