"""Grouped-query attention prefill over the paged K/V cache (layout: `paged.py`): chunks of new
tokens attending causally to themselves and to their cached prefix.

    paged_attention_prefill(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale,
                            cu_seqlens_cpu=None, seq_lens_cpu=None)
        q            [T, Hq, D]   packed new tokens of N sequences (Hq a multiple of Hkv)
        k_cache      [num_blocks, block_size, Hkv, D]
        v_cache      [num_blocks, block_size, Hkv, D]   same shape and dtype as k_cache
        block_table  [N, max_blocks] int32
        cu_seqlens   [N + 1] int32  sequence i's tokens are q[cu_seqlens[i] : cu_seqlens[i + 1]]
        seq_lens     [N] int32      total length after this chunk (the chunk's K/V already cached)
        scale        float
        cu_seqlens_cpu, seq_lens_cpu   optional host (CPU) copies of the two, hints for
                     implementations that plan on the host (no device -> host sync)
        -> o [T, Hq, D] in q's dtype

Token j of sequence i (n_i new tokens) sits at position seq_lens[i] - n_i + j and sees positions
0 .. that one; query head h uses KV head h // (Hq // Hkv). fp32 scores, softmax and accumulation.

cu_seqlens and seq_lens live on q's device or on the host. Values are checked (cu_seqlens not
from 0 to T or decreasing, a length shorter than its chunk, a table too narrow, a block id
outside the cache, a hint that differs from its tensor -> KernelgateError) by the native
reference and checked mode (KERNELGATE_CHECKS=1); by validate where they are on the host. The
Triton kernel reads no value on the host: a block id outside [0, num_blocks) is not read (its
positions leave the softmax), a length past the table is cut at the table's width, a token whose
position falls before 0 sees nothing (o = 0), rows outside [0, T) are neither read nor written.
"""
from __future__ import annotations

import torch

from ... import checks
from ...registry import ALL_PLATFORMS, GPU_TRITON, Case, declare
from . import paged

OP = "paged_attention_prefill"


