"""Variant probe (issue 37, not dispatched): fp8_linear at one token as w8a8 on the FP8 matrix units.

The package's one-token form (quant/fp8_gemv_triton.py) decodes every weight code to fp32 in
registers and multiplies with FMAs: 0.3-0.45 of the byte floor at Kimi's projections (Session 19),
bounded by the per-element decode, not by bytes. Here the codes go to tl.dot as they are (fp8 x fp8,
no per-element conversion, operand loads pipelined by the compiler), the token is quantized inside
the kernel -- one e4m3 scale per 128-wide group of K, as `triton_w8a8` does, so no extra launch --
and K is split over programs (fp32 partials, then the package's fixed-order sum kernel; one split
writes the output directly):

    acc[0, n] += dot(q(x[k0:k0+128]) padded to 16 rows, W[n, k0:k0+128]^T) * sx[k0 / 128] * sw[n / 128, k0 / 128]

Each launch is checked against fp8_linear's definition (bound: triton_w8a8's 5e-2 relative, the
activation quantization's error), then timed in a CUDA graph beside the dispatched GEMV (`triton`)
and bf16 cuBLAS on the same shapes. Needs fp8 matrix instructions (sm_89+); correctness also runs
under TRITON_INTERPRET=1 (--tiny).

    PYTHONPATH=. python bench/ops/variants/fp8_w8a8_onetoken.py [--tiny]

Result (H200, bench/RESULTS.md Session 25): slower than the dispatched GEMV at every shape, best
launch against it 13.0 / 8.9 µs (KDA in_proj), 10.0 / 7.5 (MLA q_proj), 9.7 / 7.3 (KDA o_proj),
11.7 / 8.4 (Qwen GDN in_proj), 9.2 / 6.7 (Qwen GDN out_proj). Not dispatched; kept as the record.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

from kernelgate import platform, registry
from kernelgate.ops.common.fp8_triton import encode_e4m3
from kernelgate.ops.quant import fp8_linear as fl
from kernelgate.ops.quant.fp8_linear_triton import _sum_splits_kernel
from kernelgate.tools import benchmark
from kernelgate.tools.testing import rel_err

SHAPES = {"KDA in_proj": (12576, 2304), "MLA q_proj": (6144, 2304), "KDA o_proj": (2304, 4096),
          "Qwen GDN in_proj": (12352, 2048), "Qwen GDN out_proj": (2048, 4096)}


@triton.jit
def _w8a8_one_token(x_ptr, w_ptr, s_ptr, out_ptr, N, K, k_split, bn, sxk, swn, swk, ssn, ssk, sos, son,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    row0 = (tl.arange(0, BLOCK_M) == 0)[:, None]                         # the token; rows 1.. are zeros
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * swn
    s_cols = s_ptr + (offs_n // bn).to(tl.int64) * ssn
    k_lo = pid_s * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):                                # one K tile = one scale group
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        xv = tl.load(x_ptr + offs_k * sxk, mask=k_ok, other=0.0).to(tl.float32)
        # (triton_w8a8's quantization: scale max(amax, floor) / 448, codes rounded to nearest even)
        sx = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xv), 0), 1e-12), 448.0)
        q = tl.minimum(tl.maximum(tl.math.div_rn(xv, tl.zeros_like(xv) + sx), -448.0), 448.0)
        a = tl.where(row0, encode_e4m3(q, False)[None, :], 0).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        w = tl.load(w_cols + offs_k[:, None] * swk, mask=k_ok[:, None] & n_ok[None, :], other=0)
        sw = tl.load(s_cols + (k0 // BLOCK_K) * ssk, mask=n_ok, other=0.0)
        acc += tl.dot(a, w.to(tl.float8e4nv, bitcast=True)) * (sw * sx)[None, :]
    y = tl.sum(tl.where(row0, acc, 0.0), 0)                                # row 0
    tl.store(out_ptr + pid_s * sos + offs_n * son, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def one_token(x, weight, scale, BLOCK_N=64, split=4, num_warps=4, num_stages=3):
    """y [1, N] = x [1, K] @ dequant(weight).T, 128 x 128 block scales, w8a8 in one or two launches."""
    N, K = weight.shape
    k_tiles = triton.cdiv(K, 128)
    per = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per)
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty((split, 1, N), dtype=torch.float32, device=x.device)
    sos, son = (0, y.stride(1)) if split == 1 else (out.stride(0), out.stride(2))
    w = weight.view(torch.uint8)
    _w8a8_one_token[(triton.cdiv(N, BLOCK_N), split)](
        x, w, scale, out, N, K, per * 128, 128, x.stride(1), *w.stride(), *scale.stride(), sos, son,
        BLOCK_M=16, BLOCK_N=BLOCK_N, BLOCK_K=128, num_warps=num_warps, num_stages=num_stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(N))
        _sum_splits_kernel[(1, triton.cdiv(N, block))](out, y, N, split, out.stride(0), out.stride(1),
                                                        *y.stride(), BLOCK=block)
    return y


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes, correctness only (e.g. the interpreter)")
    a = ap.parse_args()
    dev = platform.default_device()
    shapes = {"tiny": (200, 384)} if a.tiny else SHAPES
    timing = dev.type == "cuda" and not platform.interpreting()
    bw = benchmark.copy_bandwidth(dev) if timing else None
    gemv = registry.get("fp8_linear").impls["triton"].callable()
    w8a8 = registry.get("fp8_linear").impls["triton_w8a8"].callable()
    print(f"copy bandwidth {bw and round(bw)} GB/s\n\n| shape | launch | µs | of floor | rel err |\n|---|---|---:|---:|---:|")
    for name, (N, K) in shapes.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        (x, weight, scale), kw = fl.make_inputs(1, N, K, (128, 128), torch.bfloat16, dev, gen)
        ref = fl.fp8_linear_native(x.float(), weight, scale).float()
        floor = (weight.numel() + scale.numel() * 4) / (bw * 1e9) * 1e6 if timing else 0.0
        rows = [("dispatched GEMV", lambda: gemv(x, weight, scale)),
                ("triton_w8a8 (its own act-quant launch, no split)", lambda: w8a8(x, weight, scale))]
        grid = [(64, 1, 4, 3), (32, 2, 4, 3)] if a.tiny else itertools.product((32, 64, 128), (1, 2, 4, 8), (4,), (3, 4))
        for bn, split, warps, stages in grid:
            rows.append((f"w8a8 BN {bn} split {split} {warps}w {stages}s",
                         lambda bn=bn, split=split, warps=warps, stages=stages: one_token(
                             x, weight, scale, bn, split, warps, stages)))
        base = w8a8(x, weight, scale).float()
        for label, fn in rows:
            try:
                y = fn().float()
            except Exception as e:  # noqa: BLE001 - a launch this Triton refuses: listed, not fatal
                print(f"| {name} | {label} | refused: {type(e).__name__} | | |")
                continue
            err = rel_err(y, ref)
            label += f" (vs triton_w8a8 {rel_err(y, base):.1e})"
            us = benchmark.graph_us(fn, dev) if timing else None
            if us is None:
                print(f"| {name} | {label} | - | - | {err:.1e} |")
            else:
                print(f"| {name} | {label} | {us:.1f} | {floor / us:.2f} | {err:.1e} |", flush=True)
        if timing:
            wb = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
            us = benchmark.graph_us(lambda: torch.nn.functional.linear(x, wb), dev)
            print(f"| {name} | bf16 cuBLAS (2x the bytes) | {us:.1f} | {floor / us:.2f} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
