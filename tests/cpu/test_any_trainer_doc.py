"""``docs/any-trainer.md`` runs as written: every ``python`` block, on the CPU.

Every block must run (none is ``# not run:``) and hold ``assert`` statements, so that a change in
behaviour fails here instead of printing something else. Each block runs from the repository
root, as a ``__main__`` script with a node ledger of its own, and exits as a script does
(interpreter shutdown and its finalizers included), as ``tests/cpu/test_examples.py`` runs the
docs' snippets. To keep this file fast, the blocks are forked at once from one interpreter that
has imported torch (3 s of every block's 5 s on a 2-core host: ``torch.optim`` imports Dynamo);
nothing of torchferry is imported before the fork. ``tests/cpu/test_examples.py`` runs the same
blocks once more, each in an interpreter of its own.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "any-trainer.md"
TIMEOUT_S = 180
ON_A_CPU = '"cuda" if torch.cuda.is_available() else "cpu"'

# Imports torch once, then forks one child per block; each child runs its block as a script, then
# what a script's exit runs (atexit handlers, weakref finalizers: a ferry dropped while offloaded),
# and leaves without tearing the interpreter's modules down (a second of CPU each, for nothing).
_ZYGOTE = r"""
import atexit, json, os, runpy, sys, traceback
import torch, torch._dynamo, torch.distributed, torch.distributed.fsdp  # what every block pays for first
children = {}
for script, folder in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        os.environ["TORCHFERRY_LEDGER_DIR"] = folder
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [script]
        code = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        try:
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
            code = code or 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    children[pid] = folder
for pid, folder in children.items():
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(folder, "rc"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""


def _python_blocks(md: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block."""
    text = md.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


BLOCKS = _python_blocks(PAGE)
IDS = [f"L{line}" for line, _ in BLOCKS]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[int | None, str, str]]:
    """(exit status, stdout, stderr) of every block, all run at once."""
    jobs, folders = [], {}
    for (_, code), name in zip(BLOCKS, IDS, strict=True):
        folder = tmp_path_factory.mktemp(name)
        (folder / "snippet.py").write_text(code)
        jobs.append([str(folder / "snippet.py"), str(folder)])
        folders[name] = folder
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the blocks run side by side: no thread pools spinning
    env.pop("TORCHFERRY_HOST_BUDGET_BYTES", None)
    zygote = subprocess.run([sys.executable, "-c", _ZYGOTE, json.dumps(jobs)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert zygote.returncode == 0, zygote.stderr[-4000:]
    out = {}
    for name, folder in folders.items():
        rc = folder / "rc"
        out[name] = (int(rc.read_text()) if rc.exists() else None,
                     (folder / "stdout").read_text() if (folder / "stdout").exists() else "",
                     (folder / "stderr").read_text() if (folder / "stderr").exists() else "")
    return out


def test_the_page_has_its_blocks_and_every_one_runs_here():
    assert len(BLOCKS) >= 5, "docs/any-trainer.md lost its examples"
    assert not [line for line, code in BLOCKS if code.startswith("# not run:")]


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=IDS)
def test_block_asserts_and_runs_on_a_cpu_as_written(code):
    asserts = [node for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Assert)]
    assert asserts, "an example without an assert cannot fail"
    assert ON_A_CPU in code or '"gloo"' in code


@pytest.mark.parametrize("name", IDS)
def test_block_runs_as_written(name, results):
    rc, stdout, stderr = results[name]
    assert rc == 0, f"docs/any-trainer.md:{name} exit {rc}\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-4000:]}"
