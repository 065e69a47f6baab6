"""Every ``TORCHFERRY_*`` variable parsed alike ([Note: one parser for the environment] in
``torchferry._public.env``): one set of spellings for on and off, a clear error naming the
variable and the value for anything else, and a bad value failing every time.

Reproduces: ``TORCHFERRY_VERL=false`` still installed the Ray hook's patch,
``TORCHFERRY_VERIFY_SKIPS=false`` turned verify mode on, and a bad ``TORCHFERRY_VERL_DOCK`` failed
only the first import of verl's helpers."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from torchferry import Ferry
from torchferry._public.env import (
    CORE_ENV, OFF, ON, core_settings, env_bytes, env_choice, env_flag, env_int, parse_flag,
)

ON_SPELLINGS = [s for on in ON for s in (on, on.upper(), on.capitalize(), f"  {on}\t")]
OFF_SPELLINGS = [s for off in OFF for s in (off, off.upper(), off.capitalize(), f" {off} ")]
BAD_FLAGS = ["2", "maybe", "enable", "y", "n", "1.0", "tru", "on off"]


@pytest.fixture(autouse=True)
def _no_torchferry_environment(monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("TORCHFERRY_")]:
        monkeypatch.delenv(k)


@pytest.mark.parametrize("raw", ON_SPELLINGS)
def test_every_spelling_of_on_reads_as_on(monkeypatch, raw):
    monkeypatch.setenv("TORCHFERRY_X", raw)
    assert env_flag("TORCHFERRY_X", False) is True
    assert parse_flag(raw, "TORCHFERRY_X", False) is True


@pytest.mark.parametrize("raw", OFF_SPELLINGS)
def test_every_spelling_of_off_reads_as_off(monkeypatch, raw):
    monkeypatch.setenv("TORCHFERRY_X", raw)
    assert env_flag("TORCHFERRY_X", True) is False


@pytest.mark.parametrize("raw", [None, "", "   "])
def test_an_unset_or_empty_switch_takes_its_default(monkeypatch, raw):
    if raw is None:
        monkeypatch.delenv("TORCHFERRY_X", raising=False)
    else:
        monkeypatch.setenv("TORCHFERRY_X", raw)
    assert env_flag("TORCHFERRY_X", True) is True
    assert env_flag("TORCHFERRY_X", False) is False


@pytest.mark.parametrize("raw", BAD_FLAGS)
def test_a_switch_neither_on_nor_off_is_refused_naming_the_variable_and_value(monkeypatch, raw):
    monkeypatch.setenv("TORCHFERRY_X", raw)
    with pytest.raises(ValueError, match=r"torchferry: TORCHFERRY_X must be on \(1, true, yes, on\) or off "
                                         rf"\(0, false, no, off\), got {raw!r}$"):
        env_flag("TORCHFERRY_X", True)


def _switch_readers():
    """(variable, what reads it now, its default) for every switch of the core (read into its settings, as
    ``Ferry()`` reads them) and the integrations."""
    from torchferry._core._transfer import arena
    from torchferry.integrations._base import read_switch

    return [
        ("TORCHFERRY_DRIVER_COPIES", lambda: core_settings().driver_copies, True),
        ("TORCHFERRY_VERIFY_SKIPS", lambda: core_settings().verify_skips, False),
        ("TORCHFERRY_RELOAD_ARENA", lambda: arena.arena_supported(core_settings()), True),
        ("TORCHFERRY_SKIP_UNCHANGED", lambda: read_switch("skip_unchanged"), True),
        ("TORCHFERRY_OPTIMIZER_AT_STEP", lambda: read_switch("optimizer_at_step"), False),
        ("TORCHFERRY_LAYERWISE_RELOAD", lambda: read_switch("layerwise_reload"), False),
    ]


@pytest.mark.parametrize("index", range(6))
def test_every_switch_of_torchferry_takes_every_spelling(monkeypatch, index):
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")  # the arena's other conditions
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    name, read, default = _switch_readers()[index]
    assert read() is default
    for raw in ON_SPELLINGS:
        monkeypatch.setenv(name, raw)
        assert read() is True, raw
    for raw in OFF_SPELLINGS:
        monkeypatch.setenv(name, raw)
        assert read() is False, raw
    for raw in BAD_FLAGS:
        monkeypatch.setenv(name, raw)
        with pytest.raises(ValueError, match=rf"torchferry: {name} must be on .* got {raw!r}"):
            read()


def test_verify_skips_false_leaves_verify_mode_off(monkeypatch):
    for raw in ("false", "no", "off", "FALSE"):
        monkeypatch.setenv("TORCHFERRY_VERIFY_SKIPS", raw)
        assert core_settings().verify_skips is False


def test_verl_fsdp1_switch_takes_every_spelling(monkeypatch):
    pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")
    from torchferry.integrations._base import FSDP1_ENV
    from torchferry.integrations.verl._patch import fsdp1_through_torchferry

    assert fsdp1_through_torchferry() is True
    for raw, want in [*((r, True) for r in ON_SPELLINGS), *((r, False) for r in OFF_SPELLINGS)]:
        monkeypatch.setenv(FSDP1_ENV, raw)
        assert fsdp1_through_torchferry() is want, raw
    monkeypatch.setenv(FSDP1_ENV, "sometimes")
    with pytest.raises(ValueError, match="TORCHFERRY_VERL_FSDP1 must be on .* got 'sometimes'"):
        fsdp1_through_torchferry()


def _fake_hook(monkeypatch, env_flag_name: str):
    """A WorkerHook over a stand-in helper module that is already imported: its patch runs at once."""
    from torchferry.integrations._base.ray_hook import HookNames, WorkerHook

    module = "torchferry_test_env_helpers"
    monkeypatch.setitem(sys.modules, module, type(sys)(module))
    calls: list[str] = []
    names = HookNames(framework="fake", integration="fake", module=module, hook_path="x.y",
                      env_flag=env_flag_name, next_hook_env=env_flag_name + "_NEXT_HOOK")
    return WorkerHook(names, patch=lambda: calls.append("patched"), is_patched=lambda: bool(calls)), calls


@pytest.mark.parametrize("flag", ["TORCHFERRY_VERL", "TORCHFERRY_SKYRL"])
def test_ray_hook_is_switched_off_by_every_spelling_of_off(monkeypatch, flag):
    for raw in OFF_SPELLINGS:
        monkeypatch.setenv(flag, raw)
        hook, calls = _fake_hook(monkeypatch, flag)
        hook.ray_worker_setup()
        assert calls == [], raw  # false / off / no install nothing, as 0 does
    for raw in [*ON_SPELLINGS, ""]:
        monkeypatch.setenv(flag, raw)
        hook, calls = _fake_hook(monkeypatch, flag)
        hook.ray_worker_setup()
        assert calls == ["patched"], raw
    monkeypatch.setenv(flag, "perhaps")
    hook, calls = _fake_hook(monkeypatch, flag)
    with pytest.raises(ValueError, match=rf"{flag} must be on .* got 'perhaps'"):
        hook.ray_worker_setup()
    assert calls == []


def test_the_integrations_hooks_read_their_own_switch():
    pytest.importorskip("verl.utils.fsdp_utils", reason="verl not installed")
    import torchferry.integrations.verl as verl_ray

    assert verl_ray._HOOK.names.env_flag == "TORCHFERRY_VERL"
    try:
        import torchferry.integrations.skyrl as skyrl_ray
    except ImportError:
        return
    assert skyrl_ray._HOOK.names.env_flag == "TORCHFERRY_SKYRL"


def test_a_failed_patch_fails_every_import_of_the_helper_module(monkeypatch, tmp_path):
    """Reproduces: the first import raised, the second succeeded unpatched."""
    from torchferry.integrations._base.ray_hook import HookNames, WorkerHook, _PatchOnImport

    module = "torchferry_test_env_fake_fsdp_utils"
    (tmp_path / f"{module}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    state = {"error": ValueError("torchferry: TORCHFERRY_VERL_DOCK: 'lots' is not a dock budget"), "patched": 0}

    def patch():
        if state["error"] is not None:
            raise state["error"]
        state["patched"] += 1

    names = HookNames(framework="fake", integration="fake", module=module, hook_path="x.y",
                      env_flag="TORCHFERRY_TEST_ENV_FLAG", next_hook_env="TORCHFERRY_TEST_ENV_NEXT")
    hook = WorkerHook(names, patch=patch, is_patched=lambda: state["patched"] > 0)
    try:
        hook.ray_worker_setup()
        for _ in range(3):
            with pytest.raises(ValueError, match="TORCHFERRY_VERL_DOCK: 'lots' is not a dock budget"):
                __import__(module)
            assert module not in sys.modules and state["patched"] == 0
        state["error"] = None  # the setting fixed: the next import patches
        assert __import__(module).VALUE == 1 and state["patched"] == 1
        assert not any(isinstance(f, _PatchOnImport) and f.module == module for f in sys.meta_path)
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _PatchOnImport) and f.module == module)]
        sys.modules.pop(module, None)


@pytest.mark.parametrize("name, raw, message", [
    ("TORCHFERRY_SWITCH_BYTES", "lots", r"TORCHFERRY_SWITCH_BYTES='lots' is not a number of bytes \(ASCII digits"),
    ("TORCHFERRY_SWITCH_BYTES", "-1", "TORCHFERRY_SWITCH_BYTES='-1' is not a number of bytes .*no sign"),
    ("TORCHFERRY_ISSUE_REFILL_BYTES", "2e30", r"TORCHFERRY_ISSUE_REFILL_BYTES='2e30' is not a number of bytes in "
                                              r"\[0, 1073741824\]"),
    ("TORCHFERRY_HOST_BUDGET_BYTES", "lots", "TORCHFERRY_HOST_BUDGET_BYTES='lots' is not a number of bytes"),
    ("TORCHFERRY_HOST_BUDGET_BYTES", "1.5", "TORCHFERRY_HOST_BUDGET_BYTES='1.5' is not a number of bytes"),
    ("TORCHFERRY_HOST_BUDGET_BYTES", "-5", "TORCHFERRY_HOST_BUDGET_BYTES='-5' is not a number of bytes"),
    ("TORCHFERRY_HOST_RESERVE_BYTES", "nan", "TORCHFERRY_HOST_RESERVE_BYTES='nan' is not a number of bytes"),
    ("TORCHFERRY_HASH", "cuda", r"TORCHFERRY_HASH must be one of auto, triton, torch \(or empty: auto\), got 'cuda'"),
    ("TORCHFERRY_DRIVER_COPIES", "yes please", "TORCHFERRY_DRIVER_COPIES must be on .* got 'yes please'"),
    ("TORCHFERRY_VERIFY_SKIPS", "2", "TORCHFERRY_VERIFY_SKIPS must be on .* got '2'"),
    ("TORCHFERRY_RELOAD_ARENA", "nope", "TORCHFERRY_RELOAD_ARENA must be on .* got 'nope'"),
])
def test_a_bad_core_setting_is_refused_at_ferry_before_anything_moves(monkeypatch, name, raw, message):
    t = torch.arange(10.0)
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=message):
        Ferry(t)
    assert torch.equal(t, torch.arange(10.0))
    monkeypatch.delenv(name)
    ferry = Ferry(t)
    ferry.offload()
    ferry.reload()
    assert torch.equal(t, torch.arange(10.0))


def test_numbers_and_names_take_their_documented_forms(monkeypatch):
    monkeypatch.setenv("TORCHFERRY_X", " 40e9 ")
    assert env_bytes("TORCHFERRY_X") == 40_000_000_000
    monkeypatch.setenv("TORCHFERRY_X", "1024")
    assert env_bytes("TORCHFERRY_X") == 1024 and env_int("TORCHFERRY_X", 0, says="n") == 1024
    monkeypatch.setenv("TORCHFERRY_X", "")
    assert env_bytes("TORCHFERRY_X") is None and env_int("TORCHFERRY_X", 7, says="n") == 7
    assert env_choice("TORCHFERRY_X", ("auto", "torch"), "auto") == "auto"
    monkeypatch.setenv("TORCHFERRY_X", " Torch ")
    assert env_choice("TORCHFERRY_X", ("auto", "torch"), "auto") == "torch"
    from torchferry._core._schedules.hash import hash_kind

    monkeypatch.setenv("TORCHFERRY_HASH", "TORCH")
    assert core_settings().hash == "torch"
    assert hash_kind(torch.device("cuda"), core_settings().hash) == "torch"
    monkeypatch.setenv("TORCHFERRY_HASH", "sha256")
    with pytest.raises(ValueError, match="TORCHFERRY_HASH must be one of .* got 'sha256'"):
        core_settings()


def _byte_count_readers():
    """Variable -> its value in the core's settings read now, as ``Ferry()`` reads them."""
    return {"TORCHFERRY_HOST_BUDGET_BYTES": lambda: core_settings().host_budget_bytes,
            "TORCHFERRY_HOST_RESERVE_BYTES": lambda: core_settings().host_reserve_bytes,
            "TORCHFERRY_SWITCH_BYTES": lambda: core_settings().switch_bytes,
            "TORCHFERRY_ISSUE_REFILL_BYTES": lambda: core_settings().issue_refill_bytes}


