"""Output paths of the ``torchferry`` command: checked before any work, written without losing results.

A bench runs for minutes; a path it cannot write must be refused before the
run starts, with one line naming the problem, not after it with a traceback.
``os.access`` is no test (as root it says yes to ``/proc``), so the check
creates and removes a temporary file where the output will go.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

__all__ = ["check_output_path", "write_json", "write_json_or_fallback"]

_REASONS: dict[int | None, str] = {
    errno.ENOENT: "its file system takes no new files",  # /proc and the like
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
}


def _reason(e: OSError) -> str:
    return _REASONS.get(e.errno, e.strerror or str(e))


# What matplotlib's savefig writes without extra packages (its default backends).
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp", ".pgf", ".svgz",
                  ".raw", ".rgba")


def check_output_path(option: str, path: str | Path, *, prefix: bool = False, example: str = "bench.json") -> None:
    """Checks that the command can write ``path`` (or, with ``prefix``, files named ``path.<suffix>``).

    The nearest existing folder above the file must be a folder where files
    can be created (missing folders below it are created when writing); the
    path itself must not be a folder; an existing file must be writable.
    Nothing is left behind.

    Args:
        option: the option's name, for the message (``"--json"``).
        path: the path given.
        prefix: ``path`` is a prefix of several files, not a file.
        example: a file name to suggest when ``path`` is a folder; a ``.png`` one makes ``path``
            an image too, whose suffix must be one of :data:`IMAGE_SUFFIXES`.

    Raises:
        ValueError: a one-line message naming the option, the path and the problem.
    """
    text = str(path)
    p = Path(os.path.abspath(os.path.expanduser(text)))
    if not prefix and Path(example).suffix == ".png" and p.suffix.lower() not in IMAGE_SUFFIXES \
            and not (text.endswith(os.sep) or p.is_dir()):
        raise ValueError(f"{option} {text}: matplotlib cannot write {p.suffix or 'files without a suffix'!r}; "
                         f"name a {', '.join(IMAGE_SUFFIXES[:3])} file, e.g. {option} {example}")
    if text.endswith(os.sep) or p.is_dir():
        if prefix:
            raise ValueError(f"{option} {text}: is a folder; {option} takes a path prefix "
                             f"(files PREFIX.<strategy>.json.gz, ...), e.g. {option} {os.path.join(text, 'trace')}")
        raise ValueError(f"{option} {text}: is a folder; give a file name, e.g. {option} {os.path.join(text, example)}")
    if p.exists() and not prefix:
        try:
            with open(p, "ab"):
                pass
        except OSError as e:
            raise ValueError(f"{option} {text}: cannot write this file ({_reason(e)})") from None
        return
    folder = p.parent
    ancestor = folder
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{option} {text}: {ancestor} is a file, not a folder")
    try:
        fd, tmp = tempfile.mkstemp(dir=ancestor, prefix=".torchferry-write-check-")
    except OSError as e:
        if ancestor == folder:
            raise ValueError(f"{option} {text}: cannot create files in {folder} ({_reason(e)})") from None
        raise ValueError(f"{option} {text}: folder {folder} does not exist and cannot be made in "
                         f"{ancestor} ({_reason(e)})") from None
    os.close(fd)
    os.unlink(tmp)


def write_json(result: dict, path: str | Path) -> None:
    """Writes ``result`` to ``path`` as indented JSON, creating missing folders.

    Raises:
        OSError: the file could not be written.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def write_json_or_fallback(result: dict, path: str | Path) -> tuple[Path, str | None]:
    """Writes ``result`` as JSON to ``path``; if that fails, to a temporary file instead.

    Args:
        result: the results (JSON-serialisable).
        path: where to write (missing folders are created).

    Returns:
        ``(written, error)``: the path written and ``None``, or, when ``path``
        could not be written, the temporary file holding the results and the
        reason ``path`` failed.
    """
    try:
        write_json(result, path)
        return Path(path), None
    except OSError as e:
        fd, tmp = tempfile.mkstemp(prefix="torchferry-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1)
        return Path(tmp), _reason(e)
