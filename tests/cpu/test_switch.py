"""Switch points on the CPU: the pieces a bulk copy is cut into, where the separators go (counted
across copies, as the engine sees one queue), the bytes exact; the environment setting."""

from __future__ import annotations

import pytest
import torch

from torchferry._core._transfer import switch as switch_mod
from torchferry._core._transfer.switch import D2H_SWITCH_BYTES, SWITCH_BYTES, SwitchPoints, interval


def _points(every: int, monkeypatch) -> tuple[SwitchPoints, list[int]]:
    sp = SwitchPoints(torch.device("cpu"), "h2d", every=every)
    at: list[int] = []  # bytes copied so far at each separator
    copied = {"n": 0}
    real_copy = torch.Tensor.copy_

    def counting_copy(dst, src, non_blocking=False):
        copied["n"] += src.numel()
        return real_copy(dst, src)

    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    monkeypatch.setattr(sp, "_separate", lambda d, s: at.append(copied["n"]))
    return sp, at


def test_a_copy_is_cut_at_every_switch_interval_across_calls(monkeypatch):
    sp, at = _points(10, monkeypatch)
    srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (25, 3, 7, 40)]
    dsts = [torch.zeros_like(s) for s in srcs]
    for d, s in zip(dsts, srcs, strict=True):
        sp.copy(d, s)
    monkeypatch.undo()
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s)
    assert at == [10, 20, 30, 40, 50, 60, 70]  # 75 bytes in all: every 10, whatever the storage


def test_the_separator_copies_the_pieces_first_bytes_again():
    sp = SwitchPoints(torch.device("cpu"), "h2d", every=4096)
    src = torch.randint(0, 255, (10000,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    sp.copy(dst, src)
    assert torch.equal(dst, src) and sp.separators == 2  # after 4096 and 8192 bytes; nothing else written


def test_switch_points_off_copy_whole(monkeypatch):
    sp, at = _points(0, monkeypatch)
    src = torch.arange(100, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    sp.copy(dst, src)
    monkeypatch.undo()
    assert torch.equal(dst, src) and at == []


def test_the_environment_sets_the_interval(monkeypatch):
    """``TORCHFERRY_SWITCH_BYTES``, read into the core's settings, sets both directions' interval of a device's
    streams (``streams_for``); unset, each direction's measured one."""
    from torchferry._core._transfer.streams import TransferStreams
    from torchferry._public.env import SWITCH_ENV, core_settings

    monkeypatch.delenv(SWITCH_ENV, raising=False)
    assert core_settings().switch_bytes is None
    assert interval("h2d", None) == SWITCH_BYTES  # on by default, at the measured interval
    assert SwitchPoints(torch.device("cuda"), "h2d").every == SWITCH_BYTES
    assert interval("d2h", None) == SwitchPoints(torch.device("cuda"), "d2h").every == D2H_SWITCH_BYTES == 32 << 20
    assert SwitchPoints(torch.device("cpu"), "h2d").every == 0  # no copy engine to share
    monkeypatch.setenv(SWITCH_ENV, str(SWITCH_BYTES))
    assert core_settings().switch_bytes == SWITCH_BYTES == 16 << 20
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert core_settings().switch_bytes == 0 and interval("h2d", 0) == 0
    monkeypatch.setenv(SWITCH_ENV, "1048576")
    streams = TransferStreams(torch.device("cuda"), core_settings().switch_bytes)
    assert streams.switch("d2h").every == streams.switch("h2d").every == 1 << 20
    streams.set_switch_bytes(None)  # a ferry made with the default: the points made already follow
    assert (streams.switch("h2d").every, streams.switch("d2h").every) == (SWITCH_BYTES, D2H_SWITCH_BYTES)
    assert TransferStreams(torch.device("cpu"), 1 << 20).switch("h2d").every == 0
    for bad in ("-1", "16M", "1.5"):
        monkeypatch.setenv(SWITCH_ENV, bad)
        with pytest.raises(ValueError, match="TORCHFERRY_SWITCH_BYTES=.* is not a number of bytes"):
            core_settings()


def test_a_direction_is_h2d_or_d2h():
    with pytest.raises(ValueError, match="direction must be 'h2d' or 'd2h'"):
        SwitchPoints(torch.device("cpu"), "up")


def test_copies_by_pointer_are_cut_as_copies_are_and_counted_with_them():
    sp = SwitchPoints(torch.device("cpu"), "h2d", every=10)
    calls: list[tuple[int, int, int]] = []
    sp.copy_by_pointer(lambda d, s, n: calls.append((d, s, n)), 1000, 5000, 25)
    assert calls == [(1000, 5000, 10), (1000, 5000, 10), (1010, 5010, 10), (1010, 5010, 10), (1020, 5020, 5)]
    assert sp.separators == 2
    src = torch.arange(12, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    sp.copy(dst, src)  # 5 bytes since the last switch point: one after 5 more, whichever path queued them
    assert torch.equal(dst, src) and sp.separators == 3
    calls.clear()
    sp.copy_by_pointer(lambda d, s, n: calls.append((d, s, n)), 0, 64, 4)
    assert calls == [(0, 64, 3), (0, 64, 3), (3, 67, 1)] and sp.separators == 4
    off = SwitchPoints(torch.device("cpu"), "d2h", every=0)
    calls.clear()
    off.copy_by_pointer(lambda d, s, n: calls.append((d, s, n)), 7, 9, 1 << 30)
    assert calls == [(7, 9, 1 << 30)] and off.separators == 0


def test_whole_copies_skip_the_pieces_in_this_thread_only():
    """[Note: whole copies where the caller waits]: under ``whole_copies()`` a copy is one piece with
    no separator, by tensor and by pointer; another thread, and the same thread after it, cut pieces."""
    import threading

    from torchferry._core._transfer.switch import whole_copies

    sp = SwitchPoints(torch.device("cpu"), "d2h", every=64)
    src = torch.arange(256, dtype=torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8)
    queued: list[tuple[int, int, int]] = []
    with whole_copies():
        sp.copy(dst, src)
        sp.copy_by_pointer(lambda d, s, n: queued.append((d, s, n)), 1000, 2000, 256)
        assert sp.separators == 0 and queued == [(1000, 2000, 256)] and torch.equal(dst, src)
        seen: list[int] = []
        other = threading.Thread(target=lambda: (sp.copy(dst, src), seen.append(sp.separators)))
        other.start()
        other.join()
        assert seen and seen[0] > 0  # the ContextVar does not reach another thread
    n = sp.separators
    sp.copy(dst, src)
    assert sp.separators > n and torch.equal(dst, src)


def test_the_framework_helpers_move_under_whole_copies(monkeypatch):
    """The verl/SkyRL helpers' offloads and reloads run under ``whole_copies()`` (their caller waits)."""
    import contextlib

    from torch import nn

    from torchferry.integrations import _base
    from torchferry.integrations._base import helpers as _helpers

    entered: list[str] = []

    @contextlib.contextmanager
    def spy():
        entered.append("in")
        yield

    monkeypatch.setattr(_helpers, "whole_copies", spy)
    m = nn.Linear(8, 8)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    _base.offload_fsdp2_model_to_cpu(m)
    _base.offload_fsdp_optimizer(opt)
    _base.load_fsdp2_model_to_gpu(m)
    _base.load_fsdp_optimizer(opt, "cpu")
    assert entered == ["in"] * 4
