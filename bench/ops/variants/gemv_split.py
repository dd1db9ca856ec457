"""Probe (issue 37, not dispatched): the one-token FP8 projections with K split over several programs
where the weight has few rows, and narrower programs elsewhere.

Why. A one-token GEMV (kernelgate/ops/quant/fp8_gemv_triton.py) keeps about N rows x one K step of bytes in
flight; the short-and-wide projections (o_proj 2,304 x 4,096: 1.2-2.4 MB) are far below the ~4 MB the H200
needs, and read at 0.35-0.4 of the copy rate with their weights cold (bench/ops/fp8_gemv_sweep.py, Session 35).
K in S parts multiplies what is in flight by S, at the cost of an fp32 partial per part and a sum by the row
block's last program (an acq_rel counter it resets, as greedy_tokens' kernel does). The cold sweep (one
sample a launch, `fp8_gemv_sweep.py --linear --quick --splits 1,2,3,4,6,8`): KDA o_proj 5.9 -> 5.1 µs at S = 4,
MLA q_proj 9.1 -> 7.0 at S = 3, KDA in_proj no gain (10.0 with 8-row programs of 2 warps against 11.0).

    install(split_rows=16384, max_split=4, narrow=0)

Dispatch's calls then take S = round(split_rows / N), at most max_split, for K >= 2,048 (split_k cuts it to
parts of whole steps and scale blocks; 512-code steps); narrow: 8-row programs of 2 warps for the unsplit
weights with K < 4,096. An explicit launch with an "S" key (the sweep's) takes the split kernel as asked.
`bench/e2e/fp8_decode.py --forms "none;gemv_split:split_rows=16384;none"` measures the model with it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate import alloc, platform
from kernelgate.ops.common.pdl import pdl_args
from kernelgate.ops.quant import fp8_gemv_triton as gt
from kernelgate.ops.quant import fp8_linear_triton as flt
from kernelgate.ops.quant.fp8_weights import block_dims

_ORIGINAL = flt.fp8_gemv
_COUNTERS: dict = {}            # device -> int32 counters, one per row block, zero between calls


@triton.jit
def _gemv_split_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, N, KW, sxk, swn, ssn, ssk, bn,
                       bkw: tl.constexpr, R: tl.constexpr, W: tl.constexpr, ONE_KBLOCK: tl.constexpr,
                       EVEN: tl.constexpr, PTX: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr,
                       SPLIT: tl.constexpr):
    """fp8_gemv_triton._gemv_kernel over K in SPLIT parts, program (row block, part): each part's rows_dot (its
    words, scale columns and activations as if they were the whole row) goes to an fp32 partial [SPLIT, N]; the
    row block's last program sums the partials in part order and writes y."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    n0 = pid * R
    KS = KW // SPLIT                                            # words a part (split_k: whole steps)
    k_lo = sp * KS
    tiles, rows = gt.row_tile(w_ptr + k_lo, n0, N, swn, R, W)
    if WORDS:
        x_part = x_ptr + k_lo
    else:
        x_part = x_ptr + (4 * k_lo) * sxk
    s_row = s_ptr + (n0 // bn).to(tl.int64) * ssn
    if not ONE_KBLOCK:
        s_row += (k_lo // bkw) * ssk                            # parts start on a scale block (split_k)
    y = gt.rows_dot(tiles, s_row, x_part, KS, sxk, ssk, bkw, R, W, ONE_KBLOCK, EVEN, PTX, WORDS, PDL)
    if ONE_KBLOCK:
        y = y * gt.row_scales(s_ptr, rows, N, bn, ssn)
    ok = rows < N
    tl.store(part_ptr + sp * N + rows, y, mask=ok)
    tl.debug_barrier()                                          # every thread's stores before the count
    if tl.atomic_add(count_ptr + pid, 1) == SPLIT - 1:          # acq_rel: the row block's last program
        acc = tl.load(part_ptr + rows, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * N + rows, mask=ok, other=0.0)
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(count_ptr + pid, 0)


def split_k(KW: int, S: int, C: int, bkw: int, one_kblock: bool) -> tuple[int, int, bool]:
    """(parts, W, EVEN): the most parts <= S of KW words, each a whole number of W-word steps (gt.step of the
    part) and, with K blocks, of scale blocks (bkw words); 1 part where none fits."""
    for s in range(max(S, 1), 1, -1):
        if KW % s == 0 and (one_kblock or (KW // s) % bkw == 0):
            W, even = gt.step(4 * (KW // s), C)
            if even:
                return s, W, even
    return (1, *gt.step(4 * KW, C))


def fp8_gemv_split(x, weight, weight_scale, block_size, y, cfg: dict):
    """gt.fp8_gemv with cfg["S"] K parts (cut by split_k; one part: gt.fp8_gemv itself)."""
    K, N = x.shape[1], weight.shape[0]
    plat = platform.current()
    asked, cfg = cfg, {**gt.launch(plat), **cfg}
    bn, bk = block_dims(block_size, K)
    one_kblock = triton.cdiv(K, bk) == 1
    S, W, even = split_k(K // 4, cfg["S"], cfg["C"], max(bk // 4, 1), one_kblock)
    if S == 1:
        return _ORIGINAL(x, weight, weight_scale, block_size, y, {k: v for k, v in asked.items() if k != "S"})
    R = gt.rows_per_program(cfg["R"], one_kblock, bn)
    nblocks = triton.cdiv(N, R)
    counters = _COUNTERS.get(y.device)
    if counters is None or counters.numel() < nblocks:
        counters = _COUNTERS[y.device] = torch.zeros(max(nblocks, 4096), dtype=torch.int32, device=y.device)
    part = alloc.empty((S, N), torch.float32, y.device)
    w = weight.view(torch.uint8).view(torch.int32)
    xw, words = gt.x_words(x[0])
    _gemv_split_kernel[(nblocks, S)](
        xw, w, weight_scale, y, part, counters, N, K // 4, x.stride(1), w.stride(0), *weight_scale.stride(), bn,
        max(bk // 4, 1), R=R, W=W, ONE_KBLOCK=one_kblock, EVEN=even, PTX=gt.ptx_decode(plat), WORDS=words,
        SPLIT=S, num_warps=cfg["num_warps"], **pdl_args())
    return y


def launch_for(N: int, K: int, split_rows: int, max_split: int, narrow: int) -> dict:
    """The GEMV launch this probe gives dispatch's call on a weight of N x K (empty: dispatch's own)."""
    S = max(1, min(max_split, round(split_rows / N))) if split_rows and K >= 2048 else 1
    if S > 1:
        return dict(S=S, C=512)
    if narrow and K < 4096:
        return dict(R=8, C=512, num_warps=2)
    return {}


def install(split_rows: int = 16384, max_split: int = 4, narrow: int = 0) -> str:
    def fp8_gemv(x, weight, weight_scale, block_size, y, cfg=None):
        if not cfg:                                   # dispatch's call (a sweep's explicit launch stays)
            cfg = launch_for(weight.shape[0], x.shape[1], split_rows, max_split, narrow)
        if cfg.get("S", 1) > 1:
            return fp8_gemv_split(x, weight, weight_scale, block_size, y, cfg)
        return _ORIGINAL(x, weight, weight_scale, block_size, y, {k: v for k, v in cfg.items() if k != "S"})

    flt.fp8_gemv = fp8_gemv
    return (f"gemv_split: K in round({split_rows} / N) parts (at most {max_split}) from K = 2,048"
            f"{'; 8-row, 2-warp programs for the other weights below K = 4,096' if narrow else ''}")


def uninstall() -> None:
    flt.fp8_gemv = _ORIGINAL
