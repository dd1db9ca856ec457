"""Triton kernel for `rms_norm_rope` (CUDA, ROCm, XPU; CPU tensors under TRITON_INTERPRET=1).

One launch. The T * H (token, head) rows are taken BLOCK_R at a time; a program holds its rows
whole, [BLOCK_R, BLOCK_D] with BLOCK_D the head dim padded to a power of two (masked), so the
sum of squares, the norm and the rotary all happen in registers: one read of x, one write.

The rotary pairs dim d with its partner p(d) = d + h (d < h) or d - h (h <= d < R), h = R / 2.
Rather than split the register tile, the program loads x and weight a second time at p(d)
(the same cache lines, already in L1) and normalises them with the row's rstd:
    out[d] = y[d] * cos[d mod h] + sign(d) * y[p(d)] * sin[d mod h],  sign = -1 for d < h, +1 else
and out[d] = y[d] for d >= R (cos = 1, sin = 0 there).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import alloc, platform
from ..common.pdl import inputs_ready, pdl_args

# Launch choices per platform (first match wins, None matches any). values: a program's tile,
# rows x padded head dim (fp32 values per tensor held in registers: x, its partner, cos, sin),
# which sets the rows per program (Dh 256 -> 8 rows on CUDA); num_warps: at most this many, fewer
# for a smaller tile (one warp per 256 values). Unmeasured starting points.
CONFIGS = [
    ("cuda", dict(values=2048, num_warps=4)),
    ("rocm", dict(values=4096, num_warps=4)),    # 64-lane wavefronts: the same values per lane
    ("xpu", dict(values=2048, num_warps=4)),
    (None, dict(values=2048, num_warps=4)),
]
# The interpreter pays Python time per program, not per value: few, large programs (its numpy
# ops are vectorised); 37 tokens x 16 heads of 256 still take several programs and a partial one.
INTERPRETER = dict(values=8192)


def launch_config(plat=None) -> dict:
    plat = plat or platform.current()
    for name, cfg in CONFIGS:
        if name in (None, plat.name):
            cfg = dict(cfg)
            if platform.interpreting():
                cfg.update(INTERPRETER)
            return cfg
    raise AssertionError("unreachable: CONFIGS ends with a catch-all")


def tile(cfg: dict, rows: int, Dh: int) -> tuple[int, int, int]:
    """(BLOCK_R rows, BLOCK_D padded head dim, num_warps) of a program."""
    block_d = max(16, triton.next_power_of_2(Dh))
    block_r = max(1, min(cfg["values"] // block_d, triton.next_power_of_2(max(rows, 1))))
    num_warps = max(1, min(cfg["num_warps"], block_r * block_d // 256))
    return block_r, block_d, num_warps


@triton.jit
def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
                          n_rows, H, s_xt, s_xh, s_ct, s_cd, s_st, s_sd, eps,
                          Dh: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)     # [BLOCK_R] row = t * H + head
    t = r // H
    hd = r % H
    d = tl.arange(0, BLOCK_D)                                               # [BLOCK_D]
    rmask = r < n_rows
    dmask = d < Dh
    m = rmask[:, None] & dmask[None, :]
    row_x = (t * s_xt + hd * s_xh)[:, None]                                 # [BLOCK_R, 1]

    inputs_ready(PDL)
    x = tl.load(x_ptr + row_x + d[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / Dh + eps)                       # [BLOCK_R]
    w = tl.load(w_ptr + d, mask=dmask, other=0.0)
    y = x * rstd[:, None] * w[None, :]

    rot = d < 2 * HALF
    first = d < HALF
    p = tl.where(first, d + HALF, d - HALF)                                 # partner; used where rot
    j = tl.where(first, d, d - HALF)                                        # frequency index
    mr = rmask[:, None] & rot[None, :]
    xp = tl.load(x_ptr + row_x + p[None, :], mask=mr, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + p, mask=rot, other=0.0)
    yp = xp * rstd[:, None] * wp[None, :]
    c = tl.load(cos_ptr + (t * s_ct)[:, None] + (j * s_cd)[None, :], mask=mr, other=1.0)
    s = tl.load(sin_ptr + (t * s_st)[:, None] + (j * s_sd)[None, :], mask=mr, other=0.0)
    s = tl.where(first[None, :], -s, s)
    out = y * c + yp * s
    tl.store(out_ptr + r[:, None] * Dh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm_rope_triton(x, weight, cos, sin, eps, cfg=None):
    """Shapes and dtypes are validated by the op; x may be any view with a unit last stride (else
    it is copied). cfg: launch choices (tests), default `launch_config()`."""
    T, H, Dh = x.shape
    out = alloc.empty((T, H, Dh), x.dtype, x.device)
    if T * H == 0:
        return out
    if x.stride(2) != 1:
        x = x.contiguous()
    block_r, block_d, num_warps = tile(cfg or launch_config(), T * H, Dh)
    _rms_norm_rope_kernel[(triton.cdiv(T * H, block_r),)](
        x, weight.contiguous(), cos, sin, out,
        T * H, H, x.stride(0), x.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        float(eps), Dh=Dh, HALF=cos.shape[1], BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps,
        **pdl_args())
    return out
