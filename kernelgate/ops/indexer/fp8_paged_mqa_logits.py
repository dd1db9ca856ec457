"""fp8_paged_mqa_logits: DeepSeek indexer logits over the paged fp8 key cache (layout: k_cache.py).

    fp8_paged_mqa_logits(q_fp8[B,next_n,H,128], kv_cache, weights[B*next_n,H] fp32,
                         context_lens[B] int32, block_tables[B,max_blocks] int32, max_context_len)
        -> logits fp32 [B*next_n, max_context_len]
        logits[b*next_n + i, t] = s_k[t] * sum_h weights[b*next_n + i, h] * relu(q[b,i,h] . k_t)
        valid iff t < context_lens[b] and t <= context_lens[b] - next_n + i (DeepGEMM's rule:
        the next_n queries are the last next_n tokens of the context, each causal); else -inf.
        The fp8 format is q_fp8's dtype; the cache must hold the same format.
        Out-of-range values read nothing and give -inf: a token whose block id is outside
        [0, num_blocks), every row of a sequence whose context_lens is negative or more than
        its table row maps (block_tables.shape[1] * block_size). Checked mode
        (KERNELGATE_CHECKS=1) raises for both (block ids are checked below context_lens).
"""
from __future__ import annotations

import torch

from ... import checks
from ...errors import KernelgateError
from ...registry import GPU_TRITON, Case, declare
from ..common import fp8 as _fp8
from .k_cache import HEAD_DIM, TOKEN_BYTES, cache_block_size, cache_blocks, check_cache, read_cache  # noqa: F401
from .indexer_k_cache import indexer_k_quant_and_cache_native  # noqa: F401

OP_LOGITS = "fp8_paged_mqa_logits"


