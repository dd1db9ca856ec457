"""Portable Triton gated RMSNorm (CUDA, ROCm, XPU; CPU under TRITON_INTERPRET=1).

The kernels normalise *segments*: a segment is one group of `G` channels of one row (the
whole row when group_size is None), so grouped and plain norms share one code path and
narrow groups of wide rows still get several segments per program. Segment s lives in row
s // NG at column (s % NG) * G, where NG = D // G.

Two kernels, picked by segment width:
- `_block_kernel`: BLOCK_S segments x BLOCK_N (>= G) channels held in registers; one read of
  every input, one write of every output (the bandwidth-optimal form). Narrow segments get
  many per program (1M x 128: 32 rows), wide ones one per program.
- `_loop_kernel`: segments wider than MAX_BLOCK_N; one segment per program, two passes over
  chunks (sum of squares, then normalise), the second pass mostly hitting L2.

Configs are picked by a heuristic (no autotune, so the interpreter runs the same code).
Loads along the channel axis are contiguous and, with 16-byte aligned rows, vectorise to
16-byte accesses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc
from ..common.pdl import inputs_ready, pdl_args

MAX_BLOCK_N = 8192         # widest segment kept in registers (16 warps: 16 fp32 per thread per tensor)
LOOP_BLOCK_N = 4096        # chunk width of the two-pass kernel
ELEMS_PER_PROGRAM = 4096   # narrow segments: this many elements per program (8 KB of bf16 per tensor)


@triton.jit
def _act(g, ACT: tl.constexpr):
    # ACT: 0 = sigmoid, 1 = silu/swish
    s = tl.sigmoid(g)
    if ACT == 1:
        s = g * s
    return s


@triton.jit
def _block_kernel(x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, y_ptr, ro_ptr,
                  n_seg, sx, sr, sg, eps,
                  G: tl.constexpr, NG: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  STORE_RES: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ACT: tl.constexpr,
                  PDL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    seg = pid * BLOCK_S + tl.arange(0, BLOCK_S)          # [BLOCK_S]
    cols = tl.arange(0, BLOCK_N)                          # [BLOCK_N]
    if NG > 1:
        row = seg // NG
        c = ((seg % NG) * G)[:, None] + cols[None, :]     # [BLOCK_S, BLOCK_N] column inside the row
    else:
        row = seg
        c = cols[None, :]                                 # [1, BLOCK_N]: plain offsets vectorise best
    m = (seg < n_seg)[:, None] & (cols < G)[None, :]      # [BLOCK_S, BLOCK_N]
    # Outputs are contiguous [rows, D] = [rows, NG * G].
    o = row[:, None] * (NG * G) + c

    inputs_ready(PDL)
    x = tl.load(x_ptr + row[:, None] * sx + c, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + row[:, None] * sr + c, mask=m, other=0.0).to(tl.float32)
    if STORE_RES:
        tl.store(ro_ptr + o, x.to(ro_ptr.dtype.element_ty), mask=m)
    if HAS_GATE:
        a = _act(tl.load(g_ptr + row[:, None] * sg + c, mask=m, other=0.0).to(tl.float32), ACT)
        if not NORM_BEFORE_GATE:
            x = x * a
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / G + eps)     # [BLOCK_S]
    wm = (cols < G)[None, :]
    y = x * rstd[:, None] * tl.load(w_ptr + c, mask=wm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + c, mask=wm, other=0.0).to(tl.float32)
    if HAS_GATE:
        if NORM_BEFORE_GATE:
            y = y * a
    tl.store(y_ptr + o, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _loop_kernel(x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, y_ptr, ro_ptr,
                 sx, sr, sg, eps,
                 G: tl.constexpr, NG: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 STORE_RES: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ACT: tl.constexpr,
                 PDL: tl.constexpr):
    seg = tl.program_id(0).to(tl.int64)
    row = seg // NG
    col0 = (seg % NG) * G
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    inputs_ready(PDL)
    for start in range(0, G, BLOCK_N):                    # pass 1: sum of squares
        c = start + cols
        m = c < G
        x = tl.load(x_ptr + row * sx + col0 + c, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(r_ptr + row * sr + col0 + c, mask=m, other=0.0).to(tl.float32)
        if STORE_RES:
            tl.store(ro_ptr + row * (NG * G) + col0 + c, x.to(ro_ptr.dtype.element_ty), mask=m)
        if HAS_GATE:
            if not NORM_BEFORE_GATE:
                x = x * _act(tl.load(g_ptr + row * sg + col0 + c, mask=m, other=0.0).to(tl.float32), ACT)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / G + eps)
    for start in range(0, G, BLOCK_N):                    # pass 2: normalise and write
        c = start + cols
        m = c < G
        x = tl.load(x_ptr + row * sx + col0 + c, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(r_ptr + row * sr + col0 + c, mask=m, other=0.0).to(tl.float32)
        if HAS_GATE:
            a = _act(tl.load(g_ptr + row * sg + col0 + c, mask=m, other=0.0).to(tl.float32), ACT)
            if not NORM_BEFORE_GATE:
                x = x * a
        y = x * rstd * tl.load(w_ptr + col0 + c, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + col0 + c, mask=m, other=0.0).to(tl.float32)
        if HAS_GATE:
            if NORM_BEFORE_GATE:
                y = y * a
        tl.store(y_ptr + row * (NG * G) + col0 + c, y.to(y_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor | None, D: int) -> torch.Tensor | None:
    """[..., D] -> [rows, D] with unit channel stride (a view when possible; any row stride)."""
    if t is None:
        return None
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def config(n_seg: int, G: int) -> dict:
    """Heuristic launch config for `n_seg` segments of width G."""
    block_n = max(16, triton.next_power_of_2(G))
    if block_n > MAX_BLOCK_N:
        return dict(kernel="loop", BLOCK_N=LOOP_BLOCK_N, num_warps=16)
    block_s = max(1, ELEMS_PER_PROGRAM // block_n)
    block_s = min(block_s, max(1, triton.next_power_of_2(n_seg)))
    # 16 elements per thread: two 16-byte loads of bf16 per tensor (1M x 128 -> 32 rows on
    # 8 warps; 65536 x 4096 -> one row on 8 warps; 8192-wide rows -> 16 warps).
    num_warps = max(1, min(16, block_s * block_n // 512))
    return dict(kernel="block", BLOCK_S=block_s, BLOCK_N=block_n, num_warps=num_warps)


def gated_rms_norm_triton(x, weight, gate=None, eps=1e-6, group_size=None, norm_before_gate=True,
                          activation="sigmoid", bias=None, residual=None, prenorm=False,
                          residual_in_fp32=False):
    """Shapes and dtypes are validated by the op; this wrapper flattens to [rows, D] and launches."""
    D = x.shape[-1]
    G = D if group_size is None else group_size
    x2, g2, r2 = _rows(x, D), _rows(gate, D), _rows(residual, D)
    rows = x2.shape[0]
    y = alloc.empty(x.shape, x.dtype, x.device)
    res_dtype = torch.float32 if residual_in_fp32 else (residual.dtype if residual is not None else x.dtype)
    ro = alloc.empty(x.shape, res_dtype, x.device) if prenorm else None
    n_seg = rows * (D // G)
    if n_seg == 0:
        return (y, ro) if prenorm else y
    cfg = config(n_seg, G)
    # Absent tensors are passed as x; their loads/stores are compiled out by the flags.
    args = (x2, r2 if r2 is not None else x2, g2 if g2 is not None else x2, weight.contiguous(),
            bias.contiguous() if bias is not None else weight, y, ro if ro is not None else y)
    strides = (x2.stride(0), r2.stride(0) if r2 is not None else 0, g2.stride(0) if g2 is not None else 0)
    flags = dict(HAS_RES=residual is not None, HAS_GATE=gate is not None, HAS_BIAS=bias is not None,
                 STORE_RES=prenorm, NORM_BEFORE_GATE=bool(norm_before_gate),
                 ACT=0 if activation == "sigmoid" else 1)
    if cfg["kernel"] == "block":
        grid = (triton.cdiv(n_seg, cfg["BLOCK_S"]),)
        _block_kernel[grid](*args, n_seg, *strides, eps, G=G, NG=D // G, BLOCK_S=cfg["BLOCK_S"],
                            BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], **flags, **pdl_args())
    else:
        _loop_kernel[(n_seg,)](*args, *strides, eps, G=G, NG=D // G, BLOCK_N=cfg["BLOCK_N"],
                               num_warps=cfg["num_warps"], **flags, **pdl_args())
    return (y, ro) if prenorm else y
