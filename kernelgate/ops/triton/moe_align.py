"""Token permutation for grouped expert GEMMs: (token, slot) pairs sorted by expert, each
expert's run padded to a multiple of BLOCK_M, so every GEMM row-block belongs to one expert.

    topk_ids [T, k]  ->  sorted_pairs [num_blocks * BLOCK_M]  pair index p = t*k + j, or P (= T*k) for padding
                         block_expert [num_blocks]            expert of each row-block, -1 past the end

`num_blocks` is an upper bound known on the host (no device sync); blocks past the real
end have expert -1 and the GEMM programs for them exit at once. Ids outside [0, E) are left
out. One program does everything: E is at most a few hundred, so the per-chunk
[CHUNK, E] one-hot matrices stay small and the whole permutation is one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc


@triton.jit
def _onehot(ids_ptr, p0, P, E, e_offs, CHUNK: tl.constexpr):
    """[CHUNK, E_PAD] int32: 1 where pair p0+i routes to expert column e (valid ids only)."""
    p = p0 + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
    hit = (ids[:, None] == e_offs[None, :]) & (e_offs[None, :] < E)
    return hit.to(tl.int32), p


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, P, E, num_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  B_CHUNK: tl.constexpr):
    e_offs = tl.arange(0, E_PAD)
    # pass 1: pairs per expert -> padded run [starts, ends) of each expert
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, P, CHUNK):
        hit, p = _onehot(ids_ptr, p0, P, E, e_offs, CHUNK)
        counts += tl.sum(hit, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # pass 2: each pair goes to starts[e] + (pairs of e before it)
    seen = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, P, CHUNK):
        hit, p = _onehot(ids_ptr, p0, P, E, e_offs, CHUNK)
        rank = tl.cumsum(hit, axis=0) - hit + seen[None, :] + starts[None, :]   # [CHUNK, E_PAD]
        dest = tl.sum(hit * rank, axis=1)
        tl.store(sorted_ptr + dest, p, mask=tl.sum(hit, axis=1) > 0)
        seen += tl.sum(hit, axis=0)
    # row-blocks: the expert whose padded run holds the block, and padding slots set to P
    for b0 in range(0, num_blocks, B_CHUNK):
        b = b0 + tl.arange(0, B_CHUNK)
        first = b * BLOCK_M
        e_b = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)    # [B_CHUNK]
        live = e_b < E
        tl.store(block_expert_ptr + b, tl.where(live, e_b, -1), mask=b < num_blocks)
        sel = (e_offs[None, :] == e_b[:, None]).to(tl.int32)                    # [B_CHUNK, E_PAD]
        start_b = tl.sum(sel * starts[None, :], axis=1)
        count_b = tl.sum(sel * counts[None, :], axis=1)
        pos = first[:, None] + tl.arange(0, BLOCK_M)[None, :]                  # [B_CHUNK, BLOCK_M]
        pad = (pos - start_b[:, None]) >= count_b[:, None]
        tl.store(sorted_ptr + pos, P, mask=pad & (live & (b < num_blocks))[:, None])


def max_blocks(P: int, E: int, block_m: int) -> int:
    """Upper bound on row-blocks: each of at most min(P, E) hit experts adds < BLOCK_M padding."""
    return triton.cdiv(P + min(P, E) * (block_m - 1), block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted_pairs int32 [num_blocks*block_m], block_expert int32 [num_blocks]); see module doc."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    P = ids.numel()
    nb = max_blocks(P, num_experts, block_m)
    sorted_pairs = alloc.empty((nb * block_m,), torch.int32, ids.device)
    block_expert = alloc.empty((nb,), torch.int32, ids.device)
    if nb == 0:
        return sorted_pairs, block_expert
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(256, 8192 // e_pad))      # keep [CHUNK, E_PAD] at <= 8K elements
    b_chunk = max(16, min(256, 8192 // max(e_pad, block_m)))
    _align_kernel[(1,)](ids, sorted_pairs, block_expert, P, num_experts, nb, BLOCK_M=block_m,
                        E_PAD=e_pad, CHUNK=chunk, B_CHUNK=b_chunk, num_warps=8)
    return sorted_pairs, block_expert
