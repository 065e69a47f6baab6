"""The ``torchferry`` command's rough edges: output paths checked before any work, help with
defaults, ``--version``, one-line errors. (The tiny bench end to end is in test_bench.py.)"""

import json
import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import torchferry
from torchferry.bench._common.paths import check_output_path, write_json_or_fallback
from torchferry.cli import app

runner = CliRunner()
WIDE = {"COLUMNS": "220", "TERM": "dumb"}  # rich: no wrapping inside the help table


def _invoke(*args):
    return runner.invoke(app, list(args), env=WIDE)


def _one_line_error(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    return lines[0]


def test_version():
    import torch

    r = _invoke("--version")
    assert r.exit_code == 0
    assert r.output.strip() == f"torchferry {torchferry.__version__} (torch {torch.__version__})"


def test_bench_help_shows_every_default_unescaped():
    r = _invoke("bench", "--help")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    # The preset's default is computed at run time; its text used to vanish as rich markup.
    assert "[default: (qwen2.5-1.5b on a GPU, tiny on the CPU)]" in text
    assert "[default: (512; 32 for tiny; 4096 for compute-rich)]" in text
    assert "[default: (1; 2 for compute-rich)]" in text and "[default: (1; 4 for compute-rich)]" in text
    for default in ("[default: 3]", "[default: 1.0]", "[default: swap]", "[default: interleaved]",
                    "[default: default]", "[default: (all four, in that order)]"):
        assert default in text, default


def test_bench_help_names_every_strategy_in_a_terminal_of_80_columns():
    """The valid --strategies names are listed, and no default is cut off ("torchfe…") in a narrow help."""
    from torchferry.bench.rl_step.config import STRATEGY_NAMES
    from torchferry.bench.rl_step.strategies import STRATEGIES

    assert tuple(STRATEGIES) == STRATEGY_NAMES  # the help's names are the strategies the bench runs
    r = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "80", "TERM": "dumb"})
    assert r.exit_code == 0 and "…" not in r.output, r.output
    text = " ".join(r.output.replace("│", " ").split())
    assert "Comma-separated, from blocking, seed, torchferry, torchferry+prefetch;" in text, text
    for command in ("bench-grpo", "bench-lora", "bench-pin"):
        r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80", "TERM": "dumb"})
        assert r.exit_code == 0 and "…" not in r.output, (command, r.output)


def test_top_level_help_gives_each_command_one_sentence():
    """Each command's line in ``torchferry --help`` is its docstring's first sentence, whole."""
    r = runner.invoke(app, ["--help"], env=WIDE)
    assert r.exit_code == 0
    lines = {ln.split("│")[1].split()[0]: " ".join(ln.split("│")[1].split()[1:])
             for ln in r.output.splitlines() if ln.startswith("│ bench")}
    assert set(lines) == {"bench", "bench-lora", "bench-pin", "bench-grpo"}, r.output
    assert all(text.endswith(".") for text in lines.values()), lines
    assert lines["bench-lora"] == "LoRA training with a frozen base: the seed's offload against torchferry's skip_unchanged."


def test_building_the_parser_and_help_imports_no_bench_machinery():
    """``torchferry --help`` and ``torchferry bench --help`` import nothing beyond the package itself: no
    model code, no plotting, no scenario, not even torch."""
    code = (
        "import sys; import torchferry; before = set(sys.modules)\n"
        "import typer.main; from torchferry.cli import app\n"
        "cmd = typer.main.get_command(app)\n"
        "for args in ([\"--help\"], [\"bench\", \"--help\"], [\"bench-grpo\", \"--help\"]):\n"
        "    try: cmd.main(args, prog_name=\"torchferry\", standalone_mode=False)\n"
        "    except SystemExit: pass\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print('NEW', ' '.join(new))\n"
        "print('TORCH_BEFORE', 'torch' in before)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "80"})
    assert p.returncode == 0, p.stderr[-3000:]
    new = next(ln for ln in p.stdout.splitlines() if ln.startswith("NEW")).split()[1:]
    heavy = [m for m in new if m.split(".")[0] in ("torch", "transformers", "matplotlib", "peft", "numpy")]
    assert not heavy, heavy
    scenario = [m for m in new if m.startswith("torchferry.bench.") and not m.endswith((".config", ".presets"))
                and m not in ("torchferry.bench.rl_step", "torchferry.bench.grpo", "torchferry.bench._common")]
    assert not scenario, scenario
    assert "TORCH_BEFORE False" in p.stdout  # `import torchferry` is lazy: the first public name loads torch
    assert "torch" not in new


def test_bench_pin_help_shows_defaults():
    r = _invoke("bench-pin", "--help")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "[default: 4.0]" in text and "[default: 8.0]" in text and "[default: 3.0]" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "--json", "/proc/x/y.json"],
         "error: --json /proc/x/y.json: folder /proc/x does not exist and cannot be made in /proc"),
        (["bench", "--json", "/proc/x.json"], "error: --json /proc/x.json: cannot create files in /proc"),
        (["bench", "--plot", "/proc/x.png"], "error: --plot /proc/x.png: cannot create files in /proc"),
        (["bench", "--trace", "/proc/t"], "error: --trace /proc/t: cannot create files in /proc"),
        (["bench", "--trace", "/proc/x/t"], "error: --trace /proc/x/t: folder /proc/x does not exist"),
        (["bench", "--trace", "/tmp", "--strategies", "seed"], "error: --trace /tmp: is a folder; --trace takes a path "
                                                               "prefix"),
        (["bench", "--trace", "t", "--strategies", "blocking,seed"],
         "error: --trace profiles the torchferry strategies, and --strategies blocking,seed has none"),
        (["bench-pin", "--json", "/proc/x/y.json"], "error: --json /proc/x/y.json: folder /proc/x does not exist"),
        (["bench", "--plot", "out.txt"], "error: --plot out.txt: matplotlib cannot write '.txt'; name a .png, .pdf, "
                                         ".svg file, e.g. --plot bench.png"),
        (["bench-grpo", "--plot", "timeline"], "error: --plot timeline: matplotlib cannot write 'files without a "
                                               "suffix'"),
    ],
)
def test_unwritable_output_is_refused_before_any_work(args, message):
    r = _invoke(*args)
    assert r.exit_code == 2, r.output
    assert _one_line_error(r).startswith(message)


