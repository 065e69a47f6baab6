"""The setting of copies queued by pointer ([Note: copies queued by pointer] in
``torchferry._core._transfer.driver``), read into the core's settings (``torchferry._public.env``); the copies themselves run in tests/gpu/test_driver_copies.py."""

from __future__ import annotations

import pytest

from torchferry._core._transfer import driver
from torchferry._public.env import DRIVER_ENV, core_settings


def test_copies_by_pointer_are_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv(DRIVER_ENV, raising=False)
    assert core_settings().driver_copies
    monkeypatch.setenv(DRIVER_ENV, "0")
    assert not core_settings().driver_copies
    assert driver.queue_for("h2d", object(), enabled=False) is None  # type: ignore[arg-type]  # off: no CUDA call
    monkeypatch.setenv(DRIVER_ENV, " 1 ")
    assert core_settings().driver_copies


@pytest.mark.parametrize("bad", ["maybe", "2", "enabled"])
def test_a_bad_setting_is_refused_naming_it(monkeypatch, bad):
    monkeypatch.setenv(DRIVER_ENV, bad)
    with pytest.raises(ValueError, match=f"TORCHFERRY_DRIVER_COPIES must be on .* got '{bad}'"):
        core_settings()
