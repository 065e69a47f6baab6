"""Bad arguments at the public entries (``_api/args.py`` and the checks that use it): each is refused
in one line that starts with "torchferry: " and names the problem, before anything moves.

Found by trying the API as a new user would: ``Ferry(m, device="gpu")`` answered with
torch's list of device types, ``swap(f, "x")`` with ``'str' object has no attribute 'device'``,
and ``Ferry(nn.Linear(64, 64)).offload()`` with a "garbage collected" that did not say the
ferry holds its targets weakly.
"""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import torch
from torch import nn

import torchferry
from torchferry import Dock, Ferry, Prefetch, Residency, TransferHandle


@pytest.fixture
def setup():
    torch.manual_seed(0)
    m, other, docked = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    f, g = Ferry(m, device="cpu"), Ferry(other, device="cpu")
    f.offload()
    f.reload()
    dock = Dock(1 << 20)
    dock.add("a", Ferry(docked, device="cpu"))
    yield m, f, g, dock
    del other, docked  # held until the test ends: a ferry holds its modules weakly


CASES = [
    # (what is called, the exception, the message)
    ("Ferry(device='gpu')", lambda m, f, g, d: Ferry(nn.Linear(2, 2), device="gpu"), ValueError,
     r"Ferry\(device=\.\.\.\): 'gpu' is not a device; accepted: 'cpu', 'cuda', 'cuda:N', a torch.device, or None"),
    ("Ferry(device='cuda:x')", lambda m, f, g, d: Ferry(nn.Linear(2, 2), device="cuda:x"), ValueError,
     r"'cuda:x' is not a device"),
    ("Ferry(device='cpu:1')", lambda m, f, g, d: Ferry(nn.Linear(2, 2), device="cpu:1"), ValueError,
     r"Ferry\(device=\.\.\.\): 'cpu:1' is not a device \(the host is 'cpu'\)"),
    ("Dock(device=cpu:1)", lambda m, f, g, d: Dock(1 << 20, device=torch.device("cpu", 1)), ValueError,
     r"Dock\(device=\.\.\.\): 'cpu:1' is not a device"),
    ("Ferry(device=1.5)", lambda m, f, g, d: Ferry(nn.Linear(2, 2), device=1.5), TypeError,
     r"Ferry\(device=\.\.\.\) takes 'cpu', 'cuda', .*; got float 1\.5"),
    ("swap(f, 'x')", lambda m, f, g, d: torchferry.swap(f, "x"), TypeError,
     r"swap\(into=\.\.\.\) must be a torchferry\.Ferry, got str 'x'"),
    ("swap(module, f)", lambda m, f, g, d: torchferry.swap(m, f), TypeError,
     r"swap\(out=\.\.\.\) must be a torchferry\.Ferry, got Linear"),
    ("swap(gpu_budget_bytes='1GB')", lambda m, f, g, d: torchferry.swap(f, g, gpu_budget_bytes="1GB"), ValueError,
     r"swap\(gpu_budget_bytes=\.\.\.\) must be an int >= 0 \(bytes\) or None, got str '1GB'"),
    ("swap(gpu_budget_bytes=1.5)", lambda m, f, g, d: torchferry.swap(f, g, gpu_budget_bytes=1.5), ValueError,
     r"got float 1\.5"),
    ("swap(f, f)", lambda m, f, g, d: torchferry.swap(f, f), ValueError, r"swap: out and into are the same ferry"),
    ("reserve_host(background=numpy.bool_)", lambda m, f, g, d: f.reserve_host(background=np.bool_(True)), TypeError,
     r"reserve_host\(background=\.\.\.\) must be True or False, got numpy\.bool_? (np\.)?True_?$"),
    ("reserve_host(background='yes')", lambda m, f, g, d: f.reserve_host(background="yes"), TypeError,
     r"reserve_host\(background=\.\.\.\) must be True or False, got str 'yes'"),
    ("Prefetch(lookahead_bytes='1GB')", lambda m, f, g, d: Prefetch(lookahead_bytes="1GB"), ValueError,
     r"Prefetch: lookahead_bytes must be an int >= 0 \(bytes\) or None, got '1GB'"),
    ("wait_stream('s')", lambda m, f, g, d: f.last_handle.wait_stream("s"), TypeError,
     r"wait_stream\(stream\) must be a torch\.cuda\.Stream, got str 's'"),
    ("add_done_callback(1)", lambda m, f, g, d: TransferHandle("d2h", 0, None).add_done_callback(1), TypeError,
     r"add_done_callback\(fn\) must be callable, got int 1"),
    ("Dock(device='gpu')", lambda m, f, g, d: Dock(1 << 20, device="gpu"), ValueError,
     r"Dock\(device=\.\.\.\): 'gpu' is not a device"),
    ("Dock.use(['a'])", lambda m, f, g, d: d.use(["a"]).__enter__(), TypeError,
     r"Dock\.use\(\) takes names as separate str arguments \(dock\.use\('a', 'b'\)\), got list"),
    ("Dock.require(1)", lambda m, f, g, d: d.require(1), TypeError, r"Dock\.require\(\) takes names as separate str"),
    ("Dock.plan(5)", lambda m, f, g, d: d.plan(5), TypeError,
     r"Dock\.plan\(\) takes a Schedule, a list of phases .* or None, got int 5"),
    ("Dock.add_claimant(sleep=1)", lambda m, f, g, d: d.add_claimant("kv", 8, sleep=1, wake=lambda: None), TypeError,
     r"Dock\.add_claimant\(sleep=\.\.\.\) must be callable, got int 1"),
]


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_argument_is_refused_in_one_torchferry_line_and_changes_nothing(setup, call, exc, match):
    m, f, g, dock = setup
    want = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(exc, match="^torchferry: .*" + match) as info:
        call(m, f, g, dock)
    assert "\n" not in str(info.value)
    assert f.residency is Residency.DEVICE and g.residency is Residency.DEVICE
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
    assert dock.in_use == frozenset() and dock.is_resident("a")
    g.offload()  # both ferries, and the dock, still work
    torchferry.swap(f, g)
    torchferry.swap(g, f)
    g.reload()
    assert f.residency is Residency.DEVICE and all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
    with dock.use("a"):
        pass


