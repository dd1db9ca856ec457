"""The paged MLA latent cache, shared by `mla_decode` and `mla_prefill`.

Layout: cache [num_blocks, block_size, R + Dr] (bf16 / fp16 / fp32), one latent row per
token: c = the normalised kv_a output [R] (the values of absorbed attention, and what
W_uk / W_uv expand), then the shared key part k_r [Dr]. Position p of sequence i lives at

    cache[block_table[i, p // block_size], p % block_size]

A slot-per-sequence cache [S, max_len, C] is the special case block_size = max_len (or any
divisor of it): view it as [S * max_len / bs, bs, C] with block_table[i, j] = slot_i * (max_len / bs) + j.
"""
from __future__ import annotations

import torch

from ... import checks


def check_cache(op: str, cache, device) -> None:
    checks.tensor(op, "cache", cache, ndim=3, dtype=checks.FLOATS, device=device)
    checks.require(cache.stride(-1) == 1, op, f"cache last dim must be contiguous (strides {cache.stride()})")


def check_table(op: str, block_table, seq_lens, device, rows: int | None = None) -> None:
    checks.tensor(op, "block_table", block_table, ndim=2, dtype=torch.int32, device=device)
    checks.tensor(op, "seq_lens", seq_lens, ndim=1, dtype=torch.int32, device=device)
    checks.require(seq_lens.shape[0] == block_table.shape[0], op,
                   f"seq_lens length {seq_lens.shape[0]} != block_table rows {block_table.shape[0]}")
    if rows is not None:
        checks.require(block_table.shape[0] == rows, op, f"block_table rows {block_table.shape[0]} != {rows} sequences")


def check_values(op: str, cache, block_table, seq_lens, min_len=1) -> None:
    """Value checks (reads the tensors: free on CPU, one sync on a device): every length is
    0 or >= min_len (an int, or a list per sequence: its new tokens, already in the cache),
    fits the table, and every block id its positions use is in [0, num_blocks)."""
    nb, bs = cache.shape[0], cache.shape[1]
    lens = seq_lens.tolist()
    width = block_table.shape[1]
    for i, L in enumerate(lens):
        need = min_len if isinstance(min_len, int) else min_len[i]
        checks.require(L >= 0, op, f"seq_lens[{i}] = {L} is negative")
        checks.require(L == 0 or L >= need, op,
                       f"seq_lens[{i}] = {L} < {need} new tokens (they are already in the cache)")
        used = -(-L // bs)
        checks.require(used <= width, op, f"seq_lens[{i}] = {L} needs {used} blocks of {bs} > block_table width {width}")
        if used:
            ids = block_table[i, :used]
            bad = ((ids < 0) | (ids >= nb)).nonzero()
            if bad.numel():
                j = int(bad[0, 0])
                raise checks.KernelgateError(f"{op}: block_table[{i}, {j}] = {int(ids[j])} is outside "
                                             f"[0, {nb}) (num_blocks)")


def gather(cache, block_table_row, end: int, start: int = 0) -> torch.Tensor:
    """Latent rows of positions start..end-1 of one sequence -> [end - start, C] (cache dtype)."""
    bs = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    blk = block_table_row[pos // bs].long()
    return cache[blk, pos % bs]


def random_paged(lens, bs, C, dtype, gen, spare: int = 3, scale: float = 1.0):
    """Random latents in blocks handed out in shuffled order (non-contiguous tables).
    -> (cache [nb, bs, C], block_table int32 [N, max_blocks]); unused table entries point at
    real blocks too (a kernel must not read them: their rows are garbage, not zeros)."""
    width = max(1, max(-(-L // bs) for L in lens))
    nb = len(lens) * width + spare
    cache = (scale * torch.randn(nb, bs, C, generator=gen)).to(dtype)
    table = torch.randperm(nb, generator=gen)[:len(lens) * width].view(len(lens), width).to(torch.int32)
    return cache, table