@pytest.mark.parametrize("name", list(_byte_count_readers()))
def test_every_byte_count_takes_the_same_forms(monkeypatch, name):
    """Byte counts were parsed two ways: ``1e6`` passed for the host budget and reserve but not for
    the switch and refill sizes, and ``int()`` let ``1_000``, ``-0`` and full-width digits through
    ([Note: one parser for byte counts] in ``torchferry._public.env``)."""
    import re

    read = _byte_count_readers()[name]
    for raw, want in (("1000", 1000), (" 1e6 ", 10**6), ("1E6", 10**6), ("1.5e3", 1500), ("0", 0), ("007", 7)):
        monkeypatch.setenv(name, raw)
        assert read() == want, raw
    for raw in ("1_000", "-0", "+5", "-1", "\uff10", "\u0661\u0662", "1.5", "1.", "1e-3", "1.25e1", "inf", "nan",
                "0x10", "1e999", "1 000", "lots", "1e6.0", "1e+6", "e6", "\u00b2"):
        monkeypatch.setenv(name, raw)
        with pytest.raises(ValueError, match=rf"torchferry: {name}={re.escape(repr(raw))} is not a number of bytes "
                                             r"\(ASCII digits"):
            read()


@pytest.mark.parametrize("raw", ["0", "off", "OFF", " false ", "no", "No", "", "0.0"])
def test_the_verl_dock_is_off_for_every_off_spelling_of_a_switch(monkeypatch, raw):
    """``TORCHFERRY_VERL_DOCK=0`` turned the dock off but ``off``/``false``/``no`` were refused."""
    from torchferry.integrations._base import DOCK_ENV, dock_budget as budget_spec

    monkeypatch.setenv(DOCK_ENV, raw)
    assert budget_spec(None) is None


