"""Triton router logits, y[t, e] = sum_d float(x[t, d]) * w[e, d], in one launch.

`router_logits_triton` (decode steps): grid (E / BLOCK_E, T / T_BLOCK); a program holds up to T_BLOCK
tokens and BLOCK_E router rows and walks D in BLOCK_D steps, fp32 FMAs into a [T_BLOCK, BLOCK_E,
BLOCK_D] accumulator summed at the end. All tokens of a block share each weight load, so a step of
at most T_BLOCK tokens reads the router once.

`router_logits_bf16x3` (bf16 x, any T; prefill chunks): the fp32 weight tile is split in registers
into three bf16 parts, w = hi + mid + lo (each the bf16 rounding of what the ones before leave: 3 x 8
significand bits, fp32's 24), and y = x.hi + (x.mid + x.lo) on the 16-bit matrix units with fp32
accumulation. Each product of a bf16 x and a bf16 part is exact in fp32, so the result is the fp32
GEMM's up to the order of the sums (under the interpreter the parts are dotted in fp32: the same
products; its tl.dot misreads a bf16 operand made in the kernel) -- without its cast of x and its SIMT fp32 GEMM (the 128k-token
Kimi prefill spent 94 + 25 ms of its 4.3 s there: bench/RESULTS.md Session 25). Grid (T / BM, E / BN).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import platform
from ..common.pdl import inputs_ready, pdl_args

# Up to 64 tokens (H200, `kernelgate bench router_logits`, CUDA graphs, Session 25): 2.2 / 3.3 / 3.8 / 4.7
# / 11.2 µs at 1 / 4 / 8 / 16 / 64 tokens (Qwen3.5-MoE's router) against 5.6 / 12.5 / 13.5 / 13.8 / 14.5
# for the cast + fp32 GEMM; from 64 the GEMM's tiles read the router once for the whole step, these
# programs once per 8 tokens. Larger steps take router_logits_bf16x3 (bf16 x) or the fp32 GEMM.
MAX_TOKENS = 64
T_BLOCK = 8
# Launch choices (H200, Session 25; swept by a probe this op replaced, bench/RESULTS.md): at Qwen3.5-MoE's
# 257 x 2,048 and Kimi's 256 x 2,304 one token takes 1-row programs of 8 warps and 256-wide steps
# (2.5 / 2.8 µs), 2-8 tokens 2-row programs of 4 warps, 512-wide (3.4-4.3 µs). Tuned on NVIDIA only;
# elsewhere the same.
ONE_TOKEN = dict(BLOCK_E=1, BLOCK_D=256, num_warps=8)
LAUNCH = dict(BLOCK_E=2, BLOCK_D=512, num_warps=4)


# bf16x3 tiles: [BM, BK] x (bf16) and [BN, BK] w (fp32) per stage, 16 KB at 128 / 64 / 32: within every
# target's shared memory at two stages. Not swept: an 8,192-token chunk took 108 µs at Kimi's router and
# 182 at Qwen3.5-MoE's 257 rows (five 64-row tiles) on the H200, against 251 / 292 for the cast + fp32
# GEMM (Session 25); ~140 TFLOP/s of bf16 dots, room left for a sweep.
MMA = dict(BM=128, BN=64, BK=32, num_warps=4, num_stages=2)


def launch_config(tokens: int) -> dict:
    if platform.interpreting():   # the interpreter pays per program: few, wide ones
        return dict(BLOCK_E=16, BLOCK_D=128, num_warps=4)
    return ONE_TOKEN if tokens == 1 else LAUNCH


@triton.jit
def _router_kernel(x_ptr, w_ptr, y_ptr, T, E, D, sxt, sxd, swe, swd, syt,
                   T_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.program_id(1) * T_PAD + tl.arange(0, T_PAD)
    e_ok, t_ok = e < E, t < T
    w_rows = w_ptr + e[:, None].to(tl.int64) * swe
    x_rows = x_ptr + t[:, None].to(tl.int64) * sxt
    acc = tl.zeros([T_PAD, BLOCK_E, BLOCK_D], dtype=tl.float32)
    inputs_ready(PDL)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        w = tl.load(w_rows + d[None, :] * swd, mask=e_ok[:, None] & d_ok[None, :], other=0.0)      # [BLOCK_E, BLOCK_D]
        x = tl.load(x_rows + d[None, :] * sxd, mask=t_ok[:, None] & d_ok[None, :], other=0.0)      # [T_PAD, BLOCK_D]
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    tl.store(y_ptr + t[:, None].to(tl.int64) * syt + e[None, :], tl.sum(acc, 2), mask=t_ok[:, None] & e_ok[None, :])


def _logits(x, weight):
    """The fp32 [T, E] output of either launcher, and its sizes."""
    (T, D), E = x.shape, weight.shape[0]
    return torch.empty((T, E), dtype=torch.float32, device=x.device), T, D, E


def router_logits_triton(x, weight, **over):
    """over: launch overrides (sweeps): T_BLOCK, BLOCK_E, BLOCK_D, num_warps."""
    y, T, D, E = _logits(x, weight)
    if y.numel() == 0:
        return y
    cfg = {"T_BLOCK": T_BLOCK, **launch_config(T), **over}
    tb = min(cfg["T_BLOCK"], triton.next_power_of_2(T))
    _router_kernel[(triton.cdiv(E, cfg["BLOCK_E"]), triton.cdiv(T, tb))](
        x, weight, y, T, E, D, *x.stride(), *weight.stride(), y.stride(0),
        T_PAD=tb, BLOCK_E=cfg["BLOCK_E"], BLOCK_D=min(cfg["BLOCK_D"], max(16, triton.next_power_of_2(D))),
        num_warps=cfg["num_warps"], **pdl_args())
    return y


@triton.jit
def _router_bf16x3_kernel(x_ptr, w_ptr, y_ptr, T, E, D, sxt, sxd, swe, swd, syt,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PARTS_F32: tl.constexpr):
    t = tl.program_id(0) * BM + tl.arange(0, BM)
    e = tl.program_id(1) * BN + tl.arange(0, BN)
    t_ok, e_ok = t < T, e < E
    x_rows = x_ptr + t[:, None].to(tl.int64) * sxt
    w_rows = w_ptr + e[:, None].to(tl.int64) * swe
    acc_hi = tl.zeros([BM, BN], dtype=tl.float32)
    acc_lo = tl.zeros([BM, BN], dtype=tl.float32)
    for d0 in range(0, D, BK):
        d = d0 + tl.arange(0, BK)
        d_ok = d < D
        x = tl.load(x_rows + d[None, :] * sxd, mask=t_ok[:, None] & d_ok[None, :], other=0.0)   # [BM, BK] bf16
        w = tl.load(w_rows + d[None, :] * swd, mask=e_ok[:, None] & d_ok[None, :], other=0.0)   # [BN, BK] fp32
        hi = w.to(tl.bfloat16)
        r = w - hi.to(tl.float32)                                   # exact
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        if PARTS_F32:   # (the interpreter: its tl.dot misreads an operand converted to bf16 in the kernel)
            xf = x.to(tl.float32)
            acc_lo = tl.dot(xf, tl.trans(lo.to(tl.float32)), acc_lo, input_precision="ieee")
            acc_lo = tl.dot(xf, tl.trans(mid.to(tl.float32)), acc_lo, input_precision="ieee")
            acc_hi = tl.dot(xf, tl.trans(hi.to(tl.float32)), acc_hi, input_precision="ieee")
        else:
            acc_lo = tl.dot(x, tl.trans(lo), acc_lo)
            acc_lo = tl.dot(x, tl.trans(mid), acc_lo)
            acc_hi = tl.dot(x, tl.trans(hi), acc_hi)
    tl.store(y_ptr + t[:, None].to(tl.int64) * syt + e[None, :], acc_hi + acc_lo, mask=t_ok[:, None] & e_ok[None, :])


def router_logits_bf16x3(x, weight, **over):
    """over: launch overrides (sweeps): BM, BN, BK, num_warps, num_stages."""
    y, T, D, E = _logits(x, weight)
    if y.numel() == 0:
        return y
    interp = platform.interpreting()
    cfg = {**(dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1) if interp else MMA), **over}
    _router_bf16x3_kernel[(triton.cdiv(T, cfg["BM"]), triton.cdiv(E, cfg["BN"]))](
        x, weight, y, T, E, D, *x.stride(), *weight.stride(), y.stride(0), BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
        PARTS_F32=interp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y