@pytest.mark.parametrize("args, message", [
    (["bench-grpo", "--kv-gb", "inf"], "error: --kv-gb must be a finite number > 0, got inf"),
    (["bench-grpo", "--kv-gb", "1e400"], "error: --kv-gb must be a finite number > 0, got inf"),
    (["bench-grpo", "--budget-gb", "nan"], "error: --budget-gb must be a finite number > 0, got nan"),
    (["bench-grpo", "--budget-gb", "-1"], "error: --budget-gb must be a finite number > 0, got -1.0"),
    (["bench-grpo", "--kv-gb", "0"], "error: --kv-gb must be a finite number > 0, got 0.0"),
    (["bench", "--rollout-s", "-0.5"], "error: --rollout-s must be a finite number >= 0, got -0.5"),
    (["bench-pin", "--pin-gib", "inf"], "error: --pin-gib must be a finite number > 0, got inf"),
])
def test_a_number_out_of_range_is_refused_naming_the_option(args, message):
    r = _invoke(*args)
    assert r.exit_code == 2, r.output
    assert _one_line_error(r) == message


def test_folder_and_file_in_the_way(tmp_path):
    r = _invoke("bench", "--json", str(tmp_path))
    assert r.exit_code == 2
    assert _one_line_error(r) == (f"error: --json {tmp_path}: is a folder; give a file name, "
                                  f"e.g. --json {tmp_path / 'bench.json'}")
    (tmp_path / "f").write_text("")
    r = _invoke("bench", "--plot", str(tmp_path / "f" / "x.png"))
    assert r.exit_code == 2
    assert _one_line_error(r) == f"error: --plot {tmp_path / 'f' / 'x.png'}: {tmp_path / 'f'} is a file, not a folder"


def test_check_leaves_nothing_behind_and_accepts_missing_folders(tmp_path):
    check_output_path("--json", tmp_path / "a" / "b" / "r.json")
    check_output_path("--trace", tmp_path / "t", prefix=True)
    (tmp_path / "old.json").write_text("keep")
    check_output_path("--json", tmp_path / "old.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert (tmp_path / "old.json").read_text() == "keep"


def test_results_survive_a_write_that_fails_after_the_run():
    written, error = write_json_or_fallback({"schema": "x", "value": 1}, "/proc/x.json")
    try:
        assert error == "its file system takes no new files"
        assert json.loads(written.read_text()) == {"schema": "x", "value": 1}
    finally:
        written.unlink()


def test_bad_path_exits_in_seconds_with_one_line_no_traceback(tmp_path):
    """As a user runs it: a fresh process, the whole command."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "torchferry", "bench", "--json", "/proc/x/y.json"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    elapsed = time.perf_counter() - t
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "error: --json /proc/x/y.json: folder /proc/x does not exist and cannot be made in /proc "
        "(its file system takes no new files)"]
    assert elapsed < 30, elapsed  # the import of torch, no model, no bench


@pytest.mark.parametrize("args, message", [
    (["bench-pin", "--gib", "-1"], "error: torchferry bench-pin: No such option: --gib (Possible options: "
                                   "--first-gib, --pin-gib) (see torchferry bench-pin --help)"),
    (["bench", "--layers", "abc"], "error: torchferry bench: Invalid value for '--layers': "),
    (["nosuch"], "error: torchferry: No such command 'nosuch'. (see torchferry --help)"),
])
def test_a_usage_error_is_one_line_naming_it(args, message, monkeypatch, capsys):
    """Click's own usage errors (an unknown option or command, a value of the wrong type) printed a boxed,
    several-line usage; ``torchferry`` (its ``main()``) prints one line, exit 2."""
    from torchferry.cli import main

    monkeypatch.setattr(sys, "argv", ["torchferry", *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(message), err


def test_the_command_alone_shows_its_help_and_help_exits_0(monkeypatch, capsys):
    from torchferry.cli import main

    for args, code in (([], 2), (["bench-pin", "--help"], 0), (["--version"], 0)):
        monkeypatch.setattr(sys, "argv", ["torchferry", *args])
        with pytest.raises(SystemExit) as e:
            main()
        out = capsys.readouterr()
        assert e.value.code == code and ("Usage" in out.out + out.err or "torchferry " in out.out), (args, out)