def test_the_verl_dock_budget_is_a_byte_count_or_a_fraction(monkeypatch):
    from torchferry.integrations._base import DOCK_ENV, dock_budget as budget_spec

    for raw, want in (("40e9", 40 * 10**9), ("40000000000", 40 * 10**9), ("0.6", 0.6), ("1.0", 1.0)):
        monkeypatch.setenv(DOCK_ENV, raw)
        assert budget_spec(None) == want, raw
    for raw in ("on", "true", "40_000_000_000", "-40e9", "\uff14\uff10e9", "\uff10.\uff16", "inf", "1"):
        monkeypatch.setenv(DOCK_ENV, raw)
        with pytest.raises(ValueError, match="TORCHFERRY_VERL_DOCK: .* is not a dock budget"):
            budget_spec(None)


@pytest.mark.parametrize("raw", [" {tmp} ", "{tmp}"])
def test_the_ledger_folder_takes_spaces_around_it(monkeypatch, tmp_path, raw):
    from torchferry._public.env import ledger_dir

    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", raw.format(tmp=tmp_path))
    assert ledger_dir() == str(tmp_path)
    t = torch.arange(10.0)
    ferry = Ferry(t)
    ferry.offload()
    ferry.reload()
    assert torch.equal(t, torch.arange(10.0))
    assert (tmp_path / f"torchferry-host-{os.getuid()}.json").exists()


