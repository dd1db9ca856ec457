"""MLA chunked prefill over the paged latent cache, in the expanded (non-absorbed) form.

    mla_prefill(q, cache, block_table, cu_seqlens, seq_lens, w_kv, scale, value_dim)
        q           [T, H, Dn + Dr]  packed query tokens of N sequences (nope part, then shared-key part)
        cache       [num_blocks, block_size, R + Dr]  latents c [R] | shared key k_r [Dr] (`paged.py`)
        block_table [N, max_blocks] int32
        cu_seqlens  [N + 1] int32    sequence i's tokens are q[cu_seqlens[i] : cu_seqlens[i + 1]]
        seq_lens    [N] int32        total length after this chunk (the chunk's latents already cached)
        w_kv        [H, Dn + Dv, R]  kv_b_proj weight per head: W_uk = w_kv[:, :Dn], W_uv = w_kv[:, Dn:]
        scale       float
        value_dim   int              Dv
        -> o [T, H, Dv] in q's dtype

Keys and values of position p, head h: k = [W_uk[h] c_p, k_r_p], v = W_uv[h] c_p. Token j of
sequence i (n_i tokens) sits at position seq_lens[i] - n_i + j and sees positions 0..that one.
The expanded form costs 2 T L H (Dn + Dr + Dv) attention flops against the absorbed form's
2 T L H (2R + Dr): 3.4x fewer for Kimi (Dn 128, Dr 64, Dv 128, R 512), plus expanding the
context once per chunk (2 L R H (Dn + Dv)), which pays off once a chunk has more than a few
dozen tokens.

cu_seqlens and seq_lens may be host (CPU) tensors when the caller has them there (prefill runs
eagerly; host copies spare a device sync per layer); block_table lives with the cache. Values
are checked (a length shorter than its chunk, a table too narrow, a block id outside the cache
-> KernelgateError) by the native reference, and by validate when they are on the host.
"""
from __future__ import annotations

import torch

from ... import checks
from ...registry import ALL_PLATFORMS, Case, declare
from . import paged

OP = "mla_prefill"


def _dims(q, cache, w_kv, value_dim):
    """-> (R, Dr, Dn, Dv)."""
    R = w_kv.shape[2]
    Dr = cache.shape[2] - R
    return R, Dr, q.shape[2] - Dr, value_dim


