"""The setting of copies queued by pointer ([Note: copies queued by pointer] in
``torchferry._core._transfer.driver``); the copies themselves run in tests/gpu/test_driver_copies.py."""

from __future__ import annotations

import pytest

from torchferry._core._transfer import driver


def test_copies_by_pointer_are_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv(driver.DRIVER_ENV, raising=False)
    assert driver.enabled()
    monkeypatch.setenv(driver.DRIVER_ENV, "0")
    assert not driver.enabled()
    assert driver.queue_for("h2d", object()) is None  # type: ignore[arg-type]  # switched off: no CUDA call
    monkeypatch.setenv(driver.DRIVER_ENV, " 1 ")
    assert driver.enabled()


@pytest.mark.parametrize("bad", ["maybe", "2", "enabled"])
def test_a_bad_setting_is_refused_naming_it(monkeypatch, bad):
    monkeypatch.setenv(driver.DRIVER_ENV, bad)
    with pytest.raises(ValueError, match=f"TORCHFERRY_DRIVER_COPIES must be on .* got '{bad}'"):
        driver.enabled()
