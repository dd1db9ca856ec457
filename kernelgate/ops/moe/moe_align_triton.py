"""Token permutation for grouped expert GEMMs: (token, slot) pairs sorted by expert, each
expert's run padded to a multiple of BLOCK_M, so every GEMM row-block belongs to one expert.

    topk_ids [T, k]  ->  sorted_pairs [num_blocks * BLOCK_M]  pair index p = t*k + j, or P (= T*k) for padding
                         block_expert [num_blocks]            expert of each row-block, -1 past the end

`num_blocks` is an upper bound known on the host (no device sync); blocks past the real
end have expert -1 (the GEMM programs for them exit at once) and hold only padding. Ids
outside [0, E) are left out. Within an expert's run pairs keep their order (ascending p),
so the output is a pure function of the input: no atomics, same result every call.

Three launches, grid sizes from P, E and BLOCK_M only (CUDA-graph safe):
  1. _count_kernel    grid (C,)       per chunk of CHUNK pairs: hist[c, e] and each pair's
                                      rank among the chunk's pairs of its expert (by compares)
  2. _scan_kernel     grid (1,)       hist -> exclusive prefix over chunks (in place), expert
                                      counts -> padded run starts        (skipped when C == 1)
  3. _scatter_kernel  grid (C + NBC,) pairs: dest = start[e] + offset[c, e] + rank;
                                      row-blocks: block_expert and padding slots = P
With one chunk (decode) launch 1 also does launch 2's work, so small P costs two launches.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc
from ...errors import KernelgateError

_TILE = 16384        # int32 elements per [rows, experts] register tile


@triton.jit
def _store_runs(hist_ptr, run_ptr, E, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """counts [E] at hist_ptr -> run_ptr[0:E_PAD] = padded run starts, run_ptr[E_PAD:] = counts."""
    e = tl.arange(0, E_PAD)
    counts = tl.load(hist_ptr + e, mask=e < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(run_ptr + e, starts)
    tl.store(run_ptr + E_PAD + e, counts)


@triton.jit
def _count_kernel(ids_ptr, hist_ptr, rank_ptr, run_ptr, P, E,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  E_TILE: tl.constexpr, Q_TILE: tl.constexpr, SINGLE: tl.constexpr):
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    raw = tl.load(ids_ptr + p, mask=p < P, other=-1)
    ids = tl.where((raw >= 0) & (raw < E), raw, -1).to(tl.int32)   # range test before the cast: int64 2**32+3 is not 3
    # rank: how many of the chunk's earlier pairs have the same expert -- compares and a sum over
    # [CHUNK, Q_TILE] tiles (no scan: a cumsum over a 2-D tile is what made this kernel slow)
    rank = tl.zeros([CHUNK], dtype=tl.int32)
    for q0 in range(0, CHUNK, Q_TILE):
        q = c * CHUNK + q0 + tl.arange(0, Q_TILE)
        rq = tl.load(ids_ptr + q, mask=q < P, other=-1)
        iq = tl.where((rq >= 0) & (rq < E), rq, -1).to(tl.int32)
        same = (ids[:, None] == iq[None, :]) & (q[None, :] < p[:, None])   # (invalid pairs' ranks are never read)
        rank += tl.sum(same.to(tl.int32), axis=1)
    tl.store(rank_ptr + p, rank, mask=p < P)
    for e0 in range(0, E_PAD, E_TILE):   # experts in tiles keep [CHUNK, E_TILE] small for any E
        e = e0 + tl.arange(0, E_TILE)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)                     # [CHUNK, E_TILE]
        tl.store(hist_ptr + c * E + e, tl.sum(hit, axis=0), mask=e < E)
    if SINGLE:   # one chunk: its histogram is the expert counts; read back this program's stores
        tl.debug_barrier()
        _store_runs(hist_ptr, run_ptr, E, BLOCK_M, E_PAD)


@triton.jit
def _scan_kernel(hist_ptr, run_ptr, C, E,
                 BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, C_BLK: tl.constexpr):
    """hist [C, E] -> exclusive prefix over chunks in place; counts (the totals) -> runs."""
    e = tl.arange(0, E_PAD)
    carry = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, C, C_BLK):
        c = c0 + tl.arange(0, C_BLK)
        ptrs = hist_ptr + c[:, None] * E + e[None, :]
        ok = (c[:, None] < C) & (e[None, :] < E)
        h = tl.load(ptrs, mask=ok, other=0)                               # [C_BLK, E_PAD]
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=ok)
        carry += tl.sum(h, axis=0)
    padded = (carry + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(run_ptr + e, tl.cumsum(padded, axis=0) - padded)
    tl.store(run_ptr + E_PAD + e, carry)


@triton.jit
def _scatter_kernel(ids_ptr, hist_ptr, rank_ptr, run_ptr, sorted_ptr, block_expert_ptr,
                    P, E, C, num_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                    CHUNK: tl.constexpr, B_CHUNK: tl.constexpr, HAS_OFFSETS: tl.constexpr):
    pid = tl.program_id(0)
    if pid < C:   # pairs of chunk pid -> their slot in the expert's run
        p = pid * CHUNK + tl.arange(0, CHUNK)
        raw = tl.load(ids_ptr + p, mask=p < P, other=-1)
        valid = (p < P) & (raw >= 0) & (raw < E)
        e = tl.where(valid, raw, 0).to(tl.int32)
        dest = tl.load(run_ptr + e, mask=valid, other=0) + tl.load(rank_ptr + p, mask=valid, other=0)
        if HAS_OFFSETS:
            dest += tl.load(hist_ptr + pid * E + e, mask=valid, other=0)
        tl.store(sorted_ptr + dest, p, mask=valid)
    else:         # row-blocks: owning expert (-1 past the end); slots past the expert's pairs -> P
        b = (pid - C) * B_CHUNK + tl.arange(0, B_CHUNK)
        e_offs = tl.arange(0, E_PAD)
        starts = tl.load(run_ptr + e_offs)
        counts = tl.load(run_ptr + E_PAD + e_offs)
        ends = tl.where(e_offs < E, starts + (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 2147483647)
        first = b * BLOCK_M
        e_b = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)    # [B_CHUNK]
        live = e_b < E
        tl.store(block_expert_ptr + b, tl.where(live, e_b, -1), mask=b < num_blocks)
        start_b = tl.load(run_ptr + e_b, mask=live, other=0)      # dead blocks: 0 pairs from 0,
        count_b = tl.load(run_ptr + E_PAD + e_b, mask=live, other=0)  # so all their slots pad
        pos = first[:, None] + tl.arange(0, BLOCK_M)[None, :]                  # [B_CHUNK, BLOCK_M]
        pad = (pos - start_b[:, None]) >= count_b[:, None]
        tl.store(sorted_ptr + pos, P, mask=pad & (b < num_blocks)[:, None])


def max_blocks(P: int, E: int, block_m: int) -> int:
    """Upper bound on row-blocks: each of at most min(P, E) hit experts adds < BLOCK_M padding."""
    return triton.cdiv(P + min(P, E) * (block_m - 1), block_m)


def default_chunk(P: int) -> int:
    """Pairs per program: 32 up to 2,048 pairs (decode batches: one program per 32 pairs spreads the
    count over the SMs), 128 above (prefill chunks: fewer, larger programs and a smaller [C, E] scan).
    H200, E = 257 (bench/ops/moe_align.py): P = 576 takes 7.4 µs at 32 against 19.7 at 256 (29.1 before
    the compare-based rank); P = 73,728 (an 8k chunk, top-9) 48.4 µs at 128 against 60.9 at 256."""
    return max(16, min(32 if P <= 2048 else 128, triton.next_power_of_2(P)))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: int | None = None):
    """(sorted_pairs int32 [num_blocks*block_m], block_expert int32 [num_blocks]); see module doc.
    `chunk` (a power of two >= 16) overrides the pairs per program, for benchmarks and tests."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    P, E = ids.numel(), num_experts
    nb = max_blocks(P, E, block_m)
    sorted_pairs = alloc.empty((nb * block_m,), torch.int32, ids.device)
    block_expert = alloc.empty((nb,), torch.int32, ids.device)
    if nb == 0:
        return sorted_pairs, block_expert
    chunk = chunk or default_chunk(P)
    if chunk < 16 or chunk & (chunk - 1):
        raise KernelgateError(f"moe_align: chunk {chunk} must be a power of two >= 16")
    e_pad = max(16, triton.next_power_of_2(E))
    C = triton.cdiv(P, chunk)
    # scratch, every element read is written first: hist/offsets [C, E] | rank [P] | runs [2, E_PAD]
    scratch = torch.empty(C * E + P + 2 * e_pad, dtype=torch.int32, device=ids.device)
    hist, rank, runs = scratch[:C * E], scratch[C * E:C * E + P], scratch[C * E + P:]
    e_tile = min(e_pad, max(16, _TILE // chunk))
    q_tile = min(chunk, max(16, _TILE // chunk))
    _count_kernel[(C,)](ids, hist, rank, runs, P, E, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk,
                        E_TILE=e_tile, Q_TILE=q_tile, SINGLE=C == 1, num_warps=4 if chunk * e_tile <= 4096 else 8)
    if C > 1:
        c_blk = max(2, min(triton.next_power_of_2(C), _TILE // e_pad))
        _scan_kernel[(1,)](hist, runs, C, E, BLOCK_M=block_m, E_PAD=e_pad, C_BLK=c_blk, num_warps=8)
    b_chunk = max(16, min(256, 8192 // max(e_pad, block_m)))
    grid = (C + triton.cdiv(nb, b_chunk),)
    _scatter_kernel[grid](ids, hist, rank, runs, sorted_pairs, block_expert, P, E, C, nb,
                          BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, B_CHUNK=b_chunk,
                          HAS_OFFSETS=C > 1, num_warps=4)
    return sorted_pairs, block_expert