@pytest.mark.parametrize("raw", ["relative/folder", "{tmp}/not-made-yet", "{tmp}/a-file"])
def test_a_ledger_folder_the_ranks_cannot_share_is_refused_at_ferry(monkeypatch, tmp_path, raw):
    """A ledger file that cannot be opened makes each process check its own pools alone, silently: a
    typo in ``TORCHFERRY_LEDGER_DIR`` let the ranks of a node over-commit its memory together."""
    (tmp_path / "a-file").write_text("")
    value = raw.format(tmp=tmp_path)
    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", value)
    t = torch.arange(10.0)
    with pytest.raises(ValueError, match=rf"^torchferry: TORCHFERRY_LEDGER_DIR must be an absolute path to a "
                                         rf"folder .* got {re.escape(repr(value))}$"):
        Ferry(t)
    assert torch.equal(t, torch.arange(10.0))


@pytest.mark.parametrize("raw, want", [(" mod.fn ", "mod.fn"), ("a.b.fn", "a.b.fn"), ("", None), ("  ", None)])
def test_the_users_next_ray_hook_takes_spaces_around_it(monkeypatch, raw, want):
    from torchferry.integrations._base.settings import hook_env

    monkeypatch.setenv("TORCHFERRY_VERL_NEXT_HOOK", raw)
    assert hook_env("TORCHFERRY_VERL", "TORCHFERRY_VERL_NEXT_HOOK") == (True, want)