# -- logits ---------------------------------------------------------------------------
def fp8_paged_mqa_logits_native(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    """Indexer logits over the paged fp8 key cache; fp32 math, -inf where invalid."""
    B, next_n, H, _ = q_fp8.shape
    keys, scales = read_cache(kv_cache, q_fp8.dtype)
    nb, bs = scales.shape
    t = torch.arange(max_context_len, device=q_fp8.device)                  # [L]
    lb = t // bs
    in_table = lb < block_tables.shape[1]                   # past the table: past every context (-inf)
    blk = block_tables[:, torch.where(in_table, lb, 0)].long()                 # [B, L]
    in_cache = in_table & (blk >= 0) & (blk < nb)           # a block outside the cache: -inf, not read
    blk = torch.where(in_cache, blk, 0)
    if nb:
        k = keys[blk, t % bs].float()                                       # [B, L, 128]
        s_k = scales[blk, t % bs]                                           # [B, L]
    else:
        k, s_k = q_fp8.new_zeros(B, max_context_len, HEAD_DIM, dtype=torch.float32), t.new_zeros(B, max_context_len)
    scores = torch.einsum("bnhd,bld->bnhl", q_fp8.float(), k).relu()        # [B, next_n, H, L]
    logits = (scores * weights.view(B, next_n, H, 1)).sum(2) * s_k[:, None, :]
    ctx = context_lens.long()
    # a context length outside [0, tokens the table row maps]: the sequence's rows are all -inf
    ctx = torch.where((ctx >= 0) & (ctx <= block_tables.shape[1] * bs), ctx, 0)[:, None, None]
    q_pos = ctx - next_n + torch.arange(next_n, device=q_fp8.device)[None, :, None]
    valid = (t < ctx) & (t <= q_pos) & in_cache[:, None, :]                 # [B, next_n, L]
    return logits.masked_fill(~valid, float("-inf")).reshape(B * next_n, max_context_len)


def validate_logits(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    checks.tensor(OP_LOGITS, "q_fp8", q_fp8, ndim=4, dtype=tuple(_fp8.DTYPE_FORMAT))
    B, next_n, H, D = q_fp8.shape
    checks.require(D == HEAD_DIM, OP_LOGITS, f"q_fp8 head dim {D} != {HEAD_DIM}")
    checks.tensor(OP_LOGITS, "kv_cache", kv_cache, device=q_fp8.device)
    check_cache(OP_LOGITS, kv_cache)
    checks.tensor(OP_LOGITS, "weights", weights, shape=(B * next_n, H), dtype=torch.float32, device=q_fp8.device)
    checks.tensor(OP_LOGITS, "context_lens", context_lens, shape=(B,), dtype=torch.int32, device=q_fp8.device)
    checks.tensor(OP_LOGITS, "block_tables", block_tables, ndim=2, dtype=torch.int32, device=q_fp8.device)
    checks.require(block_tables.shape[0] == B, OP_LOGITS,
                   f"block_tables rows {block_tables.shape[0]} != batch {B}")
    checks.require(isinstance(max_context_len, int) and max_context_len > 0, OP_LOGITS,
                   f"max_context_len must be a positive int, got {max_context_len!r}")
    bs = cache_block_size(kv_cache)
    checks.require(block_tables.shape[1] * bs >= max_context_len, OP_LOGITS,
                   f"block_tables covers {block_tables.shape[1]} blocks of {bs} tokens < max_context_len "
                   f"{max_context_len}")


def check_logits(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    bs, nb = cache_block_size(kv_cache), cache_blocks(kv_cache).shape[0]
    ctx = context_lens.detach().cpu().long()
    cover = block_tables.shape[1] * bs
    bad = (ctx < 0) | (ctx > cover)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise KernelgateError(f"{OP_LOGITS}: context_lens[{i}] = {int(ctx[i])} outside [0, {cover}] "
                              f"(block_tables maps {block_tables.shape[1]} blocks of {bs} tokens)")
    used = torch.arange(block_tables.shape[1])[None, :] * bs < ctx[:, None]        # [B, cols] blocks in use
    tables = block_tables.detach().cpu().long()
    bad = used & ((tables < 0) | (tables >= nb))
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        raise KernelgateError(f"{OP_LOGITS}: block_tables[{b}, {j}] = {int(tables[b, j])} outside [0, {nb}) "
                              f"(a block of context_lens[{b}] = {int(ctx[b])} tokens)")


def random_paged_cache(B, ctx_lens, bs, fp8_dtype, gen, spare_blocks=3):
    """Keys quantized like `indexer_k_quant_and_cache` in blocks handed out in random order.
    -> (kv_cache uint8 [nb, bs*132], block_tables int32 [B, max_blocks])"""
    fmt = _fp8.DTYPE_FORMAT[fp8_dtype]
    max_blocks = max(-(-c // bs) for c in ctx_lens)
    nb = B * max_blocks + spare_blocks
    kv = torch.randint(0, 256, (nb, bs * TOKEN_BYTES), generator=gen, dtype=torch.uint8)
    keys, s = _fp8.quantize_rows(torch.randn(nb, bs, HEAD_DIM, generator=gen), fmt)
    kv[:, :bs * HEAD_DIM] = keys.view(torch.uint8).reshape(nb, -1)
    kv[:, bs * HEAD_DIM:] = s.reshape(nb, bs).contiguous().view(torch.uint8)
    tables = torch.randperm(nb, generator=gen)[:B * max_blocks].view(B, max_blocks).to(torch.int32)
    return kv, tables


def _logits_case(B, next_n, H, ctx, bs, max_len=None):
    max_len = max_len or max(ctx)

    def make(device, dtype, gen):
        kv, tables = random_paged_cache(B, ctx, bs, dtype, gen)
        fmt = _fp8.DTYPE_FORMAT[dtype]
        q, _ = _fp8.quantize_rows(torch.randn(B, next_n, H, HEAD_DIM, generator=gen), fmt)
        w = torch.randn(B * next_n, H, generator=gen) * 0.01
        ctx_t = torch.tensor(ctx, dtype=torch.int32)
        return tuple(a.to(device) for a in (q, kv, w, ctx_t, tables)) + (max_len,), {}
    return Case(f"B{B}-N{next_n}-H{H}-ctx{'_'.join(map(str, ctx))}-BS{bs}-L{max_len}", make,
                dtypes=(torch.float8_e4m3fn, torch.float8_e4m3fnuz))


def logits_cases():
    return [
        _logits_case(1, 1, 4, [1], 16),
        _logits_case(3, 1, 64, [63, 65, 130], 64),
        _logits_case(2, 2, 16, [40, 17], 16, max_len=70),
        _logits_case(2, 3, 5, [33, 2], 32),
    ]


def _logits_bytes(args, kwargs):
    q, kv, w, ctx, tables, max_len = args
    B = q.shape[0]
    # the keys + scales of every context token once, q, weights, and the fp32 logits written
    return B * max_len * TOKEN_BYTES + q.numel() + w.numel() * 4 + q.shape[0] * q.shape[1] * max_len * 4


def logits_bench_cases():
    def make(B, ctx, H, next_n, bs=64):
        def f(device, dtype, gen):
            nblk = ctx // bs
            kv = torch.randint(0, 120, (B * nblk, bs * TOKEN_BYTES), device=device, dtype=torch.uint8)
            kv.view(B * nblk, -1)[:, bs * HEAD_DIM:] = torch.rand(B * nblk, bs, device=device).view(torch.uint8)
            q = torch.randn(B, next_n, H, HEAD_DIM, device=device).to(dtype)
            w = torch.randn(B * next_n, H, device=device)
            tables = torch.randperm(B * nblk, device=device, dtype=torch.int32).view(B, nblk)
            ctx_t = torch.full((B,), ctx, device=device, dtype=torch.int32)
            return (q, kv, w, ctx_t, tables, ctx), {}
        return f
    return [Case(f"B{b}-ctx{c}-H64-N{n}", make(b, c, 64, n), dtypes=(torch.float8_e4m3fn,), bytes=_logits_bytes)
            for b, c, n in ((32, 32768, 1), (32, 32768, 2), (1, 131072, 1))]


fp8_paged_mqa_logits = declare(
    OP_LOGITS, fp8_paged_mqa_logits_native, validate=validate_logits, check_values=check_logits,
    cases=logits_cases,
    bench_cases=logits_bench_cases,
    # fp8 products are exact in fp32; the sums differ in order (and Hopper's fp8 MMA keeps
    # fewer accumulator bits), hence 2e-4 rather than fp32's 1e-5
    rtol={torch.float8_e4m3fn: 2e-4, torch.float8_e4m3fnuz: 2e-4})


# Two kernels (fp8_paged_mqa_logits_triton.py; launch choices per platform in its launch_config*):
# keys x q^T with pipelined / TMA key loads, the NVIDIA winner, and the portable q x K^T form.
fp8_paged_mqa_logits.implementation(
    "triton_kq", ".fp8_paged_mqa_logits_triton:fp8_paged_mqa_logits_triton_kq", provider="triton",
    platforms=("cuda",), requires=("triton",), priority=20,
    doc="per (sequence, context split): keys x q^T tl.dot over 64-key tiles (exact fp16 upcast or integer "
        "decode), head sum within threads; keys by TMA on sm_90+, table entry a tile ahead elsewhere")
fp8_paged_mqa_logits.implementation(
    "triton", ".fp8_paged_mqa_logits_triton:fp8_paged_mqa_logits_triton", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), priority=10,
    doc="per (sequence, context split): q x K^T tl.dot over 64-key tiles (fp8 MMA on ROCm fp8 GPUs, exact "
        "fp16 upcast, or decoded from the bytes where the device has no conversion), relu, weighted head sum")
