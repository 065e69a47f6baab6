#!/usr/bin/env python3
"""Triton nibble codec for bf16 state: lossless, fixed-size parts, one host sync per compress.

Used by ``probe_compress.py`` as the codec ``triton-nibble(bf16)`` (only where CUDA and Triton are
both present). Standalone self-test, on a GPU or on the CPU through Triton's interpreter::

    TRITON_INTERPRET=1 python benchmarks/codec_triton.py --selftest

Why this shape: a bf16 element is two bytes (little-endian). Its high byte is the sign and the 7 high
exponent bits: for weights it holds ~2.7 bits of entropy (probe_compress's entropy bound: 1.50x for
the whole element). Its low byte is the lowest exponent bit and the 7 mantissa bits: ~8 bits, moved
as is. Coding the high byte with 4-bit codes gives at most 2 / 1.5 = 1.33x, at memory speed, with no
variable-length stream and so no size to learn on the host.

Format of one tensor of ``n`` bf16 elements (``npairs = ceil(n / 2)``, ``nblocks = ceil(n / B)``),
all parts uint8 tensors on the device, sizes known from ``n`` alone:

* ``low``    ``2 * npairs`` bytes: the low byte of every element, in order (one pad byte for odd n).
* ``nibble`` ``npairs`` bytes: a 4-bit code per element, element ``2i`` in the low nibble of byte i,
  ``2i + 1`` in the high nibble. Codes 0..14 index the table; code 15 is an escape.
* ``esc``    ``nblocks * K`` bytes: per block of ``B`` elements, the high bytes of its first ``K``
  escaped elements in element order (unused slots are zero). No positions are stored: the decoder
  finds the r-th escape of a block as the r-th code 15 in its nibbles.
* ``table``  16 bytes: the 15 most frequent high bytes of this tensor (entry 15 unused).

Overflow (a block with more than ``K`` escapes, e.g. a vector of 1.0 norm weights inside a
tensor of small weights): after the encode kernel the codec reads one int32 from the device (the
number of such blocks; this is the codec's one host sync, acceptable in the probe) and, if it is not
zero, appends two parts: ``raw`` (``n_ovf * B`` bytes, the high bytes of those blocks) and
``blocks`` (``n_ovf`` int32 block indices, as bytes); the decoder patches those blocks afterwards.
If the patches would cost at least as much as the plain high-byte plane, the tensor is sent as
``[low, high plane]`` instead (ratio 1.0 on the high plane). ``meta = (n, mode, n_ovf)`` records which.

Every kernel runs on the current CUDA stream (Triton launches on ``torch.cuda.current_stream()``);
decompress has no host sync.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

__all__ = ["B", "K", "TritonNibble"]

B = 4096  # elements per block (one encode/decode program); a multiple of 2
K = 32  # escape slots per block: K / B = 0.8% of n in bytes. In N(0, sigma) bf16 tensors about 2e-4 of
# the elements escape (at most 6 per 4096-block over 4M elements, any sigma from 1e-3 to 1), so
# 32 leaves room for heavier-tailed trained weights; a block beyond it is patched, not lost.
NCODES = 15  # table codes 0..14
ESC = 15  # the escape code
HIST_PAIRS = 2048  # element pairs per histogram program (4096 elements; ~20 non-empty bins -> ~20 atomics)


@triton.jit(do_not_specialize=["n"])
def _hist_kernel(words_ptr, counts_ptr, n, PAIRS: tl.constexpr):
    """counts[v] += number of elements < n whose high byte is v (int32 [256], atomics)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, PAIRS)
    rem = n - b * (2 * PAIRS)  # elements left from this program's first one
    v0 = 2 * j < rem
    v1 = 2 * j + 1 < rem
    w = tl.load(words_ptr + b * PAIRS + j, mask=v0, other=0).to(tl.uint32, bitcast=True)
    hi0 = ((w >> 8) & 0xFF).to(tl.int32)
    hi1 = (w >> 24).to(tl.int32)
    # Invalid elements go to bin 256, which is not added (no histogram mask needed: older Tritons lack it).
    hi0 = tl.where(v0, hi0, 256)
    hi1 = tl.where(v1, hi1, 256)
    h = tl.histogram(hi0, 512) + tl.histogram(hi1, 512)
    r = tl.arange(0, 512)
    tl.atomic_add(counts_ptr + r, h, mask=(r < 256) & (h > 0))


