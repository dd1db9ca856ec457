"""Variant probe (issue 38, not dispatched): `linear` at a decode batch of 2-64 tokens as one Triton GEMM.

At a batch of 2-64 tokens a projection still reads its weight once per step and moves little else,
so it is bound by the weight's bytes; cuBLAS runs these shapes as split-K GEMMs with a reduce launch
of their own (Qwen3.5-MoE's GDN out_proj, 2,048 x 4,096 at 64 tokens: 8.5 + 2.3 µs in a B64 step on
the H200 against ~3.5 µs of bytes). Here a program owns BN weight rows and every token of the step
(one [T_PAD, BK] tile of x, T_PAD the token count's power of two, 16 at least, for the matrix
units), walks K in BK steps with `tl.dot` into an fp32 [T_PAD, BN] accumulator and writes its
columns: one launch, no partial sums, written for PDL (ops/common/pdl.py). fp32 operands multiply in
IEEE fp32, as under the interpreter, whose bf16 `tl.dot` misreads its operands.

Swept by bench/ops/decode_b64_sweep.py (36 launches a shape, checked against float64 first).
Result (H200, bench/RESULTS.md Session 29, 64 tokens, weights cycled past the L2, PDL on): GDN
out_proj 8.9 µs against cuBLAS 10.4, GDN in_proj 16.1 against 16.6, attention q|k|v 13.9 against
12.8 (floors 4.0 / 12.0 / 8.9 at the measured copy bandwidth). ~1.5 µs at 40 projections of a
step (0.3 %) is not worth a fourth launch form of `linear`; kept as the record.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate import alloc, platform
from kernelgate.ops.common.pdl import inputs_ready, pdl_args

MAX_TOKENS = 64
_LAUNCH = dict(BN=16, BK=256, num_warps=4, num_stages=4)
LAUNCH = {}
_INTERP = dict(BN=32, BK=64, num_warps=4, num_stages=1)


def launch_config(plat) -> dict:
    """BN, BK, num_warps, num_stages on platform `plat`."""
    return dict(_INTERP if plat.triton_mode != "compiled" else LAUNCH.get(plat.name, _LAUNCH))


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, T, N, K, sxt, sxk, swn, swk, syt, syn,
                 T_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    t = tl.arange(0, T_PAD)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    t_ok, n_ok = t < T, n < N
    x_rows = x_ptr + t.to(tl.int64)[:, None] * sxt
    w_rows = w_ptr + n.to(tl.int64)[:, None] * swn
    acc = tl.zeros([T_PAD, BN], dtype=tl.float32)
    inputs_ready(PDL)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :] * swk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)    # [BN, BK]
        x = tl.load(x_rows + kk[None, :] * sxk, mask=t_ok[:, None] & k_ok[None, :], other=0.0)    # [T_PAD, BK]
        if IEEE:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * syt + n[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & n_ok[None, :])


def linear_gemm(x, weight, **cfg):
    """y [T, N] in x's dtype, T <= MAX_TOKENS; cfg overrides the launch choices (sweeps)."""
    T, K = x.shape
    N = weight.shape[0]
    y = alloc.empty((T, N), x.dtype, x.device)
    if T == 0 or N == 0:
        return y
    cfg = {**launch_config(platform.current()), **cfg}
    bn = cfg.pop("BN")
    ieee = x.dtype == torch.float32 or platform.interpreting()
    _gemm_kernel[(triton.cdiv(N, bn),)](x, weight, y, T, N, K, *x.stride(), *weight.stride(), *y.stride(),
                                        T_PAD=max(16, triton.next_power_of_2(T)), BN=bn, BK=cfg.pop("BK"),
                                        IEEE=ieee, **cfg, **pdl_args())
    return y
