"""Probe (issue 37, not dispatched): more weight bytes in flight for the one-token GEMVs -- weight tiles
loaded 2-3 K steps ahead instead of one (the FP8 linear GEMV, the experts' word GEMVs, the bf16 linear
GEMV), and an L2 prefetch of each projection program's rows before its PDL wait.

Why. The Session 31 profile had the FP8 projections at 1.6 TB/s in a decode step and the bf16 ones at
2.2 (PDL off). Two findings from the sm_90 code compiled on this machine (bench/RESULTS.md Session 32):
  - One step ahead is lost in the compiled loop: ptxas sinks the next tile's loads to the bottom of the
    loop, into the registers of the tile just used, so each step still waits a full memory latency (the
    FP8 linear GEMV, the FP8 experts' gate/up kernel; the bf16 gate/up and the FP8 down kernel keep their
    loads at the top). Two steps ahead need a second set of registers: the loads issued at the bottom of
    step i are used in step i + 2.
  - Longer steps (the other way to more bytes in flight: K = 2,304 tiles only 256-code steps, so Kimi's
    in_proj keeps 3.2 MB in flight and q_proj 1.6, where ~4-5 MB are needed) meet a compiler limit: a
    step's activation vectors ([W] words) stay in the tile's column layout only while W < 32 x num_warps
    (Triton rematerialises a load there only when it has fewer elements than threads); from W = 32 x warps
    on each step moves them and its scales through shared memory (10 barriers a step). 1,024-code steps
    with 4 or 8 warps and 512-code steps with 4 pay it (the dispatched o_proj launch at K = 4,096 does).

  - ahead (2 or 3) / experts_ahead (2): the tiles that many steps ahead, the first ones before the PDL
    wait where the kernel has one before its loads (the projections; the experts learn their weights from
    the router's ids after the wait). The bf16 linear GEMV (no load-ahead as dispatched) takes min(ahead, 2).
  - prefetch (pf_bytes > 0): `prefetch.global.L2` for every 128-byte line of a projection program's rows
    (at most pf_bytes a row) before its first tile and the wait. With PDL the program is resident while
    its predecessors (norms, the KDA step: latency-bound, HBM idle) still run, so its weights stream then.
    The L2 holds 50 MB: Kimi's FP8 in_proj is 29 MB, its bf16 one 58 MB (bf16 rows up to the budget).

    sys.path.insert(0, "bench/ops/variants"); from gemv_inflight import install
    install(ahead=2, experts_ahead=2, pf_bytes=4096)    # before the model's first step

install(pf_bytes, ahead, experts_ahead, fp8_c, bf16): fp8_c sets the FP8 linear GEMV's codes a K step at
every K, masked where they do not tile K (None: dispatch's); bf16: the bf16 linear GEMV too, so that an A/B
of FP8 against bf16 stays fair (the experts' kernels serve both). Prefetch is inline PTX: NVIDIA compiled
Triton only (test_gemv_inflight.py checks the rest in the interpreter). `bench/e2e/fp8_decode.py --forms
"none;gemv_inflight:ahead=2,experts_ahead=2"` measures the full model with it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernelgate.ops.common.pdl import inputs_ready
from kernelgate.ops.linear import linear_gemv_triton as lg
from kernelgate.ops.moe import fused_experts_words_triton as ew
from kernelgate.ops.quant import fp8_gemv_triton as gt

_LINE = 128                                      # bytes an L2 prefetch covers
_PF = tl.constexpr("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;")


@triton.jit
def prefetch_rows(w_ptr, rows, N, swn, span, PER_LINE: tl.constexpr, PF_LINES: tl.constexpr):
    """prefetch.global.L2 of the lines of weight rows `rows` (elements 0 .. span - 1 of each, at most
    PF_LINES lines a row; PER_LINE elements a line). Reads nothing into registers."""
    r = tl.minimum(rows, N - 1).to(tl.int64)
    o = tl.minimum(tl.arange(0, PF_LINES) * PER_LINE, span - 1)
    tl.inline_asm_elementwise(_PF, "=r,l", [w_ptr + r[:, None] * swn + o[None, :]], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _ahead(k0, d, KW, W: tl.constexpr, EVEN: tl.constexpr):
    """The K word offset d steps after k0 (EVEN: clamped to the last step, reloaded and unused)."""
    if EVEN:
        k = tl.minimum(k0 + d * W, KW - W)
    else:
        k = k0 + d * W
    return k


@triton.jit
def rows_dot_ahead(w_tiles, s_row, x_ptr, KW, sxk, ssk, bkw: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
                   ONE_KBLOCK: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr, WORDS: tl.constexpr,
                   PDL: tl.constexpr, AHEAD: tl.constexpr):
    """fp8_gemv_triton.rows_dot with the weight tiles loaded AHEAD (1-3) steps ahead, the first AHEAD
    before the PDL wait; the activations one step ahead as there."""
    cols = tl.arange(0, W)
    w = gt._load_tile(w_tiles, 0, KW, W, EVEN)
    w1 = w
    w2 = w
    if AHEAD >= 2:
        w1 = gt._load_tile(w_tiles, _ahead(0, 1, KW, W, EVEN), KW, W, EVEN)
    if AHEAD >= 3:
        w2 = gt._load_tile(w_tiles, _ahead(0, 2, KW, W, EVEN), KW, W, EVEN)
    inputs_ready(PDL)
    x0, x1, x2, x3 = gt.x4(x_ptr, cols, KW, sxk, EVEN, WORDS)
    acc = tl.zeros([R, W], dtype=tl.float32)
    for k0 in range(0, KW, W):
        w_next = gt._load_tile(w_tiles, _ahead(k0, AHEAD, KW, W, EVEN), KW, W, EVEN)
        n0, n1, n2, n3 = gt.x4(x_ptr, _ahead(k0, 1, KW, W, EVEN) + cols, KW, sxk, EVEN, WORDS)
        t = gt.dot4(w, x0[None, :], x1[None, :], x2[None, :], x3[None, :], PTX)
        if ONE_KBLOCK:
            acc += t
        else:
            acc += t * gt._step_scales(s_row, k0, KW, ssk, bkw, W)[None, :]
        if AHEAD == 1:
            w = w_next
        elif AHEAD == 2:
            w = w1
            w1 = w_next
        else:
            w = w1
            w1 = w2
            w2 = w_next
        x0, x1, x2, x3 = n0, n1, n2, n3
    return tl.sum(acc, axis=1)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, KW, sxk, swn, ssn, ssk, bn, bkw: tl.constexpr,
                     R: tl.constexpr, W: tl.constexpr, ONE_KBLOCK: tl.constexpr, EVEN: tl.constexpr,
                     PTX: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr,
                     AHEAD: tl.constexpr):
    # fp8_gemv_triton._gemv_kernel with the prefetch first (w_ptr: int32 words, 32 a line) and rows_dot_ahead
    n0 = tl.program_id(0) * R
    tiles, rows = gt.row_tile(w_ptr, n0, N, swn, R, W)
    if PF_LINES > 0:
        prefetch_rows(w_ptr, rows, N, swn, KW, 32, PF_LINES)
    y = rows_dot_ahead(tiles, s_ptr + (n0 // bn).to(tl.int64) * ssn, x_ptr, KW, sxk, ssk, bkw, R, W, ONE_KBLOCK,
                       EVEN, PTX, WORDS, PDL, AHEAD)
    if ONE_KBLOCK:
        y = y * gt.row_scales(s_ptr, rows, N, bn, ssn)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _bf16_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, sxk, swn, swk, syn, ROWS: tl.constexpr, WIDTH: tl.constexpr,
                      X_ROWS: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr, AHEAD: tl.constexpr):
    # linear_gemv_triton._gemv_kernel with the prefetch first (2-byte weights, 64 a line) and its tiles
    # loaded AHEAD (1 or 2) steps ahead (AHEAD 1: loaded in the step that uses them, as dispatched)
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n_ok = n < N
    if PF_LINES > 0:
        prefetch_rows(w_ptr, n, N, swn, (K - 1) * swk + 1, 64, PF_LINES)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * swn
    kk = tl.arange(0, WIDTH)
    w = tl.load(w_rows + kk[None, :] * swk, mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
    w1 = w
    if AHEAD == 2:
        w1 = tl.load(w_rows + (WIDTH + kk)[None, :] * swk, mask=n_ok[:, None] & (WIDTH + kk < K)[None, :], other=0.0)
    inputs_ready(PDL)
    acc = w.to(tl.float32) * lg._x_at(x_ptr, kk, sxk, K, ROWS, X_ROWS)
    for k0 in range(WIDTH, K, WIDTH):
        kk = k0 + tl.arange(0, WIDTH)
        if AHEAD == 2:
            w = w1
            w1 = tl.load(w_rows + (WIDTH + kk)[None, :] * swk, mask=n_ok[:, None] & (WIDTH + kk < K)[None, :],
                         other=0.0)
        else:
            w = tl.load(w_rows + kk[None, :] * swk, mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * lg._x_at(x_ptr, kk, sxk, K, ROWS, X_ROWS)
    tl.store(y_ptr + n * syn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def rows_dot2_ahead(g_tiles, u_tiles, sg_row, su_row, x_ptr, KW, sxk, ssk, bkw: tl.constexpr, R: tl.constexpr,
                    W: tl.constexpr, ONE_KBLOCK: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr,
                    WORDS: tl.constexpr, AHEAD: tl.constexpr):
    """fp8_gemv_triton.rows_dot2 (an expert's gate and up rows, one loop over x) with the tiles AHEAD (1 or 2)
    steps ahead."""
    cols = tl.arange(0, W)
    g = gt._load_tile(g_tiles, 0, KW, W, EVEN)
    u = gt._load_tile(u_tiles, 0, KW, W, EVEN)
    g1 = g
    u1 = u
    if AHEAD == 2:
        g1 = gt._load_tile(g_tiles, _ahead(0, 1, KW, W, EVEN), KW, W, EVEN)
        u1 = gt._load_tile(u_tiles, _ahead(0, 1, KW, W, EVEN), KW, W, EVEN)
    x0, x1, x2, x3 = gt.x4(x_ptr, cols, KW, sxk, EVEN, WORDS)
    acc_g = tl.zeros([R, W], dtype=tl.float32)
    acc_u = tl.zeros([R, W], dtype=tl.float32)
    for k0 in range(0, KW, W):
        kn = _ahead(k0, AHEAD, KW, W, EVEN)
        g_next = gt._load_tile(g_tiles, kn, KW, W, EVEN)
        u_next = gt._load_tile(u_tiles, kn, KW, W, EVEN)
        n0, n1, n2, n3 = gt.x4(x_ptr, _ahead(k0, 1, KW, W, EVEN) + cols, KW, sxk, EVEN, WORDS)
        tg = gt.dot4(g, x0[None, :], x1[None, :], x2[None, :], x3[None, :], PTX)
        tu = gt.dot4(u, x0[None, :], x1[None, :], x2[None, :], x3[None, :], PTX)
        if ONE_KBLOCK:
            acc_g += tg
            acc_u += tu
        else:
            acc_g += tg * gt._step_scales(sg_row, k0, KW, ssk, bkw, W)[None, :]
            acc_u += tu * gt._step_scales(su_row, k0, KW, ssk, bkw, W)[None, :]
        if AHEAD == 2:
            g = g1
            u = u1
            g1 = g_next
            u1 = u_next
        else:
            g = g_next
            u = u_next
        x0, x1, x2, x3 = n0, n1, n2, n3
    return tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, I, KW, E, sxd, swe, swr, sse, ssr, ssk, bn,
                    bkw: tl.constexpr, limit, HAS_LIMIT: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
                    SCALED: tl.constexpr, ONE_KBLOCK: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr,
                    WORDS: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr):
    # fused_experts_words_triton._gate_up_kernel on rows_dot2_ahead
    j = tl.program_id(0)
    i0 = tl.program_id(1) * R
    inputs_ready(PDL)
    valid, w_e, s_e = ew._slot_expert(ids_ptr, j, E, w_ptr, swe, s_ptr, sse)
    g_tiles, rows = gt.row_tile(w_e, i0, I, swr, R, W)
    u_tiles, _ = gt.row_tile(w_e + I * swr, i0, I, swr, R, W)
    g, u = rows_dot2_ahead(g_tiles, u_tiles, s_e + (i0 // bn) * ssr, s_e + ((i0 + I) // bn) * ssr, x_ptr, KW, sxd,
                           ssk, bkw, R, W, ONE_KBLOCK, EVEN, PTX, WORDS, AHEAD)
    if SCALED and ONE_KBLOCK:
        g = g * gt.row_scales(s_e, rows, I, bn, ssr)
        u = u * gt.row_scales(s_e, rows + I, 2 * I, bn, ssr)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = tl.where(valid, g * tl.sigmoid(g) * u, 0.0)
    tl.store(h_ptr + j * I + rows, h.to(h_ptr.dtype.element_ty), mask=rows < I)


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, y_ptr, D, KW, E, shj, swe, swr, sse, ssr, ssk, stw, bn,
                 bkw: tl.constexpr, R: tl.constexpr, W: tl.constexpr, SCALED: tl.constexpr, ONE_KBLOCK: tl.constexpr,
                 EVEN: tl.constexpr, PTX: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr):
    # fused_experts_words_triton._down_kernel on rows_dot_ahead
    j = tl.program_id(0)
    o0 = tl.program_id(1) * R
    inputs_ready(PDL)
    valid, w_e, s_e = ew._slot_expert(ids_ptr, j, E, w_ptr, swe, s_ptr, sse)
    tiles, rows = gt.row_tile(w_e, o0, D, swr, R, W)
    y = rows_dot_ahead(tiles, s_e + (o0 // bn) * ssr, h_ptr + j * shj, KW, 1, ssk, bkw, R, W, ONE_KBLOCK, EVEN, PTX,
                       WORDS, False, AHEAD)
    if SCALED and ONE_KBLOCK:
        y = y * gt.row_scales(s_e, rows, D, bn, ssr)
    y = tl.where(valid, y * tl.load(tw_ptr + j * stw), 0.0)
    tl.store(y_ptr + j * D + rows, y, mask=rows < D)


class _With:
    """kernel[grid](*args, **kw) with constexprs added: stands in for a module's kernel in its host code."""

    def __init__(self, kernel, **extra):
        self.kernel, self.extra = kernel, extra

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *a, **kw: launch(*a, **self.extra, **kw)


def _masked_step(K: int, C: int) -> tuple[int, bool]:
    """fp8_gemv_triton.step without shrinking the step until it tiles K (the last step masked)."""
    W = min(C // 4, triton.next_power_of_2(K // 4))
    return W, (K // 4) % W == 0


_ORIGINAL = dict(fp8=gt._gemv_kernel, bf16=lg._gemv_kernel, step=gt.step, gate_up=ew._gate_up_kernel,
                 down=ew._down_kernel, linear={k: dict(v) for k, v in gt.LINEAR.items()})


def install(pf_bytes: int = 0, ahead: int = 1, experts_ahead: int = 1, fp8_c: int | None = None,
            bf16: bool = True) -> str:
    """Patch the one-token GEMVs as the module docstring says; returns a line saying what is installed.
    uninstall() puts dispatch's kernels back."""
    if ahead not in (1, 2, 3) or experts_ahead not in (1, 2):
        raise ValueError(f"gemv_inflight: ahead must be 1, 2 or 3 and experts_ahead 1 or 2, got {ahead}, {experts_ahead}")
    lines = triton.next_power_of_2(max(pf_bytes, 1) // _LINE) if pf_bytes > 0 else 0
    gt._gemv_kernel = _With(_fp8_gemv_kernel, PF_LINES=lines, AHEAD=ahead)
    if bf16:
        lg._gemv_kernel = _With(_bf16_gemv_kernel, PF_LINES=lines, AHEAD=min(ahead, 2))
    ew._gate_up_kernel = _With(_gate_up_kernel, AHEAD=experts_ahead)
    ew._down_kernel = _With(_down_kernel, AHEAD=experts_ahead)
    if fp8_c:
        gt.step = _masked_step
        for cfg in gt.LINEAR.values():
            cfg.update(C=fp8_c)
            cfg.pop("WIDE", None)
    return (f"gemv_inflight: L2 prefetch {lines} lines ({lines * _LINE} B) a row; tiles {ahead} steps ahead in the "
            f"FP8 linear GEMV{f', {min(ahead, 2)} in the bf16 one' if bf16 else ''}, {experts_ahead} in the experts' "
            f"word GEMVs (FP8 and bf16); FP8 linear steps {fp8_c or 'as dispatched'}")


def uninstall() -> None:
    gt._gemv_kernel, lg._gemv_kernel, gt.step = _ORIGINAL["fp8"], _ORIGINAL["bf16"], _ORIGINAL["step"]
    ew._gate_up_kernel, ew._down_kernel = _ORIGINAL["gate_up"], _ORIGINAL["down"]
    gt.LINEAR.clear()
    gt.LINEAR.update({k: dict(v) for k, v in _ORIGINAL["linear"].items()})
