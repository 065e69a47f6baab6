"""What a newcomer copies runs as written: ``examples/*.py``, README's first Python block, the docs' snippets.

Each runs in a fresh interpreter (the one running the tests), from the
repository root, with a node ledger of its own. A docs snippet that cannot run
on a CPU says so on its first line (``# not run: <why>``) and is skipped; every
other ``python`` block in ``docs/*.md`` must run. The last tests check that every
repository path and code note the README, the docs and the Python sources cite exists, that
every ``[Note: x]`` cited is defined, and that no label a reader cannot open is cited.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "torchferry"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CITING = [ROOT / "README.md", *DOCS, ROOT / "benchmarks" / "README.md"]
TIMEOUT_S = 300
NOT_RUN = "# not run:"
HAVE_VERL = importlib.util.find_spec("verl") is not None

# Each example and lines its output must hold (its last line: "<name>: OK on <device>").
EXAMPLES = {
    "offload_reload.py": ["reloaded: residency DEVICE, bit-exact: True", "offload_reload: OK on"],
    "dock_grpo.py": ["step 4: actor_params 0 out / 0 in, actor_opt 0 out / 0 in, ref 1 out / 1 in",
                     "dock_grpo: OK on"],
    "verl_patch.py": ["verl.utils.fsdp_utils.offload_fsdp_model_to_cpu", "bit-exact: True", "verl_patch: OK on"],
}
README_PRINTS = "HOST cpu\nbit-exact: True\n"


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCHFERRY_LEDGER_DIR=str(tmp_path))
    env.pop("TORCHFERRY_HOST_BUDGET_BYTES", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _python_blocks(md: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block."""
    text = md.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def _run_block(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    return _run([str(script)], tmp_path)


def _failed(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"


# ---------------------------------------------------------------- examples

def test_every_example_is_run_here():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_and_prints_its_result(name, tmp_path):
    if name == "verl_patch.py" and not HAVE_VERL:
        pytest.skip("verl not installed (pip install --no-deps verl==0.9.1)")
    p = _run([str(ROOT / "examples" / name)], tmp_path)
    assert p.returncode == 0, _failed(p)
    for line in EXAMPLES[name]:
        assert line in p.stdout, f"{line!r} not printed\n{_failed(p)}"
    assert p.stdout.splitlines()[-1].startswith(f"{name.removesuffix('.py')}: OK on "), _failed(p)


# ---------------------------------------------------------------- README and docs snippets

def test_readme_first_python_block_runs_as_written(tmp_path):
    blocks = _python_blocks(ROOT / "README.md")
    assert blocks, "README.md has no ```python block"
    _, code = blocks[0]
    assert "device=" in code  # runs on a CPU as written
    p = _run_block(code, tmp_path)
    assert p.returncode == 0, _failed(p)
    assert p.stdout == README_PRINTS, _failed(p)


# docs/any-trainer.md's blocks run in tests/cpu/test_any_trainer_doc.py (forked from one interpreter).
DOC_BLOCKS = [pytest.param(code, id=f"{md.name}:L{line}") for md in DOCS if md.name != "any-trainer.md"
              for line, code in _python_blocks(md)]


@pytest.mark.parametrize("code", DOC_BLOCKS)
def test_docs_python_snippet_runs_as_written(code, tmp_path):
    first = code.splitlines()[0] if code else ""
    if first.startswith(NOT_RUN):
        pytest.skip(first[len(NOT_RUN):].strip())
    if "verl" in code and not HAVE_VERL:
        pytest.skip("verl not installed (pip install --no-deps verl==0.9.1)")
    p = _run_block(code, tmp_path)
    assert p.returncode == 0, _failed(p)


# ---------------------------------------------------------------- API reference

def test_pdoc_renders_the_api_the_docs_name(tmp_path):
    """The command ``docs/README.md`` gives renders ``torchferry`` and ``torchferry.integrations.verl``."""
    pytest.importorskip("pdoc")
    m = re.search(r"`pdoc (torchferry[^`]*) -o api`", " ".join((ROOT / "docs" / "README.md").read_text().split()))
    assert m, "docs/README.md gives no pdoc command"
    p = _run(["-m", "pdoc", *m.group(1).split(), "-o", str(tmp_path / "api")], tmp_path)
    assert p.returncode == 0, _failed(p)
    for page in ("torchferry.html", "torchferry/integrations.html", "torchferry/integrations/verl.html"):
        assert (tmp_path / "api" / page).is_file(), page
    verl = (tmp_path / "api" / "torchferry/integrations/verl.html").read_text()
    assert "ray_worker_setup" in verl and "offload_fsdp_optimizer" in verl


# ---------------------------------------------------------------- citations

# Path-like tokens the docs cite: repository folders, and the package's own folders
# (``_core/_state/plan.py`` is ``src/torchferry/_core/_state/plan.py``).
_REPO_PREFIXES = ("src/", "tests/", "benchmarks/", "docs/", "examples/", ".ci/", "shared/", ".whl/", ".devcarry/")
_PKG_PREFIXES = ("_core/", "integrations/", "compat/", "bench/")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", md.read_text(), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _resolve(token: str) -> list[Path] | None:
    """The files a cited token names (a glob may name several), or None if it is no repository path."""
    token = token.rstrip(".,;:)")
    if token.startswith(_REPO_PREFIXES):
        pattern = token
    elif token.startswith(_PKG_PREFIXES):
        pattern = f"src/torchferry/{token}"
    elif re.fullmatch(r"test_\w+\.py", token):
        return sorted((ROOT / "tests").rglob(token))
    elif re.fullmatch(r"_\w+\.py", token):  # a private module cited by name: it must exist in the package
        return sorted(PKG.rglob(token))
    else:
        return None
    pattern = pattern.rstrip("/")
    if "*" in pattern:
        return sorted(ROOT.glob(pattern))
    return [ROOT / pattern] if (ROOT / pattern).exists() else []


def _cited_tokens(md: Path) -> list[str]:
    """Backticked tokens in the text, and path-like words in code blocks."""
    text = md.read_text()
    out = re.findall(r"`([^`\s]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        out += [w for w in re.split(r"[\s'\"(]+", block) if w.startswith(_REPO_PREFIXES)]
    return out


def test_every_repository_path_the_docs_cite_exists():
    """Links, backticked paths (``file.py::test_name`` too: the test must exist) and paths in code
    blocks; anchors of links to Markdown files too. Sources outside the repository are public
    PRs/issues, never a local folder such as ``shared/``."""
    missing = []
    for md in CITING:
        where = md.relative_to(ROOT)
        for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (md.parent / path).resolve() if path else md
            if not file.exists():
                missing.append(f"{where}: link {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                missing.append(f"{where}: link {target} (no such heading)")
        for token in _cited_tokens(md):
            path, _, test = token.partition("::")
            files = _resolve(path)
            if files is None:
                continue
            if not files:
                missing.append(f"{where}: {token}")
                continue
            test = re.sub(r"[^\w*].*$", "", test)  # test_x, test_x[param] -> test_x; test_x_* stays a glob
            name = re.escape(test).replace(r"\*", r"\w*")
            if test and not any(re.search(rf"^\s*def {name}\(", f.read_text(), re.M) for f in files if f.is_file()):
                missing.append(f"{where}: {token} (no such test)")
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_every_note_the_docs_cite_is_in_the_file_they_name():
    """``[Note: x] in `file` `` (or ``[Note: x], `file` ``): the file holds that note."""
    wrong = []
    for md in CITING:
        text = " ".join(md.read_text().split())
        for note, token in re.findall(r"\[Note: ([^\]]+)\](?: in|,) `([^`]+)`", text):
            files = _resolve(token)
            if not files:
                continue  # a missing file is the test above's finding
            if not any(f"[Note: {note}]" in " ".join(f.read_text().split()) for f in files if f.is_file()):
                wrong.append(f"{md.relative_to(ROOT)}: [Note: {note}] not in {token}")
    assert not wrong, "\n".join(wrong)


# Labels a reader of the repository cannot open: an issue tracker's numbers and items, a reviewer's name
# for itself, files outside the repository. A public PR or issue is cited by its address instead.
_UNOPENABLE = re.compile(r"\b[Ii]ssues? \d+(?![.\d])|\b[Ii]ssue item \d|\breport \(item \d|\bitem \d+ of the \""
                         r"|breaker\d|\bbreaker (?:helper|finding)|\badversarial review"
                         r"|\.\./shared/|/work/(?:main|shared|wt-)")
# A repository path in a Python comment or string: a folder of the repository or of the package, or a private
# module or a test file by name. After ``:`` a path is another tree's (``git show <commit>:path``, ``verl:path``).
_PY_PATH = re.compile(r"(?<![\w/.:~$@-])((?:src|tests|benchmarks|docs|examples|\.ci|shared|_core|integrations"
                      r"|compat|bench)/[\w./*{},-]*|_\w+\.py\b|test_\w+\.py\b)")
_GIT_SHOW = re.compile(r"git show ([0-9a-f]{7,40}\^?):([\w./-]+\w)")
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
# A note is defined where a line starts with it (after ``#``, a docstring's quotes or a list's mark).
_NOTE_DEF = re.compile(r"^\s*(?:#+\s*|[rbu]?\"\"\"\s*|[-*>]\s+)?\[Note: ([^\]\n]+)\]", re.M)
SOURCES = [p for d in ("src", "tests", "benchmarks", "examples") for p in sorted((ROOT / d).rglob("*.py"))]
SELF = Path(__file__).resolve()  # this file names the patterns it refuses


def _expand(token: str) -> list[str]:
    """``a-{1.5b,3b}.json`` -> ``a-1.5b.json``, ``a-3b.json`` (a shell's braces, as the sources write them)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", token)
    return [x for alt in m.group(1).split(",") for x in _expand(token[:m.start()] + alt + token[m.end():])] \
        if m else [token]


def _commented(source: str) -> list[tuple[int, str, bool]]:
    """A Python source's comments and strings (docstrings, messages): (line, text, is a comment)."""
    return [(tok.start[0], tok.string.lstrip("#") if tok.type == tokenize.COMMENT else tok.string,
             tok.type == tokenize.COMMENT)
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type in (tokenize.COMMENT, tokenize.STRING)]


@functools.cache
def _full_history() -> bool:
    try:
        p = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0 and p.stdout.strip() == "false"


def _in_git(rev: str, path: str) -> bool | None:
    """Whether ``git show rev:path`` opens a file; None where no full history is at hand."""
    if not _full_history():
        return None
    return subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=ROOT, capture_output=True,
                          timeout=30).returncode == 0


def _python_findings(source: str) -> list[str]:
    """What a Python source cites that no reader can open: ``line: what``."""
    out = [f"{source.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r} (a label no reader can open)"
           for m in _UNOPENABLE.finditer(source)]
    for line, text, _ in _commented(source):
        for m in _PY_PATH.finditer(text):
            token = m.group(1).rstrip(".,;:)")
            if "{" in token and "," not in token:
                continue  # a format string's field, not a path
            for path in _expand(token):
                if _resolve(path) == []:
                    out.append(f"{line}: {path} (not in the repository)")
        for rev, path in _GIT_SHOW.findall(text):
            if _in_git(rev, path) is False:
                out.append(f"{line}: git show {rev}:{path} (not in the history)")
    return out


def _notes_cited(text: str, python: bool) -> set[str]:
    if python:  # the comments joined in order (one wrapped around code reads as one), then each string
        parts = _commented(text)
        text = " ".join([" ".join(s for _, s, c in parts if c), *(s for _, s, c in parts if not c)])
    return {" ".join(n.split()) for n in _NOTE.findall(text)} - {"..."}


def test_python_sources_cite_only_what_a_reader_can_open():
    """Comments and strings (docstrings, messages) of the package, the tests, the benchmarks and the
    examples: no issue labels or items, no reviewers' names, no paths outside the repository; each
    repository path they cite exists (``src/...``, ``benchmarks/results/...``, ``_core/...``, ``_x.py``,
    ``test_x.py``; braces expanded), and each ``git show <commit>:path`` opens a file."""
    found = [f"{f.relative_to(ROOT)}:{finding}" for f in SOURCES if f != SELF
             for finding in _python_findings(f.read_text())]
    assert not found, "cited but no reader can open it:\n" + "\n".join(found)


def test_the_docs_cite_no_label_a_reader_cannot_open():
    bad = [f"{md.relative_to(ROOT)}: {m.group(0)!r}" for md in CITING for m in _UNOPENABLE.finditer(md.read_text())]
    assert not bad, "labels no reader can open:\n" + "\n".join(bad)


def test_every_note_cited_is_defined():
    """Each ``[Note: x]`` the sources and the docs cite is defined in the repository: a line starts with it
    (``# [Note: x]``, a docstring's first line ``[Note: x]: ...``). ``[Note: a model or ...]`` abbreviates
    a note that starts so."""
    texts = {f: f.read_text() for f in [*SOURCES, *CITING]}
    defined = {" ".join(n.split()) for t in texts.values() for n in _NOTE_DEF.findall(t)}
    undefined = sorted(f"{f.relative_to(ROOT)}: [Note: {n}]" for f, t in texts.items() if f != SELF
                       for n in _notes_cited(t, f.suffix == ".py") - defined
                       if not (n.endswith(" ...") and any(d.startswith(n[:-3]) for d in defined)))
    assert not undefined, "cited but defined nowhere:\n" + "\n".join(undefined)


PLANTED = [  # a breach each checker above must report
    "# Reproduces issue 15 as reported.\n",
    '"""Reproduces issue item 5."""\n',
    '"""Found by the breaker helper."""\n',
    "# from an adversarial review\n",
    'M = "verl._breaker2_probe"\n',
    "# as ../shared/DESIGN.md says\n",
    "# see /work/main/benchmarks/results/x.json\n",
    '"""Measured (``benchmarks/results/no_such_result.json``)."""\n',
    "# see benchmarks/results/no_such_result.json\n",
    "x = f(a)  # see benchmarks/results/no_such_\nx = g(a)  # result.json\n",
    '"""``_core/_ferry/no_such_module.py``."""\n',
    "# [Note: a note] in _no_such_module.py\n",
    '"""Run by ``test_no_such_file.py``."""\n',
    '"""As ``benchmarks/results/bench_qwen2.5-{1.5b,0b}-compute-rich_h200x1_2026-12-01_9365f08.json`` show."""\n',
    "# ``git show 72c0885:benchmarks/no_such_script.py``\n",
]


@pytest.mark.parametrize("planted", PLANTED)
def test_the_citation_checker_sees_a_planted_breach(planted):
    if "git show" in planted and _in_git("72c0885", "README.md") is None:
        pytest.skip("no full git history here")
    assert _python_findings(planted), planted


def test_the_citation_checker_passes_what_a_reader_can_open():
    """Paths that exist (braces expanded), a commit's file, another repository's path, a format string."""
    source = ('"""``benchmarks/results/bench_qwen2.5-{1.5b,3b}-compute-rich_h200x1_2026-12-01_9365f08.json``,\n'
              "``git show 72c0885^:benchmarks/grpo_dock.py``, verl:tests/special_distributed/x.py, _core/_ferry/,\n"
              '``tests/cpu/test_layers.py``, test_layers.py, _patch.py."""\n'
              'out = f"benchmarks/results/{name}.json"  # as in README.md\n')
    assert _python_findings(source) == []


def test_the_note_checker_sees_an_undefined_note():
    cited = _notes_cited('x = 1  # see [Note: a note\n# defined nowhere]\n"""And [Note: ...]."""\n', python=True)
    assert cited == {"a note defined nowhere"}
    assert {"a note"} == {" ".join(n.split()) for n in _NOTE_DEF.findall('    """[Note: a note]: text\n')}
    assert not _NOTE_DEF.findall("text that cites [Note: a note] mid-line\n")