@triton.jit(do_not_specialize=["n"])
def _encode_kernel(words_ptr, lut_ptr, low_ptr, nib_ptr, esc_ptr, bcnt_ptr, novf_ptr, n,
                   HALF: tl.constexpr, K: tl.constexpr):
    """One block of 2 * HALF elements: low bytes, nibble codes, the first K escapes, the escape count."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF)  # pair index within the block: elements 2j and 2j + 1
    rem = n - b * (2 * HALF)
    v0 = 2 * j < rem
    v1 = 2 * j + 1 < rem
    p = b * HALF + j
    w = tl.load(words_ptr + p, mask=v0, other=0).to(tl.uint32, bitcast=True)  # bytes lo0 hi0 lo1 hi1
    lo0 = w & 0xFF
    hi0 = (w >> 8) & 0xFF
    lo1 = (w >> 16) & 0xFF
    hi1 = w >> 24
    tl.store(low_ptr + p, (lo0 | (lo1 << 8)).to(tl.uint16).to(tl.int16, bitcast=True), mask=v0)
    c0 = tl.load(lut_ptr + hi0.to(tl.int32)).to(tl.int32)
    c1 = tl.load(lut_ptr + hi1.to(tl.int32)).to(tl.int32)
    c1 = tl.where(v1, c1, 0)  # the pad element of an odd n: code 0, never an escape
    tl.store(nib_ptr + p, (c0 | (c1 << 4)).to(tl.uint8), mask=v0)
    e0 = (v0 & (c0 == 15)).to(tl.int32)
    e1 = (v1 & (c1 == 15)).to(tl.int32)
    # Rank of each escape within the block, in element order: exclusive prefix sum over pairs.
    s = e0 + e1
    r0 = tl.cumsum(s, axis=0) - s
    r1 = r0 + e0
    tl.store(esc_ptr + b * K + r0, hi0.to(tl.uint8), mask=(e0 == 1) & (r0 < K))
    tl.store(esc_ptr + b * K + r1, hi1.to(tl.uint8), mask=(e1 == 1) & (r1 < K))
    cnt = tl.sum(s, axis=0)
    tl.store(bcnt_ptr + b, cnt)
    tl.atomic_add(novf_ptr, 1, mask=cnt > K)


@triton.jit(do_not_specialize=["n"])
def _decode_kernel(low_ptr, nib_ptr, esc_ptr, table_ptr, out_ptr, n,
                   HALF: tl.constexpr, K: tl.constexpr):
    """Inverse of _encode_kernel for one block (escapes past the K-th are left 0: patched later)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF)
    rem = n - b * (2 * HALF)
    v0 = 2 * j < rem
    v1 = 2 * j + 1 < rem
    p = b * HALF + j
    nb = tl.load(nib_ptr + p, mask=v0, other=0).to(tl.int32)
    c0 = nb & 15
    c1 = nb >> 4
    lo = tl.load(low_ptr + p, mask=v0, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    e0 = (v0 & (c0 == 15)).to(tl.int32)
    e1 = (v1 & (c1 == 15)).to(tl.int32)
    s = e0 + e1
    r0 = tl.cumsum(s, axis=0) - s
    r1 = r0 + e0
    t0 = tl.load(table_ptr + c0).to(tl.uint32)
    t1 = tl.load(table_ptr + c1).to(tl.uint32)
    x0 = tl.load(esc_ptr + b * K + r0, mask=(e0 == 1) & (r0 < K), other=0).to(tl.uint32)
    x1 = tl.load(esc_ptr + b * K + r1, mask=(e1 == 1) & (r1 < K), other=0).to(tl.uint32)
    hi0 = tl.where(e0 == 1, x0, t0)
    hi1 = tl.where(e1 == 1, x1, t1)
    w = (lo & 0xFF) | (hi0 << 8) | ((lo >> 8) << 16) | (hi1 << 24)
    tl.store(out_ptr + p, w.to(tl.int32, bitcast=True), mask=v0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TritonNibble:
    """Lossless bf16 codec: raw low bytes + 4-bit codes of the high bytes (see the module docstring).

    ``compress(x)``: ``x`` uint8, 1-D, ``2 * n`` bytes (n bf16 elements), on a CUDA device (or the CPU
    under ``TRITON_INTERPRET=1``). Returns ``(parts, meta)``: ``parts`` a list of 1-D uint8 tensors on
    ``x``'s device, ``meta = (n, mode, n_ovf)`` host values. ``decompress(parts, meta)`` returns a
    uint8 tensor of ``2 * n`` bytes equal to ``x``. Both enqueue on the current stream.
    """

    name = "triton-nibble(bf16)"

    def __init__(self, device: torch.device | str | None = None, warmup: bool = True):
        self.kw = {"block_elems": str(B), "escapes_per_block": str(K), "table": str(NCODES),
                   "triton": triton.__version__}
        if warmup:
            self._warmup(torch.device(device) if device is not None else torch.device("cuda"))

    def _warmup(self, device: torch.device) -> None:
        """Compile the kernels now (so the first timed call does not include it) and check a round trip."""
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(3 * B + 5, generator=g) * 0.02).to(torch.bfloat16)
        x[B:B + 2 * K] = torch.logspace(-30, 30, 2 * K).to(torch.bfloat16)  # one overflowed block
        x = x.to(device).view(torch.uint8)
        parts, meta = self.compress(x)
        if not torch.equal(self.decompress(parts, meta), x):
            raise RuntimeError("triton-nibble: warm-up round trip is not bit-exact")

    # ---- helpers

    @staticmethod
    def _words(x: torch.Tensor, n: int) -> torch.Tensor:
        """``x`` as int32 words of two elements each, ``ceil(n / 2)`` of them."""
        if n % 2 == 0 and x.data_ptr() % 4 == 0:
            return x.view(torch.int32)
        # Odd element count, or a slice not 4-byte aligned: one zero-padded copy (rare: model
        # tensors have even sizes and the caching allocator aligns to 512 bytes).
        buf = torch.zeros(_cdiv(n, 2) * 4, dtype=torch.uint8, device=x.device)
        buf[: 2 * n].copy_(x)
        return buf.view(torch.int32)

    @staticmethod
    def _block_elems(blocks: torch.Tensor, n: int) -> torch.Tensor:
        """Element indices (int64, ``len(blocks) * B``) of the given blocks; the tail block's past-the-end
        indices are clamped to ``n - 1`` (duplicates of the last element, harmless both ways)."""
        idx = blocks.to(torch.int64)[:, None] * B + torch.arange(B, device=blocks.device)
        return idx.clamp_(max=n - 1).reshape(-1)

    # ---- codec

    def compress(self, x: torch.Tensor):
        x = x.reshape(-1)
        assert x.dtype == torch.uint8 and x.numel() % 2 == 0, "expects the bytes of bf16 elements"
        n = x.numel() // 2
        if n == 0:
            return [], (0, "empty", 0)
        dev = x.device
        words = self._words(x, n)
        npairs = words.numel()
        nblocks = _cdiv(n, B)

        # Table of the 15 most frequent high bytes, built on the device (no host sync).
        counts = torch.zeros(256, dtype=torch.int32, device=dev)
        _hist_kernel[(_cdiv(npairs, HIST_PAIRS),)](words, counts, n, PAIRS=HIST_PAIRS, num_warps=8)
        top = torch.topk(counts, NCODES).indices  # int64 [15], distinct byte values
        table = torch.zeros(16, dtype=torch.uint8, device=dev)
        table[:NCODES] = top.to(torch.uint8)
        lut = torch.full((256,), ESC, dtype=torch.uint8, device=dev)
        lut.scatter_(0, top, torch.arange(NCODES, dtype=torch.uint8, device=dev))

        low = torch.empty(npairs, dtype=torch.int16, device=dev)
        nib = torch.empty(npairs, dtype=torch.uint8, device=dev)
        esc = torch.zeros(nblocks * K, dtype=torch.uint8, device=dev)
        bcnt = torch.empty(nblocks, dtype=torch.int32, device=dev)
        novf = torch.zeros(1, dtype=torch.int32, device=dev)
        _encode_kernel[(nblocks,)](words, lut, low, nib, esc, bcnt, novf, n, HALF=B // 2, K=K, num_warps=8)

        # The codec's one host sync: how many blocks overflowed their K escape slots. It waits for the
        # current stream only; a sync-free variant would need a fixed-size overflow area.
        n_ovf = int(novf.item())
        low_u8 = low.view(torch.uint8)
        if n_ovf == 0:
            return [low_u8, nib, esc, table], (n, "coded", 0)
        if npairs + nblocks * K + 16 + n_ovf * (B + 4) >= n:
            # Patching costs at least the plain high-byte plane: send that instead (ratio 1.0 on it).
            hi = x.view(n, 2)[:, 1].contiguous()
            return [low_u8, hi], (n, "raw", n_ovf)
        blocks = torch.nonzero(bcnt > K).reshape(-1).to(torch.int32)
        raw = x.view(n, 2)[self._block_elems(blocks, n), 1]
        return [low_u8, nib, esc, table, raw, blocks.view(torch.uint8)], (n, "coded", n_ovf)

    def decompress(self, parts, meta) -> torch.Tensor:
        n, mode, n_ovf = meta
        if mode == "empty":
            return torch.empty(0, dtype=torch.uint8)
        low = parts[0]
        dev = low.device
        if mode == "raw":
            out = torch.empty(n, 2, dtype=torch.uint8, device=dev)
            out[:, 0] = low[:n]
            out[:, 1] = parts[1]
            return out.view(-1)
        nib, esc, table = parts[1], parts[2], parts[3]
        npairs = nib.numel()
        out = torch.empty(npairs, dtype=torch.int32, device=dev)
        _decode_kernel[(_cdiv(n, B),)](low.view(torch.int16), nib, esc, table, out, n,
                                       HALF=B // 2, K=K, num_warps=8)
        y = out.view(torch.uint8)[: 2 * n]
        if n_ovf:
            raw, blocks = parts[4], parts[5].view(torch.int32)
            y.view(n, 2)[:, 1][self._block_elems(blocks, n)] = raw
        return y


# --------------------------------------------------------------------------
# self-test


def _bf16_bits(u16: torch.Tensor) -> torch.Tensor:
    """bf16 tensor with the given 16-bit patterns (int32 values 0..65535)."""
    return u16.to(torch.int32).to(torch.int16).view(torch.bfloat16)  # int32 -> int16 wraps


def _cases(small: bool, g: torch.Generator):
    """(name, bf16 tensor on the CPU) pairs covering sizes, scales and special values."""

    def randn(n, s=1.0):
        return (torch.randn(n, generator=g) * s).to(torch.bfloat16)

    def bits(n, lo, hi):
        return _bf16_bits(torch.randint(lo, hi, (n,), generator=g))

    m = 3 * B + 11 if small else 64 * B + 11
    out = []
    for s in (1e-3, 0.02, 1.0, 1e3):
        out.append((f"normal(0,{s:g}) n={m}", randn(m, s)))
    for n in (1, 2, 3, B - 1, B, B + 1, 5 * B + 7):
        out.append((f"normal(0,0.02) n={n}", randn(n, 0.02)))
    # Real-looking weights: linear weights, zero biases, unit norms, trained-like norms, a uniform init.
    w = torch.cat([torch.randn(2 * B, generator=g) * 0.02, torch.zeros(700), torch.ones(1500),
                   1 + 0.1 * torch.randn(1500, generator=g), torch.randn(B + 300, generator=g) * 0.006,
                   (torch.rand(B, generator=g) * 2 - 1) * 0.05]).to(torch.bfloat16)
    out.append((f"weights mix n={w.numel()}", w))
    # K escapes in one block, adjacent (both elements of a pair), with distinct high bytes: no overflow.
    x = randn(2 * B + 1, 0.02)
    x[B + 7:B + 7 + K] = torch.logspace(-35, 35, K).to(torch.bfloat16)
    out.append((f"{K} adjacent escapes in one block", x))
    # Many escapes in one block: block 1 gets 3K values spread over 60 decades (overflow patch).
    x = randn(4 * B + 3, 0.02)
    x[B + 100:B + 100 + 3 * K] = torch.logspace(-30, 30, 3 * K).to(torch.bfloat16)
    out.append(("one overflowed block", x))
    x = randn(6 * B + 100, 0.02)
    x[6 * B:] = torch.logspace(-30, 30, 100).to(torch.bfloat16)  # the short tail block overflows
    x[10:10 + 2 * K] = torch.logspace(30, -30, 2 * K).to(torch.bfloat16)  # and block 0
    out.append(("overflowed blocks 0 and tail", x))
    out.append(("every block overflows (random bits)", bits(3 * B + 1, 0, 65536)))
    out.append(("all zero", torch.zeros(2 * B + 5, dtype=torch.bfloat16)))
    out.append(("all -0.0", _bf16_bits(torch.full((B + 3,), 0x8000))))
    special = torch.cat([bits(B, 0x7F80, 0x8000), bits(B, 0xFF80, 0x10000),  # Inf and NaN payloads
                         torch.tensor([0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x8000, 0x0000])])
    out.append(("Inf/NaN payloads", _bf16_bits(special)))
    sub = torch.cat([bits(B, 0x0001, 0x0080), bits(B, 0x8001, 0x8080)])  # exponent 0: subnormals
    out.append(("subnormals", _bf16_bits(sub)))
    mix = randn(3 * B, 0.02)
    idx = torch.randint(0, mix.numel(), (200,), generator=g)
    mix[idx] = _bf16_bits(torch.tensor([0x7F80, 0xFF80, 0x7FC1, 0x8000, 0x0001, 0x8001, 0x7F7F, 0xFF7F]))[
        torch.arange(200) % 8]
    out.append(("normals sprinkled with NaN/Inf/-0/subnormal/max", mix))
    return out


def selftest(device: torch.device, small: bool, ratio_elems: int) -> int:
    print(f"triton {triton.__version__}, torch {torch.__version__}, device {device}, "
          f"interpreter {os.environ.get('TRITON_INTERPRET', '0')}, B={B}, K={K}")
    codec = TritonNibble(device)
    g = torch.Generator(device="cpu").manual_seed(1234)
    failed = 0
    cases = [(name, xb.to(device).view(torch.uint8)) for name, xb in _cases(small, g)]
    # Slices as the probe's chunked pipeline makes them: at an aligned offset, and (padded-copy path)
    # at an offset of 2 bytes, which is not 4-byte aligned.
    base = (torch.randn(2 * B + 9, generator=g) * 0.02).to(torch.bfloat16).to(device).view(torch.uint8)
    cases += [("slice at byte offset 1024", base[1024:]), ("slice at byte offset 2 (unaligned)", base[2:])]
    for name, x in cases:
        parts, meta = codec.compress(x)
        y = codec.decompress(parts, meta)
        ok = y.dtype == torch.uint8 and y.numel() == x.numel() and torch.equal(y, x)
        comp = sum(p.numel() for p in parts)
        failed += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {name:50s} ratio {x.numel() / max(comp, 1):6.3f} "
              f"mode {meta[1]:5s} overflowed blocks {meta[2]}")
    # Ratio on a N(0, 0.02) tensor (the scale of transformers' default init).
    x = (torch.randn(ratio_elems, generator=g) * 0.02).to(torch.bfloat16).to(device).view(torch.uint8)
    t0 = time.perf_counter()
    parts, meta = codec.compress(x)
    t1 = time.perf_counter()
    ok = torch.equal(codec.decompress(parts, meta), x)
    t2 = time.perf_counter()
    comp = sum(p.numel() for p in parts)
    failed += not ok
    print(f"  {'ok  ' if ok else 'FAIL'} N(0,0.02) bf16, n={ratio_elems}: ratio {x.numel() / comp:.4f} "
          f"({x.numel()} -> {comp} bytes; ceiling 2/(1.5+K/B) = {2 / (1.5 + K / B):.4f}); "
          f"compress {t1 - t0:.2f} s, decompress {t2 - t1:.2f} s (wall, not a GPU figure under the interpreter)")
    print(f"{len(cases) + 1 - failed} passed, {failed} failed")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", action="store_true", help="round-trip cases, bit-exact, then the ratio")
    ap.add_argument("--large", action="store_true", help="bigger cases (default on a GPU; slow under the interpreter)")
    ap.add_argument("--ratio-elems", type=int, default=1 << 20, help="elements of the N(0,0.02) ratio tensor")
    args = ap.parse_args()
    if not args.selftest:
        ap.print_help()
        return 0
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        device = torch.device("cuda")
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        device = torch.device("cpu")
    else:
        print("no CUDA device: run with TRITON_INTERPRET=1 (Triton's CPU interpreter)", file=sys.stderr)
        return 2
    return selftest(device, small=not (args.large or device.type == "cuda"), ratio_elems=args.ratio_elems)


if __name__ == "__main__":
    sys.exit(main())