def paged_attention_prefill_native(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale,
                                   cu_seqlens_cpu=None, seq_lens_cpu=None):
    """GQA chunked prefill over the paged K/V cache: per sequence, gather, causal fp32 softmax."""
    bounds, lens = cu_seqlens.tolist(), seq_lens.tolist()
    check_lengths(bounds, lens, q.shape[0])
    paged.check_values(OP, k_cache, block_table, seq_lens)
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    o = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    for i, L in enumerate(lens):
        t0, t1 = bounds[i], bounds[i + 1]
        n = t1 - t0
        if n == 0:
            continue
        k = paged.gather(k_cache, block_table[i], L).float()                    # [L, Hkv, D]
        v = paged.gather(v_cache, block_table[i], L).float()
        qi = q[t0:t1].float().view(n, Hkv, Hq // Hkv, D)                        # [n, Hkv, G, D]
        s = torch.einsum("nkgd,lkd->kgnl", qi, k) * scale                       # [Hkv, G, n, L]
        q_pos = L - n + torch.arange(n, device=q.device)
        hide = torch.arange(L, device=q.device)[None, :] > q_pos[:, None]       # [n, L]
        p = torch.softmax(s.masked_fill(hide, float("-inf")), dim=-1)
        o[t0:t1] = torch.einsum("kgnl,lkd->nkgd", p, v).reshape(n, Hq, D)
    return o.to(q.dtype)


def check_lengths(bounds, lens, T: int) -> None:
    checks.require(bounds[0] == 0, OP, f"cu_seqlens[0] = {bounds[0]} != 0")
    checks.require(bounds[-1] == T, OP, f"cu_seqlens[-1] = {bounds[-1]} != q tokens {T}")
    for i, L in enumerate(lens):
        n = bounds[i + 1] - bounds[i]
        checks.require(n >= 0, OP, f"cu_seqlens decreases at {i + 1} ({bounds[i]} -> {bounds[i + 1]})")
        checks.require(L >= n, OP, f"seq_lens[{i}] = {L} < its {n} chunk tokens (they are already in the cache)")


def _host(t, hint):
    """The host copy of a lengths tensor, if there is one without a sync (else None)."""
    if hint is not None:
        return hint
    return t if t.device.type == "cpu" else None


def validate(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale, cu_seqlens_cpu=None, seq_lens_cpu=None):
    checks.tensor(OP, "q", q, ndim=3, dtype=checks.FLOATS)
    paged.check_kv_cache(OP, k_cache, v_cache, q.device)
    paged.check_heads(OP, q, k_cache)
    checks.tensor(OP, "block_table", block_table, ndim=2, dtype=torch.int32, device=q.device)
    where = (q.device, torch.device("cpu"))
    for name, t in (("cu_seqlens", cu_seqlens), ("seq_lens", seq_lens)):
        checks.tensor(OP, name, t, ndim=1, dtype=torch.int32)
        checks.require(t.device in where, OP, f"{name} is on {t.device}, expected {q.device} or cpu")
    N = block_table.shape[0]
    checks.require(seq_lens.shape[0] == N and cu_seqlens.shape[0] == N + 1, OP,
                   f"seq_lens length {seq_lens.shape[0]} / cu_seqlens length {cu_seqlens.shape[0]} != "
                   f"{N} / {N + 1} (block_table rows)")
    for name, hint, t in (("cu_seqlens_cpu", cu_seqlens_cpu, cu_seqlens), ("seq_lens_cpu", seq_lens_cpu, seq_lens)):
        checks.tensor(OP, name, hint, ndim=1, dtype=torch.int32, shape=tuple(t.shape), device=torch.device("cpu"),
                      optional=True)
    checks.require(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0, OP,
                   f"scale must be a positive number, got {scale!r}")
    cu_host, lens_host = _host(cu_seqlens, cu_seqlens_cpu), _host(seq_lens, seq_lens_cpu)
    if cu_host is not None:
        bounds = cu_host.tolist()
        checks.require(bounds[-1] == q.shape[0], OP, f"cu_seqlens[-1] = {bounds[-1]} != q tokens {q.shape[0]}")
        if lens_host is not None:
            check_lengths(bounds, lens_host.tolist(), q.shape[0])
    if q.device.type == "cpu":   # values are free to read on the host (never a device sync here)
        check_values(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale, cu_seqlens_cpu, seq_lens_cpu)


def check_values(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale, cu_seqlens_cpu=None,
                 seq_lens_cpu=None):
    bounds, lens = cu_seqlens.tolist(), seq_lens.tolist()
    for name, hint, values in (("cu_seqlens_cpu", cu_seqlens_cpu, bounds), ("seq_lens_cpu", seq_lens_cpu, lens)):
        if hint is not None and hint.tolist() != values:
            i = next(j for j, (a, b) in enumerate(zip(hint.tolist(), values)) if a != b)
            raise checks.KernelgateError(f"{OP}: {name}[{i}] = {hint.tolist()[i]} != {name[:-4]}[{i}] = {values[i]} "
                                         f"(a hint must equal its tensor)")
    check_lengths(bounds, lens, q.shape[0])
    paged.check_values(OP, k_cache, block_table, seq_lens)


def make_inputs(chunks, lens, Hq, Hkv, D, bs, dtype, gen, device="cpu"):
    """(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens) for chunks of n_i new tokens
    ending sequences of lengths lens."""
    k, v, table = paged.random_paged([max(L, 1) for L in lens], bs, Hkv, D, dtype, gen)
    q = (torch.randn(sum(chunks), Hq, D, generator=gen) * 2 / D ** 0.5).to(dtype)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k, v, table, cu, seq))


def _case(chunks, lens, Hq, Hkv, D, bs, hints=True, dtypes=(torch.float32, torch.bfloat16)):
    def make(device, dtype, gen):
        q, k, v, table, cu, seq = make_inputs(chunks, lens, Hq, Hkv, D, bs, dtype, gen, device)
        kw = dict(cu_seqlens_cpu=cu.cpu(), seq_lens_cpu=seq.cpu()) if hints else {}
        return (q, k, v, table, cu, seq, D ** -0.5), kw
    return Case(f"N{len(lens)}-n{'_'.join(map(str, chunks))}-L{'_'.join(map(str, lens))}-Hq{Hq}-Hkv{Hkv}-D{D}"
                f"-BS{bs}{'' if hints else '-nohints'}", make, dtypes=dtypes)


def cases():
    return [
        _case([1], [1], 4, 2, 60, 16),                                   # first token, odd head dim
        _case([63], [63], 6, 3, 64, 16),                                 # a prompt at once
        _case([7, 0, 65], [40, 3, 65], 6, 3, 60, 64, hints=False,         # after a prefix, an empty
              dtypes=(torch.float16,)),                                  # chunk; lengths on the device
        _case([1, 12, 5], [30, 12, 17], 16, 2, 256, 16),                 # Qwen3-Next heads, mixed step
    ]