@pytest.mark.parametrize("raw", ["fn", ".fn", "mod.", "mod.not a name"])
def test_a_next_ray_hook_that_is_not_module_function_is_refused_naming_the_variable(monkeypatch, raw):
    """Before: ``importlib.import_module('')`` failed with "Empty module name", naming nothing."""
    from torchferry.integrations._base.settings import hook_env

    monkeypatch.setenv("TORCHFERRY_VERL_NEXT_HOOK", raw)
    with pytest.raises(ValueError, match=rf"^torchferry: TORCHFERRY_VERL_NEXT_HOOK must name a function as "
                                         rf"module.function, got {re.escape(repr(raw))}$"):
        hook_env("TORCHFERRY_VERL", "TORCHFERRY_VERL_NEXT_HOOK")


@pytest.mark.parametrize("integration, var, raw, refused", [
    ("verl", "TORCHFERRY_SKIP_UNCHANGED", "maybe", True), ("verl", "TORCHFERRY_LAYERWISE_RELOAD", "2", True),
    ("verl", "TORCHFERRY_VERL_DOCK", "10GB", True), ("skyrl", "TORCHFERRY_OPTIMIZER_AT_STEP", "yes please", True),
    ("skyrl", "TORCHFERRY_VERL_DOCK", "10GB", False),  # verl's dock: not SkyRL's setting
    ("skyrl", "TORCHFERRY_VERL_FSDP1", "maybe", False),  # verl's FSDP1 switch: SkyRL's patch() never reads it
    ("verl", "TORCHFERRY_VERL_FSDP1", "maybe", True),
])
def test_a_ray_workers_hook_refuses_a_bad_setting_before_patching(monkeypatch, integration, var, raw, refused):
    """The hook reads the settings' variables as ``patch()`` would: before, it returned normally and the
    framework's own import of its helpers failed instead, at that import and at every later one."""
    import importlib
    import sys

    mod = importlib.import_module(f"torchferry.integrations.{integration}")
    monkeypatch.setenv(mod.ENV_FLAG, "1")
    monkeypatch.setenv(var, raw)
    finders = list(sys.meta_path)
    monkeypatch.setattr(sys, "meta_path", finders)  # whatever the hook installs goes with the test
    if refused:
        with pytest.raises(ValueError, match=rf"^torchferry: {var}\b.*{re.escape(repr(raw))}"):
            mod.ray_worker_setup()
        assert sys.meta_path == finders and not mod.is_patched()  # nothing patched, nothing waiting
    else:
        try:
            mod.ray_worker_setup()
        finally:
            if mod.is_patched():  # the framework's helpers already imported here: patched at once
                mod.unpatch()


