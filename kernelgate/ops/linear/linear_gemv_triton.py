"""Triton one-token GEMV: y [1, N] = x [1, K] @ weight [N, K].T, fp32 accumulation.

A program owns ROWS weight rows and walks K in WIDTH-wide steps: acc [ROWS, WIDTH] += w * x with
plain FMAs, summed over K at the end. x comes either as one [WIDTH] load per step broadcast over
the rows, or (X_ROWS) loaded in the weight tile's own shape (fp8_gemv_triton.rows_of: no exchange
through shared memory in the compiled loop; the repeated rows are L1 hits). The first weight tile
is loaded before `inputs_ready` (ops/common/pdl.py): weights never depend on an earlier kernel, so
with PDL that load overlaps the previous kernel's tail.

Launch choices per platform name (LAUNCH), the rows per program by the weight's N.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import alloc, platform
from ..common.pdl import inputs_ready, pdl_args
from ..quant.fp8_gemv_triton import rows_of

MAX_TOKENS = 1
# H200 (bench/ops/linear_sweep.py, bench/RESULTS.md Session 27; weights cycled past the L2, PDL on):
# 1024-wide K steps of 4 warps, x broadcast (X_ROWS gained nowhere); the rows per program by N --
# one up to 2,048 rows (Qwen3.5 out_proj 2,048 x 4,096: 5.6 µs, cuBLAS 9.8), two up to 12,288 (Kimi's
# KDA o_proj 2,304 x 4,096: 6.2; Qwen3.5's attention q|k|v 9,216 x 2,048: 10.3, cuBLAS 12.2), four above
# (Qwen3.5's GDN in_proj 12,352 x 2,048: 12.9, cuBLAS 15.9). Tuned on NVIDIA only; elsewhere the same.
_LAUNCH = dict(ROWS=((2048, 1), (12288, 2), (None, 4)), WIDTH=1024, num_warps=4, X_ROWS=False)
LAUNCH = {}
_INTERP = dict(ROWS=((None, 16),), WIDTH=128, num_warps=4, X_ROWS=True)


def launch_config(plat, N: int) -> dict:
    """ROWS, WIDTH, num_warps, X_ROWS for N weight rows on platform `plat`."""
    cfg = dict(_INTERP if plat.triton_mode != "compiled" else LAUNCH.get(plat.name, _LAUNCH))
    cfg["ROWS"] = next(rows for most, rows in cfg["ROWS"] if most is None or N <= most)
    return cfg


@triton.jit
def _x_at(x_ptr, kk, sxk, K, ROWS: tl.constexpr, X_ROWS: tl.constexpr):
    """fp32 activations at K offsets kk: [ROWS, WIDTH] (X_ROWS) or [1, WIDTH] to broadcast."""
    if X_ROWS:
        xv = rows_of(x_ptr, kk, sxk, K, ROWS)
    else:
        xv = tl.load(x_ptr + kk * sxk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    return xv


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, sxk, swn, swk, syn, ROWS: tl.constexpr, WIDTH: tl.constexpr,
                 X_ROWS: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * swn
    kk = tl.arange(0, WIDTH)
    w = tl.load(w_rows + kk[None, :] * swk, mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
    inputs_ready(PDL)                                   # (the first weight tile is read before it)
    acc = w.to(tl.float32) * _x_at(x_ptr, kk, sxk, K, ROWS, X_ROWS)
    for k0 in range(WIDTH, K, WIDTH):
        kk = k0 + tl.arange(0, WIDTH)
        w = tl.load(w_rows + kk[None, :] * swk, mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * _x_at(x_ptr, kk, sxk, K, ROWS, X_ROWS)
    tl.store(y_ptr + n * syn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


def linear_gemv(x, weight, **cfg):
    """y [T <= 1, N] in x's dtype; cfg overrides the launch choices (sweeps)."""
    T, K = x.shape
    N = weight.shape[0]
    y = alloc.empty((T, N), x.dtype, x.device)
    if T == 0 or N == 0:
        return y
    cfg = {**launch_config(platform.current(), N), **cfg}
    rows = cfg.pop("ROWS")
    _gemv_kernel[(triton.cdiv(N, rows),)](x, weight, y, N, K, x.stride(1), *weight.stride(), y.stride(1),
                                         ROWS=rows, WIDTH=cfg.pop("WIDTH"), X_ROWS=bool(cfg.pop("X_ROWS")),
                                         **cfg, **pdl_args())
    return y
