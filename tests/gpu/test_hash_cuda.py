"""GPU tier: the fused Triton hash of [Note: unchanged storages] (``_schedules/hash_triton``). Skipped without CUDA
or Triton."""

import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from torchferry._core._schedules.hash import hash_bytes  # noqa: E402
from torchferry._core._schedules.hash_triton import hash_segments  # noqa: E402

DEV = torch.device("cuda")
SIZES = [1, 7, 8, 9, 4099, (1 << 20) + 3, (8 << 20) + 5, 3 << 24]  # tails; pieces of several rows


def _bufs(sizes, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEV, generator=g) for n in sizes]


def _hash(bufs):
    return hash_segments([b.data_ptr() for b in bufs], [b.numel() for b in bufs], DEV)


def test_kernel_equals_the_torch_op_hash_and_itself():
    bufs = _bufs(SIZES)
    h = _hash(bufs)
    assert h.shape == (len(SIZES), 2) and h.dtype == torch.int64
    for b, x in zip(bufs, h):
        assert torch.equal(x, hash_bytes(b)), b.numel()  # the same math as the CPU/fallback path
    for _ in range(3):
        assert torch.equal(_hash(bufs), h)
    assert _hash([bufs[0][:0]]).tolist() == [[0, 0]]


def test_kernel_sees_a_single_bit_flip_anywhere():
    bufs = _bufs(SIZES, seed=1)
    base = _hash(bufs)
    g = torch.Generator().manual_seed(2)
    for k, b in enumerate(bufs):
        n = b.numel()
        # Random positions, the first byte, the last word, every tail byte.
        last_word = (n // 8 - 1) * 8
        positions = [0, n - 1, *range(n // 8 * 8, n)] + ([last_word, last_word + 7] if n >= 8 else [])
        positions += torch.randint(0, n, (24,), generator=g).tolist()
        for pos in positions:
            bit = int(torch.randint(0, 8, (1,), generator=g))
            b[pos] ^= 1 << bit
            h = _hash(bufs)
            assert (h[k] != base[k]).all(), (n, pos, bit)  # both 64-bit lanes
            others = [j for j in range(len(bufs)) if j != k]
            assert torch.equal(h[others], base[others])
            b[pos] ^= 1 << bit
    assert torch.equal(_hash(bufs), base)


def test_kernel_rate_printed():
    n = 4 << 30
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEV)
    _hash([buf])
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        _hash([buf])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(f"triton hash: {n / min(times) / 1e9:.0f} GB/s over {n / 2**30:.0f} GiB")


def test_reload_hash_beside_its_copies_covers_early_and_tail_storages(monkeypatch):
    """[Note: the reload's hash beside its copies]: the storages copied before the early event and
    the tail after it both join the baseline (an offload with no write copies nothing), and a write
    that bumps no version counter (through ``.data``) is seen in either part."""
    from torch import nn

    from torchferry import Ferry
    from torchferry._core._ferry import state_set

    seen = []
    issue = state_set.issue_h2d

    def spy(*a, **k):
        out = issue(*a, **k)
        seen.append(out.early)
        return out

    monkeypatch.setattr(state_set, "issue_h2d", spy)
    g = torch.Generator(device=DEV).manual_seed(3)
    params = nn.ParameterList([nn.Parameter(torch.randn(8 << 20, device=DEV, generator=g)) for _ in range(8)])
    ferry = Ferry(params, skip_unchanged=True)  # 8 x 32 MiB: the tail is 64 MiB, the last 2 storages
    ferry.offload().wait()
    ferry.reload()
    assert seen[-1] is not None and len(seen[-1][1]) == 6, seen[-1]
    ferry.offload().wait()
    assert ferry.stats.offload_bytes_copied == 0
    ferry.reload()
    for p in list(params)[:7]:  # one left alone: in whichever part it is, the other part has writes too
        p.data.add_(1.0)
    want = [p.detach().clone() for p in params]
    ferry.offload().wait()
    assert ferry.stats.offload_bytes_copied == 7 * (32 << 20)
    ferry.reload()
    torch.cuda.synchronize()
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p, w, atol=0, rtol=0)