def test_skyrl_reads_only_its_own_switches_from_the_environment(monkeypatch):
    """SkyRL's hook and launcher check what its ``patch()`` reads: before, a bad verl-only
    ``TORCHFERRY_VERL_FSDP1`` (forwarded to every worker with the driver's settings) refused every worker."""
    from torchferry.integrations._base.settings import check_environment
    from torchferry.integrations.skyrl._patch import SWITCH_NAMES

    monkeypatch.setenv("TORCHFERRY_VERL_FSDP1", "maybe")
    assert SWITCH_NAMES == ("skip_unchanged", "optimizer_at_step", "layerwise_reload")
    check_environment(SWITCH_NAMES)
    with pytest.raises(ValueError, match=r"^torchferry: TORCHFERRY_VERL_FSDP1 must be on .* got 'maybe'$"):
        check_environment()


@pytest.mark.parametrize("launcher", ["torchferry.integrations.verl.main_ppo", "torchferry.integrations.skyrl.main_base"])
def test_a_launcher_refuses_a_bad_setting_in_one_line(launcher):
    """Before: a traceback of about twenty lines, the message on its last."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHFERRY_SKIP_UNCHANGED": "maybe"}
    p = subprocess.run([sys.executable, "-m", launcher, "trainer.x=1"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "torchferry: TORCHFERRY_SKIP_UNCHANGED must be on (1, true, yes, on) or off (0, false, no, off), got 'maybe'"]


def test_the_public_ferry_is_the_cores_with_its_settings_read_from_the_environment(monkeypatch, tmp_path):
    """``torchferry.Ferry`` (``_public/ferry``) has the core's signature and docstring and makes a core
    ``Ferry``; it reads the core's settings from the environment once, at ``Ferry()``, unless given them."""
    import inspect

    from torchferry._core._api.settings import CoreSettings
    from torchferry._core._ferry.ferry import Ferry as CoreFerry

    assert inspect.signature(Ferry.__init__) == inspect.signature(CoreFerry.__init__)
    assert Ferry.__doc__ == CoreFerry.__doc__ and Ferry.__module__ == "torchferry"
    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHFERRY_SWITCH_BYTES", "1e6")
    t = torch.arange(10.0)
    ferry = Ferry(t)
    assert isinstance(ferry, CoreFerry)
    assert ferry.settings == core_settings()
    assert ferry.settings.ledger_dir == str(tmp_path) and ferry.settings.switch_bytes == 10**6
    monkeypatch.setenv("TORCHFERRY_HASH", "not-a-hash")  # set after Ferry(): this ferry does not read it
    ferry.offload()
    ferry.reload()
    assert ferry.settings.hash == "auto" and torch.equal(t, torch.arange(10.0))
    given = CoreSettings(ledger_dir=str(tmp_path), verify_skips=True)
    assert Ferry(t, settings=given).settings is given  # the environment not read: its bad value unseen
    assert CoreFerry(t).settings == CoreSettings()  # the core's own class reads no environment
    with pytest.raises(TypeError, match=r"Ferry\(settings=\.\.\.\) must be a CoreSettings, got dict"):
        Ferry(t, settings={"hash": "torch"})  # type: ignore[arg-type]


