"""The paged K/V cache of grouped-query attention, shared by `paged_attention_decode` and
`paged_attention_prefill`.

Layout, per layer: k_cache and v_cache [num_blocks, block_size, Hkv, D] in the model dtype
(bf16 / fp16 / fp32), one row of D values per (position, KV head). Position p of sequence i lives
at

    k_cache[block_table[i, p // block_size], p % block_size]     (and v_cache alike)

The caller writes a step's new keys and values into both caches before attention. The block
table and the value checks are the MLA latent cache's (`..mla.paged`): the same table, the same
rules (a length fits the table, a used block id lies in [0, num_blocks)).
Query head h attends with KV head h // (Hq // Hkv) (transformers' `repeat_kv` order).
"""
from __future__ import annotations

import torch

from ... import checks
from ..mla.paged import check_table, check_values  # noqa: F401 - re-exported: one table format


def check_kv_cache(op: str, k_cache, v_cache, device) -> None:
    checks.tensor(op, "k_cache", k_cache, ndim=4, dtype=checks.FLOATS, device=device)
    checks.tensor(op, "v_cache", v_cache, ndim=4, dtype=checks.FLOATS, device=device)
    checks.require(v_cache.shape == k_cache.shape, op,
                   f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    checks.require(v_cache.dtype == k_cache.dtype, op,
                   f"v_cache dtype {str(v_cache.dtype)[6:]} != k_cache dtype {str(k_cache.dtype)[6:]}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.require(c.stride(-1) == 1, op, f"{name} last dim must be contiguous (strides {c.stride()})")


def check_heads(op: str, q, k_cache) -> None:
    """q [*, Hq, D] against the cache's [*, *, Hkv, D]: the same D, Hq a multiple of Hkv."""
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[2]
    checks.require(D == k_cache.shape[3], op, f"q head dim {D} != k_cache head dim {k_cache.shape[3]}")
    checks.require(Hkv >= 1 and Hq % Hkv == 0, op,
                   f"q heads {Hq} are not a multiple of the cache's KV heads {Hkv}")


def gather(cache, block_table_row, end: int, start: int = 0) -> torch.Tensor:
    """Rows of positions start..end-1 of one sequence -> [end - start, Hkv, D] (cache dtype)."""
    bs = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    blk = block_table_row[pos // bs].long()
    return cache[blk, pos % bs]


def random_paged(lens, bs, Hkv, D, dtype, gen, spare: int = 3):
    """Random keys and values in blocks handed out in shuffled order (non-contiguous tables).
    -> (k_cache, v_cache [nb, bs, Hkv, D], block_table int32 [N, max_blocks]); unused table
    entries point at real blocks too (a kernel must not read them: their rows are not zeros)."""
    width = max(1, max(-(-L // bs) for L in lens))
    nb = len(lens) * width + spare
    k = torch.randn(nb, bs, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(nb, bs, Hkv, D, generator=gen).to(dtype)
    table = torch.randperm(nb, generator=gen)[:len(lens) * width].view(len(lens), width).to(torch.int32)
    return k, v, table
