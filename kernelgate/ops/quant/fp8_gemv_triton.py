"""One-token GEMV pieces on FP8 e4m3fn weight rows, shared by fp8_linear's one-token form (here) and the
experts GEMV (moe/fused_experts_words_triton.py).

The weight rows are read as int32 words of 4 codes: a program owns R rows and walks K in steps of W
words, the tile [R, W] loaded one step ahead in the source. (In the sm_90 code of the linear GEMV and of
the experts' gate/up kernel ptxas sinks those loads to the end of the loop, into the registers of the tile
just used, so each step still waits a memory latency; tiles two steps ahead keep them apart -- a probe,
bench/ops/variants/gemv_inflight.py, bench/RESULTS.md Session 32.) Each word's 4 codes are decoded and
dotted with their 4 activations at once (dot4):
  - PTX (NVIDIA sm_89+, compiled): two cvt.rn.f16x2.e4m3x2, four f16 -> f32, a multiply and three
    FMAs in inline assembly -- 2.5 instructions a code;
  - elsewhere (AMD, Intel, sm_80, the interpreter) integer ops on the word: the byte moved to the
    top and shifted right arithmetically by 4 is, masked, the fp32 whose value is the code's times
    2^-120 (fp8 subnormals land on fp32 subnormals), times 2^120. Exact either way; NaN codes are
    not supported.
bf16 activations come as int64 words of four (x4), split by shifts once per thread and step and
reused by every row the thread holds (the [W] vectors are in the slice of the tile's layout: no
exchange through shared memory in the sm_90 loops); fp16 / fp32 ones, and bf16 rows that are not
contiguous and 8-byte aligned, by element loads (x_words). The word sums take their scale block's
scale per K step and column (rows of a tile inside one scale block), or, with one K block (per
channel, or K <= bk), per row at the end. The experts GEMV at one token
(moe/fused_experts_words_triton.py) walks bf16 rows the same way, as int64 words of 4 values that
dot4 splits by shifts and masks (exact), with no scales.

Why: the previous GEMV (codes decoded one at a time, 128-256 codes per row and step, loaded in the
step that used them) measured ~6 instructions a code in its compiled loop and waited a memory latency
per K step; on the H200 Kimi's experts at one token took 29.2 µs (0.51 of the copy floor), this form
21.0 (0.72), and the projections 10-40 % less (bench/ops/fp8_gemv_sweep.py, bench/RESULTS.md
Session 30). The step length mattered most: the same form with 128-code steps was no faster than the
old one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import platform
from ..common.pdl import inputs_ready, pdl_args
from .fp8_weights import block_dims

_UNBIAS = tl.constexpr(2.0 ** 120)

# sum_b code_b * x_b over the 4 e4m3fn codes of the word $1 (byte b) and the fp32 $2..$5
_DOT4_PTX = tl.constexpr("""
{
 .reg .b16 lo, hi;
 .reg .b32 p01, p23;
 .reg .f16 h0, h1, h2, h3;
 .reg .f32 f0, f1, f2, f3;
 mov.b32 {lo, hi}, $1;
 cvt.rn.f16x2.e4m3x2 p01, lo;
 cvt.rn.f16x2.e4m3x2 p23, hi;
 mov.b32 {h0, h1}, p01;
 mov.b32 {h2, h3}, p23;
 cvt.f32.f16 f0, h0;
 cvt.f32.f16 f1, h1;
 cvt.f32.f16 f2, h2;
 cvt.f32.f16 f3, h3;
 mul.rn.f32 $0, f0, $2;
 fma.rn.f32 $0, f1, $3, $0;
 fma.rn.f32 $0, f2, $4, $0;
 fma.rn.f32 $0, f3, $5, $0;
}
""")

# Launches on NVIDIA (H200, bench/ops/fp8_gemv_sweep.py, Session 30): 16-row programs of 4 warps,
# 512-code steps where K allows (else 256): KDA in_proj 12,576 x 2,304 7.1 µs (10.1 before), o_proj
# 2,304 x 4,096 5.9 (6.5), MLA q_proj 6.8 (9.3), kv_b 2.2 (3.3), GDN in_proj 6.4 (9.1), out_proj 4.8 (6.9).
# From K = 4,096 on, 1,024-code steps (Session 31, `--masked` sweep): KDA o_proj 6.3 -> 4.4 µs, GDN out_proj
# 5.4 -> 4.4; at K = 2,048 they were slower (GDN in_proj 7.0 -> 8.4: two steps leave the load-ahead little to hide).
# (Both sweeps timed one weight call after call, so it stayed in the L2: a decode step reads these weights
# from HBM, where longer steps -- more bytes in flight -- may win more; bench/RESULTS.md Session 31. Steps of
# W words with W >= 32 x num_warps move their activations through shared memory every step on sm_90 --
# the WIDE launch does: Session 32.)
LINEAR = {"cuda": dict(R=16, C=512, num_warps=4, WIDE=(4096, 1024))}
_LINEAR_DEFAULT = dict(R=16, C=256, num_warps=4)
_INTERP = dict(R=16, C=128, num_warps=4)


def k_tile(bk: int, K: int, want: int) -> int:
    """Largest power-of-two K tile <= want that stays inside one scale block of bk (any, with one K block)."""
    if triton.cdiv(K, bk) <= 1:
        return want
    t = want
    while t > 1 and bk % t:
        t //= 2
    return t


def ptx_decode(plat) -> bool:
    """Whether kernels on `plat` decode words with dot4's inline PTX (compiled NVIDIA sm_89+)."""
    cap = plat.capability or ""
    return plat.name == "cuda" and plat.triton_mode == "compiled" and cap.startswith("sm_") and int(cap[3:]) >= 89


