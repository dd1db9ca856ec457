"""Probe: the decoder's add + RMSNorm folded into the one-token GEMV that reads its output.

At batch 1 a Qwen3.5-MoE / Kimi layer runs `x, residual = norm(x, residual)` then a projection
GEMV of the normed x (Qwen's GDN in_proj, 12,352 x 2,048; attention q|k|v; Kimi's KDA / MLA input
projections): two launches, the norm's ~2 µs mostly latency. Here one kernel does both: every
program sums (x + residual)^2 over K itself (K = 2,048: 8 KB, L2 hits after the first program),
then runs the GEMV on normed values rounded to the model dtype (as the two-op chain reads them);
program 0 also writes residual_out = x + residual. Not in the package: this measures whether the
saved launch survives the repeated reduction (Session 25's gated-norm fold into out_proj did not).

Forms, each a chain of --layers layer pairs in one CUDA graph, weights cycled past the L2, PDL on
(ops/common/pdl.py), µs a layer:
  two-op   ops.gated_rms_norm(prenorm) + ops.linear (the models' path)
  fused    this kernel
Checked first: fused against the two-op chain (fp32: to round-off; bf16: the normed x rounds
the same but for rare last-bit differences of rstd).

    PYTHONPATH=. python bench/ops/variants/norm_linear.py [--shapes 12352x2048,9216x2048,12576x2304]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

from kernelgate import ops
from kernelgate.ops.common.pdl import inputs_ready, pdl_args
from kernelgate.tools import benchmark


@triton.jit
def _norm_gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, ro_ptr, N, K, eps, ROWS: tl.constexpr,
                      WIDTH: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    kk = tl.arange(0, WIDTH)
    w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)   # before the wait
    inputs_ready(PDL)
    ka = tl.arange(0, KP)                                   # the whole row of x: rstd
    s = tl.load(x_ptr + ka, mask=ka < K, other=0.0).to(tl.float32) + \
        tl.load(r_ptr + ka, mask=ka < K, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / K + eps)
    if tl.program_id(0) == 0:
        tl.store(ro_ptr + ka, s.to(ro_ptr.dtype.element_ty), mask=ka < K)
    acc = tl.zeros([ROWS, WIDTH], dtype=tl.float32)
    for k0 in range(0, K, WIDTH):
        kk = k0 + tl.arange(0, WIDTH)
        if k0 > 0:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
        xs = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32) + \
            tl.load(r_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        xn = (xs * rstd * tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)).to(y_ptr.dtype.element_ty)
        acc += w.to(tl.float32) * xn.to(tl.float32)[None, :]
    tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


def fused(x, res, nw, w, eps, rows, width=1024, warps=4):
    """(y [1, N], residual_out [1, K]) = (rmsnorm(x + res) * nw @ w.T, x + res)."""
    N, K = w.shape
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    ro = torch.empty_like(x)
    _norm_gemv_kernel[(triton.cdiv(N, rows),)](x, res, nw, w, y, ro, N, K, eps, ROWS=rows, WIDTH=width,
                                               KP=triton.next_power_of_2(K), num_warps=warps, **pdl_args())
    return y, ro


def two_op(x, res, nw, w, eps):
    h, ro = ops.gated_rms_norm(x, nw, None, eps, residual=res, prenorm=True)
    return ops.linear(h, w), ro


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="12352x2048,9216x2048,12576x2304")
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    dev, eps = torch.device("cuda"), 1e-6
    print("| projection N x K | rows | two-op µs a layer | fused µs a layer | fp32 rel err | bf16 rel err |")
    print("|---|---:|---:|---:|---:|---:|")
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        copies = max(a.layers, -(-(256 << 20) // (N * K * 2)))
        ws = [torch.randn(N, K, generator=g, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        nw = torch.rand(K, generator=g, device=dev) + 0.5                     # fp32 (1 + w), as OffsetRMSNorm
        x = torch.randn(1, K, generator=g, device=dev, dtype=torch.bfloat16)
        res = torch.randn(1, K, generator=g, device=dev, dtype=torch.bfloat16)
        errs = []
        for dt in (torch.float32, torch.bfloat16):
            args = (x.to(dt), res.to(dt), nw, ws[0].to(dt), eps)
            (yf, rf), (yt, rt) = fused(*args, rows=4), two_op(*args)
            assert torch.equal(rf, rt), "residual_out differs"
            errs.append(((yf.double() - yt.double()).abs().max() / yt.double().abs().max()).item())
        for rows in (1, 2, 4):
            it = itertools.cycle(ws)

            def chain(f):
                def run():
                    for _ in range(a.layers):
                        f(x, res, nw, next(it), eps)
                return run
            t_two = benchmark.graph_us(chain(two_op), dev, calls=1) / a.layers
            t_fused = benchmark.graph_us(chain(lambda *z: fused(*z, rows=rows)), dev, calls=1) / a.layers
            print(f"| {N} x {K} | {rows} | {t_two:.1f} | {t_fused:.1f} | {errs[0]:.1e} | {errs[1]:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