def test_dock_add_of_a_non_ferry_is_refused_by_type(setup):
    m, _, _, dock = setup
    with pytest.raises(TypeError, match=r"'b' must be a torchferry\.Ferry, got Linear"):
        dock.add("b", m)


@pytest.mark.parametrize("make, kind", [
    (lambda: nn.Linear(64, 64), "a Linear module"),
    (lambda: torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1), "a SGD optimizer"),
])
def test_a_collected_target_is_named_with_how_to_keep_it(make, kind):
    """``Ferry(nn.Linear(64, 64)).offload()``: the ferry holds its modules and optimizers weakly."""
    keep = nn.Linear(2, 2)
    ferry = Ferry(keep, make(), device="cpu")
    gc.collect()
    with pytest.raises(RuntimeError, match=rf"^torchferry: targets\[1\] \({kind}\) of this ferry was garbage "
                                           r"collected: a ferry holds its modules and optimizers by weak "
                                           r"reference, so keep a reference to it") as info:
        ferry.offload()
    assert "\n" not in str(info.value)
    assert ferry.residency is Residency.DEVICE and keep.weight.device.type == "cpu"


def test_public_signatures_name_no_private_type():
    """Every annotation of a public class's public methods and of ``swap`` names only public types
    (``offload(schedule=ReleaseSchedule)`` used to: swap now hands its schedule to private entry
    points, and a user gets Python's own error for an unknown argument)."""
    import inspect
    import re

    import torchferry._core as core

    private = set()
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith(core.__name__):
            private |= {n for n, v in vars(mod).items() if inspect.isclass(v) and v.__module__ == mod.__name__}
    private -= set(torchferry.__all__)
    found = []
    for name in torchferry.__all__:
        obj = getattr(torchferry, name)
        members = [obj] if not inspect.isclass(obj) else [  # a torchferry base's methods too (Ferry's HostSide)
            m for c in obj.__mro__ if c.__module__.startswith("torchferry") for n, m in vars(c).items()
            if (not n.startswith("_") or n == "__init__") and callable(m)]
        for fn in members:
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                continue
            text = " ".join(str(p.annotation) for p in sig.parameters.values()) + " " + str(sig.return_annotation)
            found += [f"{name}.{getattr(fn, '__name__', fn)}: {w}" for w in set(re.findall(r"\w+", text)) & private]
    assert not found, found
    with pytest.raises(TypeError, match="schedule"):
        torchferry.Ferry(nn.Linear(2, 2), device="cpu").offload(schedule=None)  # type: ignore[call-arg]


