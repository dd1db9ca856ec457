"""Triton gated RMSNorm + projection for decode steps (CUDA, ROCm, XPU; CPU under TRITON_INTERPRET=1).

Grid (N / BLOCK_N,): a program owns BLOCK_N output rows for every token of the step. It walks the
heads HB at a time: loads their x and gate [T, HB, V] (16 KB a token at 32 x 128 in bf16: from L2
after the first program), normalises each head in fp32, rounds to x's dtype (what the two-op form
hands the GEMM) and multiplies with the weight's [BLOCK_N, HB * V] columns, accumulating in fp32.
The weight, the bytes that matter, is read once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import alloc, platform

MAX_TOKENS = 4
# Launch choices per platform name (platform.current(): a simulated platform takes its own): rows of
# the weight per program, heads per step, warps. Chosen on the H200 (bench/RESULTS.md Session 25).
LAUNCH = {"default": dict(BLOCK_N=8, HB=2, num_warps=4)}


def launch_config(plat) -> dict:
    if platform.interpreting():   # the interpreter pays per program: few, wide ones
        return dict(BLOCK_N=64, HB=4, num_warps=4)
    return LAUNCH.get(plat.name, LAUNCH["default"])


@triton.jit
def _norm_linear_kernel(x_ptr, nw_ptr, g_ptr, w_ptr, o_ptr, T, H, V, N, eps,
                        sxt, sxh, sxv, sgt, sgh, sgv, swn, swk, sot,
                        SIGMOID: tl.constexpr, T_PAD: tl.constexpr, HB: tl.constexpr, VP: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    t = tl.arange(0, T_PAD)
    t_ok = t < T
    v = tl.arange(0, VP)
    v_ok = v < V
    nw = tl.load(nw_ptr + v, mask=v_ok, other=0.0).to(tl.float32)
    w_rows = w_ptr + n[:, None].to(tl.int64) * swn
    acc = tl.zeros([T_PAD, BLOCK_N, HB * VP], dtype=tl.float32)
    for h0 in range(0, H, HB):
        hh = h0 + tl.arange(0, HB)
        m3 = t_ok[:, None, None] & (hh < H)[None, :, None] & v_ok[None, None, :]
        xo = tl.load(x_ptr + t[:, None, None] * sxt + hh[None, :, None] * sxh + v[None, None, :] * sxv,
                     mask=m3, other=0.0)
        xf = xo.to(tl.float32)
        gf = tl.load(g_ptr + t[:, None, None] * sgt + hh[None, :, None] * sgh + v[None, None, :] * sgv,
                     mask=m3, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 2) / V + eps)                       # [T_PAD, HB]
        if SIGMOID:
            act = tl.sigmoid(gf)
        else:
            act = gf * tl.sigmoid(gf)
        y = (xf * rstd[:, :, None] * nw[None, None, :] * act).to(xo.dtype).to(tl.float32)
        k = tl.reshape(hh[:, None] * V + v[None, :], [HB * VP])
        k_ok = tl.reshape((hh < H)[:, None] & v_ok[None, :], [HB * VP])
        w = tl.load(w_rows + k[None, :] * swk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, HB*VP]
        acc += tl.reshape(y, [T_PAD, HB * VP])[:, None, :] * w.to(tl.float32)[None, :, :]
    tl.store(o_ptr + t[:, None] * sot + n[None, :], tl.sum(acc, 2).to(o_ptr.dtype.element_ty),
             mask=t_ok[:, None] & n_ok[None, :])


def gated_rms_norm_linear_triton(x, norm_weight, gate, weight, eps=1e-6, activation="sigmoid", cfg=None):
    """cfg: a launch choice of its own (the sweep's); default launch_config's."""
    T, H, V = x.shape
    N = weight.shape[0]
    out = alloc.empty((T, N), x.dtype, x.device)
    if T == 0 or N == 0:
        return out
    cfg = cfg or launch_config(platform.current())
    VP = triton.next_power_of_2(V)
    _norm_linear_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, norm_weight, gate, weight, out, T, H, V, N, float(eps), *x.stride(), *gate.stride(), *weight.stride(),
        out.stride(0), SIGMOID=activation == "sigmoid", T_PAD=triton.next_power_of_2(T),
        HB=min(cfg["HB"], triton.next_power_of_2(H)), VP=VP, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    return out
