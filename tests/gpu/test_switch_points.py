"""Switch points ([Note: switch points] in ``torchferry._core._transfer.switch``): a small copy
issued on another stream while a reload (or an offload) runs waits well under a millisecond, not
behind the whole queue. The engine behaviour this relies on is the driver's, so the same test
measures the copy with switch points turned off, interleaved: a driver that no longer needs them
(or no longer honours them) shows here. Bit-exactness with pieces is checked too."""

from __future__ import annotations

import pytest
import torch

from torchferry import Ferry
from torchferry.bench._common.latency import SmallCopyProbe, percentiles

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
STATE_BYTES = 8 << 30  # ~150 ms of copies at 55 GB/s: room for 24 probes inside one transfer
RATE = 50e9  # B/s, a low estimate of one direction's rate (the probes must land inside the transfer)


def _ferry() -> tuple[Ferry, list[torch.Tensor]]:
    torch.manual_seed(0)
    # Storages of 256 MiB: larger than a switch interval, and unit-sized for a 7B model.
    ts = [torch.randint(0, 255, (256 << 20,), dtype=torch.uint8, device=DEV) for _ in range(STATE_BYTES >> 28)]
    ferry = Ferry(*ts, pin_ahead=False)
    ferry.reserve_host()
    return ferry, ts


def _switch(ferry: Ferry, direction: str):
    return ferry._set.streams.switch(direction)  # the streams are the device's: one set of switch points each


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_a_small_copy_waits_under_half_a_millisecond_behind_a_transfer(direction):
    ferry, ts = _ferry()
    want = [t.clone() for t in ts]
    probe = SmallCopyProbe(DEV, direction)
    alone = percentiles(probe.alone())
    switch = _switch(ferry, direction)
    every = switch.every
    assert every > 0, "switch points are off (TORCHFERRY_SWITCH_BYTES=0)"
    with_sp: list[float] = []
    without: list[float] = []
    try:
        for rnd in range(4):  # interleaved: with, without, with, without
            switch.every = every if rnd % 2 == 0 else 0
            if direction == "h2d":
                ferry.offload().wait()
                lat = probe.during(ferry.reload, STATE_BYTES / RATE)
            else:
                lat = probe.during(ferry.offload, STATE_BYTES / RATE)
                ferry.reload()
            (with_sp if rnd % 2 == 0 else without).extend(lat)
            torch.cuda.synchronize()
            for t, w in zip(ts, want, strict=True):
                assert torch.equal(t, w)
    finally:
        switch.every = every
        if ferry.residency.on_host:
            ferry.reload()
        torch.cuda.synchronize()
        ferry.close()
    got, off = percentiles(with_sp), percentiles(without)
    print(f"{direction}: alone {alone}, with switch points {got}, without {off}")
    assert got["p90"] <= 0.5, (alone, got, off)
    # Without them the copy waits behind far more of the queue (6.9 ms to the whole transfer,
    # measured): if this fails, the driver interleaves by itself and the pieces cost for nothing.
    assert off["p50"] >= 4 * max(got["p50"], 0.05), (alone, got, off)


def test_switch_points_keep_the_line_rate():
    """Pieces and separators cost at most 2% of the one-direction rate (both measured here)."""
    ferry, ts = _ferry()
    switch_h2d, switch_d2h = _switch(ferry, "h2d"), _switch(ferry, "d2h")
    every = switch_h2d.every
    secs: dict[bool, list[float]] = {True: [], False: []}
    try:
        for rnd in range(6):
            on = rnd % 2 == 0
            switch_h2d.every = switch_d2h.every = every if on else 0
            ferry.offload().wait()
            h = ferry.reload()
            h.wait()
            secs[on].append(h.seconds if h.seconds is not None else float("nan"))
    finally:
        switch_h2d.every = switch_d2h.every = every
        ferry.close()
    best_on, best_off = min(secs[True]), min(secs[False])
    rate_on, rate_off = STATE_BYTES / best_on / 1e9, STATE_BYTES / best_off / 1e9
    print(f"reload {rate_on:.1f} GB/s with switch points, {rate_off:.1f} without")
    assert best_on <= best_off * 1.02, secs
