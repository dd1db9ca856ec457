"""Variant probe (not dispatched): the bf16 one-token GEMVs in the FP8 GEMV's form (quant/fp8_gemv_triton.py,
Session 30) -- weight rows read as int64 words of 4 bf16 values, split by shifts, dotted with the
activations' words; 256-1024-value K steps loaded one step ahead.

Why try it: the FP8 GEMV went from 0.51 to 0.72 of its floor (Kimi's experts at one token) once each
program walked fewer, longer K steps with the next step's loads in flight -- with the old step length
the same kernel was no faster, so the latency per K step, not the instruction count, had bound it.
The bf16 experts GEMV (moe/fused_experts_gemv_triton.py) walks 128-wide steps and loads each in the
step that uses it (0.78 of its floor for Kimi, 0.68 for Qwen3.5-MoE, Session 26); the bf16 linear GEMV
(linear/linear_gemv_triton.py) already takes 1024-wide steps.

    PYTHONPATH=. python bench/ops/variants/bf16_word_gemv.py [--quick]     # a GPU: sweep against dispatch
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/ops/variants/bf16_word_gemv.py --tiny   # correctness only

Each launch is checked against the native reference (bf16 to its rounding, fp32 x to 1e-6), then
timed in a CUDA graph beside the dispatched op. Not yet run on a GPU.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fused_experts_gemv_sweep import with_shared  # noqa: E402

from kernelgate import platform, registry  # noqa: E402
from kernelgate.ops.common.pdl import inputs_ready, pdl_args  # noqa: E402
from kernelgate.ops.moe import fused_experts as fe  # noqa: E402
from kernelgate.ops.moe.fused_experts_triton import sum_slots  # noqa: E402
from kernelgate.ops.quant.fp8_gemv_triton import row_tile, step, x4, x_words  # noqa: E402
from kernelgate.tools import benchmark  # noqa: E402
from kernelgate.tools.testing import rel_err  # noqa: E402


@triton.jit
def _dot4_bf16(w, x0, x1, x2, x3):
    """sum_b bf16_b(w) * x_b over the 4 bf16 values of each int64 word w (value b: K offset 4i + b)."""
    lo = w.to(tl.int32)
    hi = (w >> 32).to(tl.int32)
    t = (lo << 16).to(tl.float32, bitcast=True) * x0 + (lo & -65536).to(tl.float32, bitcast=True) * x1
    return t + (hi << 16).to(tl.float32, bitcast=True) * x2 + (hi & -65536).to(tl.float32, bitcast=True) * x3


@triton.jit
def _load(tiles, k, KW, W: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:
        w = tl.load(tiles + k)
    else:
        w = tl.load(tiles + k, mask=(k + tl.arange(0, W) < KW)[None, :], other=0)
    return w


@triton.jit
def _rows_dot(tiles, x_ptr, KW, sxk, R: tl.constexpr, W: tl.constexpr, EVEN: tl.constexpr, WORDS: tl.constexpr):
    cols = tl.arange(0, W)
    w = _load(tiles, 0, KW, W, EVEN)
    x0, x1, x2, x3 = x4(x_ptr, cols, KW, sxk, EVEN, WORDS)
    acc = tl.zeros([R, W], dtype=tl.float32)
    for k0 in range(0, KW, W):
        if EVEN:
            kn = tl.minimum(k0 + W, KW - W)
        else:
            kn = k0 + W
        w_next = _load(tiles, kn, KW, W, EVEN)
        n0, n1, n2, n3 = x4(x_ptr, kn + cols, KW, sxk, EVEN, WORDS)
        acc += _dot4_bf16(w, x0[None, :], x1[None, :], x2[None, :], x3[None, :])
        w = w_next
        x0, x1, x2, x3 = n0, n1, n2, n3
    return tl.sum(acc, axis=1)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, N, KW, sxk, swn, R: tl.constexpr, W: tl.constexpr, EVEN: tl.constexpr,
                   WORDS: tl.constexpr, PDL: tl.constexpr):
    n0 = tl.program_id(0) * R
    tiles, rows = row_tile(w_ptr, n0, N, swn, R, W)
    inputs_ready(PDL)             # (the first tile could be loaded before it: _rows_dot loads after)
    y = _rows_dot(tiles, x_ptr, KW, sxk, R, W, EVEN, WORDS)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, I, KW, E, sxd, swe, swr, R: tl.constexpr, W: tl.constexpr,
                    EVEN: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr):
    j = tl.program_id(0)
    i0 = tl.program_id(1) * R
    inputs_ready(PDL)
    e = tl.load(ids_ptr + j).to(tl.int64)
    valid = (e >= 0) & (e < E)
    w_e = w_ptr + tl.where(valid, e, 0) * swe
    g_tiles, rows = row_tile(w_e, i0, I, swr, R, W)
    u_tiles, _ = row_tile(w_e + I * swr, i0, I, swr, R, W)
    g = _rows_dot(g_tiles, x_ptr, KW, sxd, R, W, EVEN, WORDS)     # (two loops over x: the probe's simplest form)
    u = _rows_dot(u_tiles, x_ptr, KW, sxd, R, W, EVEN, WORDS)
    h = tl.where(valid, g * tl.sigmoid(g) * u, 0.0)
    tl.store(h_ptr + j * I + rows, h.to(h_ptr.dtype.element_ty), mask=rows < I)


@triton.jit
def _down_kernel(h_ptr, w_ptr, ids_ptr, tw_ptr, y_ptr, D, KW, E, shj, swe, swr, R: tl.constexpr, W: tl.constexpr,
                 EVEN: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr):
    j = tl.program_id(0)
    o0 = tl.program_id(1) * R
    inputs_ready(PDL)
    e = tl.load(ids_ptr + j).to(tl.int64)
    valid = (e >= 0) & (e < E)
    tiles, rows = row_tile(w_ptr + tl.where(valid, e, 0) * swe, o0, D, swr, R, W)
    y = _rows_dot(tiles, h_ptr + j * shj, KW, 1, R, W, EVEN, WORDS)
    tl.store(y_ptr + j * D + rows, tl.where(valid, y * tl.load(tw_ptr + j), 0.0), mask=rows < D)


def _words(w):
    assert w.dtype == torch.bfloat16 and w.shape[-1] % 4 == 0 and w.stride(-1) == 1
    return w.view(torch.int64)


def linear(x, weight, R=16, C=1024, num_warps=4):
    """y [1, N] = x [1, K] @ weight.T for a bf16 weight."""
    N, K = weight.shape
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    w = _words(weight)
    xw, words = x_words(x[0])
    W, even = step(K, C)
    _linear_kernel[(triton.cdiv(N, R),)](xw, w, y, N, K // 4, x.stride(1), w.stride(0), R=R, W=W, EVEN=even,
                                         WORDS=words, num_warps=num_warps, **pdl_args())
    return y


def experts(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up=(16, 512, 4), down=(16, 512, 4)):
    """fused_experts at one token on bf16 weights: gate/up, down (per slot), the sum over slots."""
    D = x.shape[1]
    E, I = w_down.shape[0], w_down.shape[2]
    k = topk_ids.shape[1]
    ids, tw = topk_ids[0].contiguous(), topk_weights[0].contiguous()
    h = torch.empty((k, I), dtype=x.dtype, device=x.device)
    y = torch.empty((k, D), dtype=torch.float32, device=x.device)
    wgu, wdn = _words(w_gate_up), _words(w_down)
    xw, x_is_words = x_words(x[0])
    R, C, warps = gate_up
    W, even = step(D, C)
    _gate_up_kernel[(k, triton.cdiv(I, R))](xw, wgu, ids, h, I, D // 4, E, x.stride(1), wgu.stride(0), wgu.stride(1),
                                          R=R, W=W, EVEN=even, WORDS=x_is_words, num_warps=warps, **pdl_args())
    hw, h_is_words = x_words(h)
    R, C, warps = down
    W, even = step(I, C)
    _down_kernel[(k, triton.cdiv(D, R))](hw, wdn, ids, tw, y, D, I // 4, E, hw.stride(0), wdn.stride(0),
                                         wdn.stride(1), R=R, W=W, EVEN=even, WORDS=h_is_words, num_warps=warps,
                                         **pdl_args())
    return sum_slots(y, topk_ids.contiguous(), torch.empty((1, D), dtype=x.dtype, device=x.device), E)


SHAPES = {"KDA in_proj": (12576, 2304), "KDA o_proj": (2304, 4096), "GDN in_proj": (12352, 2048),
          "GDN out_proj": (2048, 4096), "attention q,k,v": (9216, 2048)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes, correctness only (e.g. the interpreter)")
    ap.add_argument("--quick", action="store_true", help="a few launches each")
    a = ap.parse_args()
    dev = platform.default_device()
    timing = dev.type == "cuda" and not platform.interpreting()
    if not timing and not a.tiny:
        print("needs a CUDA device (or --tiny under TRITON_INTERPRET=1)")
        return 1
    bw = benchmark.copy_bandwidth(dev) if timing else None
    lin = registry.get("linear")
    shapes = {"tiny": (100, 200)} if a.tiny else SHAPES
    grid = [(16, 256, 4)] if a.tiny else [(16, 1024, 4), (16, 512, 4), (32, 512, 8)] if a.quick else \
        [c for c in itertools.product((8, 16, 32), (256, 512, 1024), (2, 4, 8)) if 8 <= c[0] * c[1] // (128 * c[2]) <= 64]
    print(f"copy bandwidth {bw and round(bw)} GB/s\n\n| shape | launch (R, C, warps) | µs | of floor | err |\n|---|---|---:|---:|---:|")
    for name, (N, K) in shapes.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        w = (torch.randn(N, K, generator=gen, device=dev) * K ** -0.5).to(torch.bfloat16)
        x = torch.randn(1, K, generator=gen, device=dev).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.double(), w.double())
        floor = w.numel() * 2 / (bw * 1e9) * 1e6 if timing else 0.0
        rows = [("dispatched", lambda: lin(x, w))] + [(str(c), lambda c=c: linear(x, w, *c)) for c in grid]
        for label, fn in rows:
            err = rel_err(fn().double(), ref)
            us = benchmark.graph_us(fn, dev) if timing else None
            print(f"| {name} | {label} | {us and round(us, 1)} | {us and round(floor / us, 2)} | {err:.1e} |", flush=True)
        err32 = rel_err(linear(x.float(), w, *grid[0]).double(), ref)       # (x.float() is x exactly)
        print(f"| {name} | fp32 x, {grid[0]} | | | {err32:.1e} |")
    for qwen in (False, True) if not a.tiny else (False,):
        D, I, E = (96, 40, 8) if a.tiny else ((2048, 512, 256) if qwen else (2304, 1024, 256))
        gen = torch.Generator(device=dev).manual_seed(0)
        args, kw = fe.make_inputs(1, D, I, E, 8 if not a.tiny else 2, torch.bfloat16, dev, gen)
        args = with_shared(args)
        ref = fe.fused_experts_native(*[t.double() if t.is_floating_point() else t for t in args], **kw)
        floor = fe._bytes(args, kw) / (bw * 1e9) * 1e6 if timing else 0.0
        op = registry.get("fused_experts")
        rows = [("dispatched", lambda: op(*args, **kw))] + [
            (f"{gu} / {dn}", lambda gu=gu, dn=dn: experts(*args, gate_up=gu, down=dn))
            for gu, dn in itertools.product(grid, grid if not a.quick else grid[:1])]
        print(f"\nexperts at one token ({'tiny' if a.tiny else 'Qwen3.5-MoE' if qwen else 'Kimi'} + shared)")
        for label, fn in rows:
            err = rel_err(fn().double(), ref)
            us = benchmark.graph_us(fn, dev) if timing else None
            print(f"| experts | {label} | {us and round(us, 1)} | {us and round(floor / us, 2)} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