def test_an_integrations_settings_carry_the_cores_read_at_patch(monkeypatch):
    from torchferry.integrations._base import Settings

    monkeypatch.setenv("TORCHFERRY_SWITCH_BYTES", "4096")
    settings = Settings.read({"skip_unchanged": None})
    assert settings.core == core_settings() and settings.core.switch_bytes == 4096
    monkeypatch.setenv("TORCHFERRY_SWITCH_BYTES", "lots")
    with pytest.raises(ValueError, match=r"TORCHFERRY_SWITCH_BYTES='lots' is not a number of bytes"):
        Settings.read({"skip_unchanged": None})


@pytest.mark.parametrize(("given", "error", "message"), [
    ({"hash": "sha256"}, ValueError, r"CoreSettings\(hash=\.\.\.\) must be one of auto, triton, torch"),
    ({"switch_bytes": -1}, ValueError, r"CoreSettings\(switch_bytes=\.\.\.\) must be an int >= 0"),
    ({"host_budget_bytes": 1.5}, ValueError, r"CoreSettings\(host_budget_bytes=\.\.\.\) must be an int >= 0"),
    ({"verify_skips": "yes"}, TypeError, r"CoreSettings\(verify_skips=\.\.\.\) must be True or False"),
    ({"ledger_dir": "relative"}, ValueError, r"CoreSettings\(ledger_dir=\.\.\.\) must be None or an absolute path"),
    # a folder the node's ranks could not share a ledger in (each would check alone, silently)
    ({"ledger_dir": "/no/such/folder"}, ValueError, r"ledger_dir=\.\.\.\) must be None or an absolute path to a folder"),
    ({"ledger_dir": __file__}, ValueError, r"ledger_dir=\.\.\.\) must be None or an absolute path to a folder"),
    ({"ledger_dir": "/tmp\0x"}, ValueError, r"ledger_dir=\.\.\.\) must be None or an absolute path to a folder"),
    ({"allocator_conf": None}, TypeError, r"CoreSettings\(allocator_conf=\.\.\.\) must be a str"),
])
def test_core_settings_given_by_hand_are_checked_when_made(given, error, message):
    from torchferry import CoreSettings

    with pytest.raises(error, match=message):
        CoreSettings(**given)


def test_a_refill_mark_above_the_window_is_refused_at_ferry():
    from torchferry import CoreSettings
    from torchferry._core._schedules.issuer import ISSUE_WINDOW_BYTES

    with pytest.raises(ValueError, match="refill mark must be in"):
        Ferry(torch.ones(3), settings=CoreSettings(issue_refill_bytes=ISSUE_WINDOW_BYTES + 1))


BYTE_VARS = ["TORCHFERRY_HOST_BUDGET_BYTES", "TORCHFERRY_HOST_RESERVE_BYTES", "TORCHFERRY_SWITCH_BYTES",
             "TORCHFERRY_ISSUE_REFILL_BYTES"]


@pytest.mark.parametrize("name", BYTE_VARS)
def test_a_byte_count_too_long_for_int_is_refused_naming_the_variable(monkeypatch, name):
    """More ASCII digits than ``int()`` converts (4,300): refused by torchferry naming the variable, every time
    (before: Python's "Exceeds the limit (4300 digits)", naming neither)."""
    assert name in CORE_ENV
    monkeypatch.setenv(name, "9" * 5000)
    for _ in range(2):
        with pytest.raises(ValueError, match=rf"^torchferry: {name}"):
            core_settings()
    t = torch.arange(4.0)
    with pytest.raises(ValueError, match=rf"^torchferry: {name}"):
        Ferry(t)