def words_ok(K: int, block_size, *weights: torch.Tensor) -> str | None:
    """None, or why weights [.., N, K] cannot be read as int32 words of 4 codes."""
    if K % 4:
        return f"K = {K} is not a multiple of 4 (codes per word)"
    if block_size is not None and block_dims(block_size, K)[1] % 4 and triton.cdiv(K, block_dims(block_size, K)[1]) > 1:
        return f"block_size {block_size}: a scale block's K size is not a multiple of 4 (codes per word)"
    for w in weights:
        if w.stride(-1) != 1 or any(s % 4 for s in w.stride()[:-1]) or w.data_ptr() % 4:
            return "the weight is not a row-major view with 4-byte aligned rows"
    return None


def step(K: int, C: int) -> tuple[int, bool]:
    """(W, EVEN): words per K step (at most C codes, at most K rounded up) and whether they tile K."""
    W = min(C // 4, triton.next_power_of_2(K // 4))
    for c in (W, W // 2, W // 4):        # a step that tiles K exactly, if one of the three does
        if c >= 8 and (K // 4) % c == 0:
            return c, True
    return W, (K // 4) % W == 0


def rows_per_program(R: int, one_kblock: bool, *row_blocks: int) -> int:
    """R, halved until it divides every scale-block row count given (a tile's rows share one scale row)."""
    while not one_kblock and R > 1 and any(b % R for b in row_blocks):
        R //= 2
    return R


@triton.jit
def _code_f32(w, SHIFT: tl.constexpr):
    """The code in bits SHIFT..SHIFT+7 of int32 words w as fp32, exactly (integer decode)."""
    if SHIFT == 24:
        b = w >> 4
    else:
        b = (w << (24 - SHIFT)) >> 4                            # the byte on top; arithmetic shift
    return (b & -2014314496).to(tl.float32, bitcast=True) * _UNBIAS    # mask 0x87F00000


@triton.jit
def dot4(w, x0, x1, x2, x3, PTX: tl.constexpr):
    """sum_b code_b(w) * x_b over the 4 codes of each int32 word w (byte b: K offset 4i + b); for int64
    words, the 4 bf16 values of each (value b: bits 16b..16b+15), moved to the top of an fp32 exactly."""
    if w.dtype == tl.int64:
        lo = w.to(tl.int32)
        hi = (w >> 32).to(tl.int32)
        t = (lo << 16).to(tl.float32, bitcast=True) * x0 + (lo & -65536).to(tl.float32, bitcast=True) * x1
        t = t + (hi << 16).to(tl.float32, bitcast=True) * x2 + (hi & -65536).to(tl.float32, bitcast=True) * x3
    elif PTX:
        t = tl.inline_asm_elementwise(_DOT4_PTX, "=f,r,f,f,f,f", [w, x0, x1, x2, x3], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        t = _code_f32(w, 0) * x0 + _code_f32(w, 8) * x1 + _code_f32(w, 16) * x2 + _code_f32(w, 24) * x3
    return t


@triton.jit
def x4(x_ptr, i, KW, sxk, EVEN: tl.constexpr, WORDS: tl.constexpr):
    """The activations at K offsets 4i .. 4i + 3 as four fp32 vectors (0 past K). WORDS: x_ptr is the int64
    view of a contiguous bf16 row (x_words), four values a word, split by shifts; else element loads."""
    ok = i < KW
    if WORDS:
        if EVEN:
            v = tl.load(x_ptr + i)
        else:
            v = tl.load(x_ptr + i, mask=ok, other=0)
        lo = v.to(tl.int32)
        hi = (v >> 32).to(tl.int32)
        x0 = (lo << 16).to(tl.float32, bitcast=True)
        x1 = (lo & -65536).to(tl.float32, bitcast=True)
        x2 = (hi << 16).to(tl.float32, bitcast=True)
        x3 = (hi & -65536).to(tl.float32, bitcast=True)
    else:
        x0 = tl.load(x_ptr + (4 * i) * sxk, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + (4 * i + 1) * sxk, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + (4 * i + 2) * sxk, mask=ok, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + (4 * i + 3) * sxk, mask=ok, other=0.0).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def row_tile(w_ptr, n0, N, swn, R: tl.constexpr, W: tl.constexpr):
    """(pointers to the [R, W] word tile of rows n0 .., its rows): rows past N read row N - 1 (no mask)."""
    rows = n0 + tl.arange(0, R)
    return w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * swn + tl.arange(0, W)[None, :], rows


@triton.jit
def _load_tile(tiles, k, KW, W: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:
        w = tl.load(tiles + k)
    else:
        w = tl.load(tiles + k, mask=(k + tl.arange(0, W) < KW)[None, :], other=0)
    return w


@triton.jit
def _step_scales(s_row, k0, KW, ssk, bkw: tl.constexpr, W: tl.constexpr):
    """[W]: the scale of each word column's K block in the scale row s_row (0 past K)."""
    kk = k0 + tl.arange(0, W)
    return tl.load(s_row + (kk // bkw) * ssk, mask=kk < KW, other=0.0)


@triton.jit
def rows_dot(w_tiles, s_row, x_ptr, KW, sxk, ssk, bkw: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
             ONE_KBLOCK: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr, WORDS: tl.constexpr,
             PDL: tl.constexpr):
    """[R]: the tile rows' dot products with x over K (times their scales per K step unless ONE_KBLOCK).
    The first tile is loaded before the PDL wait (weights are never written by the step)."""
    cols = tl.arange(0, W)
    w = _load_tile(w_tiles, 0, KW, W, EVEN)
    inputs_ready(PDL)
    x0, x1, x2, x3 = x4(x_ptr, cols, KW, sxk, EVEN, WORDS)
    acc = tl.zeros([R, W], dtype=tl.float32)
    for k0 in range(0, KW, W):
        if EVEN:
            kn = tl.minimum(k0 + W, KW - W)             # (the last step reloads its own tile, unused)
        else:
            kn = k0 + W
        w_next = _load_tile(w_tiles, kn, KW, W, EVEN)
        n0, n1, n2, n3 = x4(x_ptr, kn + cols, KW, sxk, EVEN, WORDS)
        t = dot4(w, x0[None, :], x1[None, :], x2[None, :], x3[None, :], PTX)
        if ONE_KBLOCK:
            acc += t
        else:
            acc += t * _step_scales(s_row, k0, KW, ssk, bkw, W)[None, :]
        w = w_next
        x0, x1, x2, x3 = n0, n1, n2, n3
    return tl.sum(acc, axis=1)


@triton.jit
def rows_dot2(g_tiles, u_tiles, sg_row, su_row, x_ptr, KW, sxk, ssk, bkw: tl.constexpr, R: tl.constexpr,
              W: tl.constexpr, ONE_KBLOCK: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr,
              WORDS: tl.constexpr):
    """rows_dot over two tiles of the same activations (an expert's gate and up rows), one loop: the
    activations are split once for both. No PDL wait here (the caller waits before it knows the tiles)."""
    cols = tl.arange(0, W)
    g = _load_tile(g_tiles, 0, KW, W, EVEN)
    u = _load_tile(u_tiles, 0, KW, W, EVEN)
    x0, x1, x2, x3 = x4(x_ptr, cols, KW, sxk, EVEN, WORDS)
    acc_g = tl.zeros([R, W], dtype=tl.float32)
    acc_u = tl.zeros([R, W], dtype=tl.float32)
    for k0 in range(0, KW, W):
        if EVEN:
            kn = tl.minimum(k0 + W, KW - W)
        else:
            kn = k0 + W
        g_next = _load_tile(g_tiles, kn, KW, W, EVEN)
        u_next = _load_tile(u_tiles, kn, KW, W, EVEN)
        n0, n1, n2, n3 = x4(x_ptr, kn + cols, KW, sxk, EVEN, WORDS)
        tg = dot4(g, x0[None, :], x1[None, :], x2[None, :], x3[None, :], PTX)
        tu = dot4(u, x0[None, :], x1[None, :], x2[None, :], x3[None, :], PTX)
        if ONE_KBLOCK:
            acc_g += tg
            acc_u += tu
        else:
            acc_g += tg * _step_scales(sg_row, k0, KW, ssk, bkw, W)[None, :]
            acc_u += tu * _step_scales(su_row, k0, KW, ssk, bkw, W)[None, :]
        g = g_next
        u = u_next
        x0, x1, x2, x3 = n0, n1, n2, n3
    return tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)


@triton.jit
def row_scales(s_ptr, rows, N, bn, ssn):
    """[R]: each row's scale with one K block (rows past N read row N - 1's)."""
    return tl.load(s_ptr + (tl.minimum(rows, N - 1) // bn).to(tl.int64) * ssn)


@triton.jit
def rows_of(x_row, kk, sxk, K, ROWS: tl.constexpr):
    """[ROWS, *kk.shape] fp32: the activations at K offsets kk ([BK] or [NB, BK]), once per weight row --
    loaded in the weight tile's own shape, so both loads get the same register layout (same shape,
    contiguous along K) and the product needs no exchange through shared memory (a [NB, BK] load
    broadcast to the rows does: the compiled loops then wait at barriers); the repeated rows are L1 hits.
    (The bf16 GEMVs' form: linear/linear_gemv_triton.py, moe/fused_experts_gemv_triton.py.)"""
    if len(kk.shape) == 1:
        ptrs = tl.broadcast_to((x_row + kk * sxk)[None, :], (ROWS, kk.shape[0]))
        m = tl.broadcast_to((kk < K)[None, :], (ROWS, kk.shape[0]))
    else:
        ptrs = tl.broadcast_to((x_row + kk * sxk)[None, :, :], (ROWS, kk.shape[0], kk.shape[1]))
        m = tl.broadcast_to((kk < K)[None, :, :], (ROWS, kk.shape[0], kk.shape[1]))
    return tl.load(ptrs, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, KW, sxk, swn, ssn, ssk, bn, bkw: tl.constexpr,
                 R: tl.constexpr, W: tl.constexpr, ONE_KBLOCK: tl.constexpr, EVEN: tl.constexpr,
                 PTX: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr):
    # KW, W, bkw: K, the step and a scale block's K size in words
    n0 = tl.program_id(0) * R
    tiles, rows = row_tile(w_ptr, n0, N, swn, R, W)
    y = rows_dot(tiles, s_ptr + (n0 // bn).to(tl.int64) * ssn, x_ptr, KW, sxk, ssk, bkw, R, W, ONE_KBLOCK, EVEN, PTX,
                 WORDS, PDL)
    if ONE_KBLOCK:
        y = y * row_scales(s_ptr, rows, N, bn, ssn)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def x_words(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(what a kernel reads activations from, WORDS): the int64 view of bf16 rows of contiguous values
    (four a word; rows 8-byte aligned), else x as it is."""
    if x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.shape[-1] % 4 == 0 and x.data_ptr() % 8 == 0 \
            and all(s % 4 == 0 for s in x.stride()[:-1]):
        return x.view(torch.int64), True
    return x, False


def launch(plat) -> dict:
    return dict(_INTERP if plat.triton_mode != "compiled" else LINEAR.get(plat.name, _LINEAR_DEFAULT))


def fp8_gemv(x, weight, weight_scale, block_size, y, cfg: dict | None = None):
    """y [1, N] = x [1, K] @ dequant(weight).T (words_ok holds); cfg: R, C, num_warps (launch() by default;
    WIDE = (min K, C) a longer step from that K on)."""
    K = x.shape[1]
    N = weight.shape[0]
    plat = platform.current()
    base = launch(plat)
    if cfg and "C" in cfg:
        base.pop("WIDE", None)                                  # an explicit step length holds at every K
    cfg = {**base, **(cfg or {})}
    bn, bk = block_dims(block_size, K)
    one_kblock = triton.cdiv(K, bk) == 1
    R = rows_per_program(cfg["R"], one_kblock, bn)
    min_k, wide_c = cfg.get("WIDE", (0, cfg["C"]))            # (K from which the steps take wide_c codes)
    W, even = step(K, wide_c if K >= min_k else cfg["C"])
    w = weight.view(torch.uint8).view(torch.int32)
    xw, words = x_words(x[0])
    _gemv_kernel[(triton.cdiv(N, R),)](
        xw, w, weight_scale, y, N, K // 4, x.stride(1), w.stride(0), *weight_scale.stride(), bn, max(bk // 4, 1),
        R=R, W=W, ONE_KBLOCK=one_kblock, EVEN=even, PTX=ptx_decode(plat), WORDS=words,
        num_warps=cfg["num_warps"], **pdl_args())
    return y
