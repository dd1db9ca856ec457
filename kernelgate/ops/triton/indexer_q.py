"""Triton kernel: indexer query RoPE + Hadamard + per-(token, head) FP8 quantization.

One program handles BLOCK_R (token, head) rows of 128 dims, loaded as four quarters of 32
dims each ([BLOCK_R, 32] tiles). Splitting by quarters makes both steps local:
- RoPE v4 (interleaved, dims 64..127) pairs each lane with lane ^ 1 of the same quarter
  (quarters 2 and 3; the partner is a second, cached load); RoPE v3.2 (dims 0..63, pair
  (i, 32+i)) pairs quarter 0 with quarter 1 lane by lane.
- Hadamard: H128 = H4 (x) H32 in Sylvester order, so y_a = H32 (sum_b H4[a,b] x_b): a 4-point
  butterfly across the quarters, then each quarter times the 32x32 Sylvester matrix with
  `tl.dot` (fp32 inputs; 3xTF32 on CUDA for fp32-level accuracy, IEEE elsewhere).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import alloc
from ...checks import require
from ...triton_utils import autotune_or_fixed
from .. import _fp8
from ..indexer_q import OP, sylvester_hadamard
from .indexer_fp8 import encode_e4m3

BLOCK_R = 64  # rows per program under the interpreter; autotuned on GPUs
_H32: dict = {}


@triton.jit
def _rope_pair(a, b, c, s):
    return a * c - b * s, a * s + b * c


@triton.jit
def _had32(v, hm, PREC: tl.constexpr):
    return tl.dot(v, hm, input_precision=PREC)


@autotune_or_fixed(
    [triton.Config({"BLOCK_R": r}, num_warps=w) for r in (32, 64, 128) for w in (4, 8)],
    key=["H", "V4", "HADAMARD"], fixed={"BLOCK_R": BLOCK_R})
@triton.jit
def _indexer_q_kernel(q_ptr, w_ptr, f_ptr, pos_ptr, h_ptr, qo_ptr, wo_ptr,
                      n_rows, H, s_qb, s_qh, s_wb, s_wh, weight_scale, fmax,
                      V4: tl.constexpr, HADAMARD: tl.constexpr, FNUZ: tl.constexpr,
                      PREC: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)       # [R] = token * H + head
    rmask = rows < n_rows
    tok = rows // H
    head = rows % H
    cols = tl.arange(0, 32)
    base = (q_ptr + tok.to(tl.int64) * s_qb + head * s_qh)[:, None]  # [R, 1]
    m2 = rmask[:, None]
    x0 = tl.load(base + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    x1 = tl.load(base + 32 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(base + 64 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    x3 = tl.load(base + 96 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    # freqs_cis viewed as real: [max_pos, 32, 2] fp32 = 64 floats per position
    fbase = (f_ptr + tl.load(pos_ptr + tok, mask=rmask, other=0).to(tl.int64) * 64)[:, None]
    if V4:
        partner = cols ^ 1
        sgn = tl.where((cols & 1) == 0, -1.0, 1.0)[None, :]     # even lane: a*c - b*s
        fi = (cols // 2)[None, :]
        c2 = tl.load(fbase + 2 * fi, mask=m2, other=1.0)
        s2 = tl.load(fbase + 2 * fi + 1, mask=m2, other=0.0)
        c3 = tl.load(fbase + 2 * (fi + 16), mask=m2, other=1.0)
        s3 = tl.load(fbase + 2 * (fi + 16) + 1, mask=m2, other=0.0)
        p2 = tl.load(base + 64 + partner[None, :], mask=m2, other=0.0).to(tl.float32)
        p3 = tl.load(base + 96 + partner[None, :], mask=m2, other=0.0).to(tl.float32)
        x2 = x2 * c2 + sgn * p2 * s2
        x3 = x3 * c3 + sgn * p3 * s3
    else:
        c = tl.load(fbase + 2 * cols[None, :], mask=m2, other=1.0)
        s = tl.load(fbase + 2 * cols[None, :] + 1, mask=m2, other=0.0)
        x0, x1 = _rope_pair(x0, x1, c, s)
    if HADAMARD:
        u0 = x0 + x1
        u1 = x0 - x1
        u2 = x2 + x3
        u3 = x2 - x3
        hm = tl.load(h_ptr + cols[:, None] * 32 + cols[None, :])    # [32, 32] of +-1/sqrt(128)
        x0 = _had32(u0 + u2, hm, PREC)
        x1 = _had32(u1 + u3, hm, PREC)
        x2 = _had32(u0 - u2, hm, PREC)
        x3 = _had32(u1 - u3, hm, PREC)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(x0), 1), tl.max(tl.abs(x1), 1)),
                      tl.maximum(tl.max(tl.abs(x2), 1), tl.max(tl.abs(x3), 1)))
    scale = tl.maximum(amax, 1e-4) / fmax                          # [R]
    sc = scale[:, None]
    out = (qo_ptr + rows.to(tl.int64) * 128)[:, None] + cols[None, :]
    tl.store(out, encode_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x0, sc), -fmax), fmax), FNUZ), mask=m2)
    tl.store(out + 32, encode_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x1, sc), -fmax), fmax), FNUZ), mask=m2)
    tl.store(out + 64, encode_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x2, sc), -fmax), fmax), FNUZ), mask=m2)
    tl.store(out + 96, encode_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x3, sc), -fmax), fmax), FNUZ), mask=m2)
    w = tl.load(w_ptr + tok * s_wb + head * s_wh, mask=rmask, other=0.0).to(tl.float32)
    tl.store(wo_ptr + rows, w * weight_scale * scale, mask=rmask)


def _h32(device) -> torch.Tensor:
    # the 1/sqrt(128) normalisation is folded into the +-1 entries (differs from the reference's
    # multiply-after-sum by fp32 rounding only)
    key = str(device)
    if key not in _H32:
        _H32[key] = (sylvester_hadamard(32) * (1.0 / math.sqrt(128))).to(device)
    return _H32[key]


def _precision(device: torch.device) -> str:
    # tl.dot on fp32 defaults to TF32 on NVIDIA (10-bit mantissa); 3xTF32 restores fp32-level
    # accuracy. Other backends (and the interpreter) take "ieee".
    return "tf32x3" if device.type == "cuda" and torch.version.hip is None else "ieee"


def indexer_q_triton(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn",
                     hadamard=None):
    B, H, D = q.shape
    require(q.stride(-1) == 1, OP, f"q must be contiguous in the head dim, got strides {q.stride()}")
    require(freqs_cis.is_contiguous(), OP, "freqs_cis must be contiguous")
    dtype, fmax = _fp8.FORMATS[fp8_format]
    use_h = (variant == "v4") if hadamard is None else hadamard
    q_fp8 = alloc.empty((B, H, D), dtype, q.device)
    w_out = alloc.empty((B, H, 1), torch.float32, q.device)
    n_rows = B * H
    if n_rows == 0:
        return q_fp8, w_out
    grid = lambda meta: (triton.cdiv(n_rows, meta["BLOCK_R"]),)  # noqa: E731
    _indexer_q_kernel[grid](
        q, weight, torch.view_as_real(freqs_cis), positions, _h32(q.device),
        q_fp8.view(torch.uint8), w_out, n_rows, H, q.stride(0), q.stride(1),
        weight.stride(0), weight.stride(1), float(weight_scale), fmax,
        V4=variant == "v4", HADAMARD=use_h, FNUZ=fp8_format == "e4m3fnuz",
        PREC=_precision(q.device))
    return q_fp8, w_out