def mla_prefill_native(q, cache, block_table, cu_seqlens, seq_lens, w_kv, scale, value_dim):
    """MLA chunked prefill, expanded per head in fp32: per sequence, gather, expand, softmax."""
    bounds, lens = cu_seqlens.tolist(), seq_lens.tolist()
    check_lengths(bounds, lens)
    paged.check_values(OP, cache, block_table, seq_lens)
    R, _, Dn, Dv = _dims(q, cache, w_kv, value_dim)
    H = q.shape[1]
    w = w_kv.float()
    o = torch.zeros(q.shape[0], H, Dv, dtype=torch.float32, device=q.device)
    for i, L in enumerate(lens):
        t0, t1 = bounds[i], bounds[i + 1]
        n = t1 - t0
        if n == 0:
            continue
        lat = paged.gather(cache, block_table[i], L).float()                   # [L, R + Dr]
        c, k_r = lat[:, :R], lat[:, R:]
        k_n = torch.einsum("lr,hdr->hld", c, w[:, :Dn])                        # [H, L, Dn]
        v = torch.einsum("lr,hvr->hlv", c, w[:, Dn:])                          # [H, L, Dv]
        qi = q[t0:t1].float().transpose(0, 1)                                  # [H, n, Dn + Dr]
        s = (qi[..., :Dn] @ k_n.transpose(1, 2) + qi[..., Dn:] @ k_r.t()) * scale  # [H, n, L]
        q_pos = L - n + torch.arange(n, device=q.device)
        visible = torch.arange(L, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        o[t0:t1] = (p @ v).transpose(0, 1)
    return o.to(q.dtype)


def check_lengths(bounds, lens) -> None:
    checks.require(bounds[0] == 0, OP, f"cu_seqlens[0] = {bounds[0]} != 0")
    for i, L in enumerate(lens):
        n = bounds[i + 1] - bounds[i]
        checks.require(n >= 0, OP, f"cu_seqlens decreases at {i + 1} ({bounds[i]} -> {bounds[i + 1]})")
        checks.require(L >= n, OP, f"seq_lens[{i}] = {L} < its {n} chunk tokens (they are already in the cache)")


def validate(q, cache, block_table, cu_seqlens, seq_lens, w_kv, scale, value_dim):
    checks.tensor(OP, "q", q, ndim=3, dtype=checks.FLOATS)
    paged.check_cache(OP, cache, q.device)
    checks.tensor(OP, "w_kv", w_kv, ndim=3, dtype=checks.FLOATS, device=q.device)
    H = q.shape[1]
    checks.require(w_kv.shape[0] == H, OP, f"w_kv heads {w_kv.shape[0]} != q heads {H}")
    R, Dr, Dn, Dv = _dims(q, cache, w_kv, value_dim)
    checks.require(isinstance(value_dim, int) and value_dim > 0, OP, f"value_dim must be a positive int, got {value_dim!r}")
    checks.require(Dr >= 0, OP, f"cache width {cache.shape[2]} < w_kv latent width R {R}")
    checks.require(Dn > 0 and w_kv.shape[1] == Dn + Dv, OP,
                   f"w_kv shape {tuple(w_kv.shape)} != (H, Dn + Dv, R) = ({H}, {Dn} + {Dv}, {R}) "
                   f"(Dn = q width {q.shape[2]} - Dr {Dr})")
    meta = (q.device, torch.device("cpu"))
    checks.tensor(OP, "block_table", block_table, ndim=2, dtype=torch.int32, device=q.device)
    for name, t in (("cu_seqlens", cu_seqlens), ("seq_lens", seq_lens)):
        checks.tensor(OP, name, t, ndim=1, dtype=torch.int32)
        checks.require(t.device in meta, OP, f"{name} is on {t.device}, expected {q.device} or cpu")
    N = block_table.shape[0]
    checks.require(seq_lens.shape[0] == N and cu_seqlens.shape[0] == N + 1, OP,
                   f"seq_lens length {seq_lens.shape[0]} / cu_seqlens length {cu_seqlens.shape[0]} != "
                   f"{N} / {N + 1} (block_table rows)")
    checks.require(isinstance(scale, (int, float)) and scale > 0, OP, f"scale must be a positive number, got {scale!r}")
    if cu_seqlens.device.type == "cpu":
        bounds = cu_seqlens.tolist()
        checks.require(bounds[-1] == q.shape[0], OP, f"cu_seqlens[-1] = {bounds[-1]} != q tokens {q.shape[0]}")
        if seq_lens.device.type == "cpu":
            check_lengths(bounds, seq_lens.tolist())
    if q.device.type == "cpu":
        paged.check_values(OP, cache, block_table, seq_lens)


def make_inputs(chunks, lens, H, R, Dr, Dn, Dv, bs, dtype, gen, device="cpu"):
    """(q, cache, block_table, cu_seqlens, seq_lens, w_kv) for chunks of n_i new tokens ending
    sequences of lengths lens; w_kv scaled so that expanded keys are O(1)."""
    C = R + Dr
    cache, table = paged.random_paged(lens, bs, C, dtype, gen)
    q = (torch.randn(sum(chunks), H, Dn + Dr, generator=gen) / (Dn + Dr) ** 0.25).to(dtype)
    w_kv = (torch.randn(H, Dn + Dv, R, generator=gen) / R ** 0.5).to(dtype)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, cache, table, cu, seq, w_kv))


def _case(chunks, lens, H, R, Dr, Dn, Dv, bs, dtypes=(torch.float32, torch.bfloat16)):
    def make(device, dtype, gen):
        args = make_inputs(chunks, lens, H, R, Dr, Dn, Dv, bs, dtype, gen, device)
        return args + ((Dn + Dr) ** -0.5, Dv), {}
    return Case(f"N{len(lens)}-n{'_'.join(map(str, chunks))}-L{'_'.join(map(str, lens))}-H{H}-R{R}-Dr{Dr}"
                f"-Dn{Dn}-Dv{Dv}-BS{bs}", make, dtypes=dtypes)


def cases():
    return [
        _case([9], [9], 2, 32, 16, 24, 16, 16),                     # chunk at the start (no prefix)
        _case([7], [40], 3, 32, 16, 24, 16, 16),                    # chunk after a prefix
        _case([1, 16, 5], [1, 33, 16], 2, 32, 8, 16, 24, 16),       # first token, block boundaries
        _case([4, 0, 17], [65, 3, 64], 4, 48, 16, 32, 32, 8),       # an empty chunk, odd block count
        _case([20], [20], 2, 16, 0, 16, 16, 16),                    # no shared-key part
        _case([1, 12, 1, 5, 0, 1], [30, 12, 17, 40, 3, 2], 4, 32, 16, 24, 16, 16),   # a server's step: decodes,
        # fresh and continued prompts, an empty chunk (the sdpa implementation's varlen runs)
    ]


mla_prefill = declare(OP, mla_prefill_native, validate=validate, cases=cases)
mla_prefill.implementation(
    "sdpa", ".mla_prefill_sdpa:mla_prefill_sdpa", provider="torch", platforms=ALL_PLATFORMS, priority=10,
    doc="expanded keys/values per context piece, torch SDPA (fused kernels), log-sum-exp merge of pieces")