def _bytes(args, kwargs):
    q, k_cache, _, _, _, seq = args[:6]
    row = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return 2 * int(seq.sum()) * row + 2 * q.numel() * q.element_size()


def bench_inputs(chunks, lens, device, dtype=torch.bfloat16, Hq=16, Hkv=2, D=256, bs=64):
    """Qwen3-Next-shaped heads; every sequence's blocks in one shuffled pool."""
    nblk = [-(-L // bs) for L in lens]
    width = max(nblk)
    k = torch.randn(sum(nblk), bs, Hkv, D, device=device, dtype=dtype)
    v = torch.randn(sum(nblk), bs, Hkv, D, device=device, dtype=dtype)
    ids = torch.randperm(sum(nblk), device=device, dtype=torch.int32)
    table = torch.zeros(len(lens), width, device=device, dtype=torch.int32)
    start = 0
    for i, n in enumerate(nblk):
        table[i, :n] = ids[start:start + n]
        start += n
    q = torch.randn(sum(chunks), Hq, D, device=device, dtype=dtype) / D ** 0.5
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    return (q, k, v, table, cu.to(device), seq.to(device), D ** -0.5), dict(cu_seqlens_cpu=cu, seq_lens_cpu=seq)


def bench_cases():
    def make(chunks, lens):
        return lambda device, dtype, gen: bench_inputs(chunks, lens, device, dtype)
    steps = [("prompt8192", [8192], [8192]), ("chunk2048-ctx32k", [2048], [32768]),
             ("chunk8192-ctx128k", [8192], [131072]),
             ("64decodes-ctx4k+2prompts512", [1] * 64 + [512] * 2, [4096] * 64 + [512] * 2),
             ("64prompts128", [128] * 64, [128] * 64), ("8prompts1000", [1000] * 8, [1000] * 8)]
    return [Case(f"{name}-Hq16-Hkv2-D256-BS64", make(c, L), dtypes=(torch.bfloat16,), bytes=_bytes)
            for name, c, L in steps]


paged_attention_prefill = declare(OP, paged_attention_prefill_native, validate=validate, check_values=check_values,
                                  cases=cases, bench_cases=bench_cases)
paged_attention_prefill.implementation(
    "sdpa", ".paged_attention_prefill_sdpa:paged_attention_prefill_sdpa", provider="torch",
    platforms=ALL_PLATFORMS, priority=10,
    doc="gathered context per sequence, torch SDPA with GQA (fused kernels), long contexts in pieces merged "
        "by log-sum-exp; host copies of the lengths as hints")


# Few sequences with long chunks go to sdpa (FlashAttention-2 / cuDNN): on the H200 a prompt of 8,192
# takes 1.0 ms there against 5.0 ms in the Triton kernel, a 2,048 chunk over 32k 3.3 against 10.9
# ms; a step of many sequences or short chunks goes to the one Triton launch (64 prompts of 128:
# 0.18 ms against 2.6 ms in sdpa's call per sequence, 14 ms eager; bench/RESULTS.md). Decided
# from shapes alone (the registry caches a choice per shape): N <= 8 sequences, T >= 2,048 N tokens.
LONG_CHUNK, FEW_SEQUENCES = 2048, 8


def _triton_supports(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale, cu_seqlens_cpu=None,
                     seq_lens_cpu=None):
    from .paged_attention_decode import _triton_supports as decode_supports
    N, T = cu_seqlens.shape[0] - 1, q.shape[0]
    if N <= FEW_SEQUENCES and T >= LONG_CHUNK * max(N, 1):
        return (f"{T} tokens in {N} sequences (<= {FEW_SEQUENCES}, >= {LONG_CHUNK} each on average): sdpa's "
                f"fused kernels are faster for few long chunks")
    return decode_supports(q, k_cache, v_cache, block_table, seq_lens, scale)


paged_attention_prefill.implementation(
    "triton", ".paged_attention_prefill_triton:paged_attention_prefill_triton", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), dtypes=(torch.float32, torch.float16, torch.bfloat16),
    supports=_triton_supports, priority=20,
    doc="one launch for every sequence: causal flash attention of (tokens x group heads) tiles over the paged "
        "cache in place; no host sync")