def test_environment_settings_are_parsed_in_one_place(monkeypatch):
    from torchferry._core._api.args import check_optional_bool
    from torchferry._public.env import env_flag, env_int

    monkeypatch.delenv("TORCHFERRY_X", raising=False)
    assert env_flag("TORCHFERRY_X", True) and not env_flag("TORCHFERRY_X", False)
    assert env_int("TORCHFERRY_X", 7, says="an integer") == 7
    for raw, want in ((" 1 ", True), ("0", False), ("", True)):
        monkeypatch.setenv("TORCHFERRY_X", raw)
        assert env_flag("TORCHFERRY_X", True) is want
    monkeypatch.setenv("TORCHFERRY_X", "maybe")
    with pytest.raises(ValueError, match="TORCHFERRY_X must be on .* got 'maybe'"):
        env_flag("TORCHFERRY_X", True)
    monkeypatch.setenv("TORCHFERRY_X", "12")
    assert env_int("TORCHFERRY_X", 0, hi=12, says="in [0, 12]") == 12
    for bad in ("13", "-1", "1.5"):
        monkeypatch.setenv("TORCHFERRY_X", bad)
        with pytest.raises(ValueError, match=f"TORCHFERRY_X must be in \\[0, 12\\], got '{bad}'"):
            env_int("TORCHFERRY_X", 0, hi=12, says="in [0, 12]")
    check_optional_bool(None, "x")
    check_optional_bool(False, "x")
    with pytest.raises(TypeError, match="x must be True, False or None, got int 1"):
        check_optional_bool(1, "x")


def test_a_closed_docks_calls_say_it_is_closed_not_that_the_names_are_unknown():
    """Before: ``use("a")`` on a closed dock said "unknown names ['a']; registered: []"."""
    from torchferry import Dock

    d = Dock(10**6)
    model = torch.nn.Linear(4, 4)
    d.add("a", Ferry(model))
    d.close()
    for call in (lambda: d.use("a").__enter__(), lambda: d.evict("a"), lambda: d.prefetch("a"),
                 lambda: d.plan([["a"]]), lambda: d.resize("a", 1)):  # before: "unknown names", "not a claimant"
        with pytest.raises(RuntimeError, match=r"^torchferry: Dock\.\w+: this dock is closed; make a new Dock$"):
            call()


def test_ferry_for_names_what_it_takes():
    from torchferry.integrations.verl import ferry_for

    with pytest.raises(TypeError, match=r"^torchferry: ferry_for\(\) takes the nn\.Module or torch\.optim\."
                                        r"Optimizer given to the helpers, got str$"):
        ferry_for("x")
    assert ferry_for(torch.nn.Linear(2, 2)) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_a_cuda_dock_or_device_index_without_cuda_is_refused_at_once():
    from torchferry import Dock

    with pytest.raises(ValueError, match=r"^torchferry: Dock: device cuda was asked for, but CUDA is not available$"):
        Dock(10**6, device="cuda")
    with pytest.raises(ValueError, match=r"device index 0 needs an accelerator, and none is available; accepted"):
        Ferry(torch.nn.Linear(2, 2), device=0)
    with pytest.raises(ValueError, match=r"device index -1 is negative; accepted"):
        Ferry(torch.nn.Linear(2, 2), device=-1)
