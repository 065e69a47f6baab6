"""What every bench command does the same way around its run: one-line refusals, progress (a bar on
a terminal, plain lines in a log or a pipe), its notes, the results JSON, and the words that stand in
for transfer figures on a machine without a GPU."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from .paths import check_output_path, write_json_or_fallback

__all__ = ["NO_GPU", "CommandError", "check_paths", "on_rank0", "print_notes", "progress", "require",
           "run_with_progress", "stdout_console", "write_plot", "write_results"]

NO_GPU = "no transfer figures without a GPU"
"""Printed in place of transfer seconds, GB/s, exposures and ratios on a machine without CUDA: CPU
copies of a tiny model time Python overhead, not a link (the JSON holds ``null`` there)."""


class CommandError(Exception):
    """A refusal the command line prints as one line, ``error: <message>``, exiting with ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def check_paths(*checks: tuple[str, Path | None, bool, str]) -> None:
    """Refuses, before any work, an output path the command could not write.

    Args:
        checks: ``(option, path or None, prefix, example file name)`` per output option.

    Raises:
        CommandError: the first path that cannot be written (exit 2).
    """
    for option, path, prefix, example in checks:
        if path is None:
            continue
        try:
            check_output_path(option, path, prefix=prefix, example=example)
        except ValueError as e:
            raise CommandError(str(e)) from None


def require(command: str, *modules: str) -> None:
    """Raises :class:`CommandError` naming the first of ``modules`` that cannot be imported."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise CommandError(f"{command} needs {e.name or name}: pip install 'torchferry[bench]'") from None


@contextlib.contextmanager
def progress() -> Iterator[Callable[[str, float], None]]:
    """``on_progress(message, fraction)`` for a run, on stderr.

    On a terminal: a transient progress bar. Elsewhere (a log, a pipe): one plain
    line per new message, ``[ 40%] message``, flushed at once, so that a long run
    shows where it is.
    """
    from rich.console import Console

    console = Console(stderr=True)
    if console.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task("starting", total=1.0)
            yield lambda msg, frac: bar.update(task, description=msg, completed=frac)
        return
    last: list[str | None] = [None]

    def line(msg: str, frac: float) -> None:
        if msg != last[0]:
            last[0] = msg
            print(f"[{frac:4.0%}] {msg}", file=sys.stderr, flush=True)

    yield line


def run_with_progress(run: Callable[..., dict], config: object) -> dict:
    """``run(config, on_progress=...)`` under :func:`progress`; a ``ValueError`` it raises (a preset that
    needs a GPU, more ranks than GPUs...) becomes a :class:`CommandError`."""
    try:
        with progress() as say:
            return run(config, on_progress=say)
    except ValueError as e:
        raise CommandError(str(e)) from None


def on_rank0() -> bool:
    """Whether this process prints and writes the results: rank 0, or the only process."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def stdout_console(width: int):
    """A ``rich`` console on stdout; in a log or a pipe ``width`` columns wide, so that a table keeps
    one line per row."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=width)


def print_notes(notes: list[str]) -> None:
    """Each of the run's notes on stderr, ``note: ...``, unwrapped."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)


def write_plot(draw: Callable[[dict, Path], None], result: dict, path: Path | None) -> bool:
    """Draws the results' PNG with ``draw(result, path)`` (when asked) and says where on stderr; ``False``
    if it could not be written."""
    if path is None:
        return True
    try:
        draw(result, path)
    except OSError as e:
        print(f"error: --plot {path}: could not write it ({e.strerror or e})", file=sys.stderr)
        return False
    print(f"wrote {path}", file=sys.stderr)
    return True


def write_results(result: dict, json_path: Path | None) -> bool:
    """Writes the results JSON (when asked) and says where on stderr; ``False`` if ``json_path`` could
    not be written (the results are then in a temporary file, named in the error line)."""
    if json_path is None:
        return True
    written, error = write_json_or_fallback(result, json_path)
    if error:
        print(f"error: --json {json_path}: could not write it ({error}); the results are in {written}",
              file=sys.stderr)
        return False
    print(f"wrote {written}", file=sys.stderr)
    return True
