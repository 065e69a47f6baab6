"""What a newcomer copies runs as written: ``examples/*.py``, README's first Python block, the docs' snippets.

Each runs in a fresh interpreter (the one running the tests), from the
repository root, with a node ledger of its own. A docs snippet that cannot run
on a CPU says so on its first line (``# not run: <why>``) and is skipped; every
other ``python`` block in ``docs/*.md`` must run. The last tests check that every
repository path and code note the README and the docs cite exists.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "torchferry"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CITING = [ROOT / "README.md", *DOCS]
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


# Labels a reader of the repository cannot open: an issue tracker's numbers, a reviewer's name for
# itself, files outside the repository. A public PR or issue is cited by its address instead.
_UNOPENABLE = re.compile(r"\b[Ii]ssues? \d+(?![.\d])|\bbreaker (?:helper|finding)|\.\./shared/|/work/(?:main|shared)")


def test_python_sources_cite_only_what_a_reader_can_open():
    """Comments and docstrings in the package, the tests and the benchmarks, as the docs above: no
    issue labels, no reviewers' names, no paths outside the repository; and each repository path a
    Python file cites in double backticks (``src/...``, ``tests/...``, ``benchmarks/...``, ``docs/...``)
    exists."""
    bad, missing = [], []
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    for f in files:
        text = f.read_text()
        rel = f.relative_to(ROOT)
        for m in _UNOPENABLE.finditer(text):
            if f.name != "test_examples.py":
                bad.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
        for token in re.findall(r"``((?:src|tests|benchmarks|docs)/[\w./*-]+?)(?:::\w+)?``", text):
            if not _resolve(token):
                missing.append(f"{rel}: {token}")
    assert not bad, "labels no reader can open:\n" + "\n".join(bad)
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)
