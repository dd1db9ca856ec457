"""DeepSeek V3.2 / V4 indexer key cache (paged FP8) and the indexer logits over it.

Cache layout (DeepGEMM's `fp8_paged_mqa_logits`, vLLM's indexer cache): uint8
[num_blocks, block_size * (128 + 4)] -- vLLM views the same memory as
[num_blocks, block_size, 1, 132]; both shapes are accepted. Within one block:

    bytes [0, block_size*128)                  block_size keys of 128 fp8 codes, token-major
    bytes [block_size*128, block_size*132)     their block_size fp32 scales

Token t of sequence b lives in physical block block_tables[b, t // block_size] at offset
t % block_size.

    indexer_k_quant_and_cache(k[T,128], kv_cache, slot_mapping[T], block_size, fp8_format="e4m3fn")
        per token scale = max(amax, 1e-4) / FP8_MAX, codes = clamp(k / scale) in fp8, written at
        slot = block * block_size + offset; slot < 0 (padding) is skipped. In place, returns None.

    fp8_paged_mqa_logits(q_fp8[B,next_n,H,128], kv_cache, weights[B*next_n,H] fp32,
                         context_lens[B] int32, block_tables[B,max_blocks] int32, max_context_len)
        -> logits fp32 [B*next_n, max_context_len]
        logits[b*next_n + i, t] = s_k[t] * sum_h weights[b*next_n + i, h] * relu(q[b,i,h] . k_t)
        valid iff t < context_lens[b] and t <= context_lens[b] - next_n + i (DeepGEMM's rule:
        the next_n queries are the last next_n tokens of the context, each causal); else -inf.
        The fp8 format is q_fp8's dtype; the cache must hold the same format.
"""
from __future__ import annotations

import torch

from .. import checks
from ..registry import GPU_TRITON, Case, declare
from . import _fp8

HEAD_DIM = 128
TOKEN_BYTES = HEAD_DIM + 4
OP_STORE = "indexer_k_quant_and_cache"
OP_LOGITS = "fp8_paged_mqa_logits"


def cache_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as [num_blocks, block_size * 132] uint8 (a view)."""
    return kv_cache.view(kv_cache.shape[0], -1)


def cache_block_size(kv_cache: torch.Tensor) -> int:
    return cache_blocks(kv_cache).shape[1] // TOKEN_BYTES


def read_cache(kv_cache: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (keys fp8 [num_blocks, block_size, 128], scales fp32 [num_blocks, block_size])."""
    kv = cache_blocks(kv_cache)
    nb, bs = kv.shape[0], kv.shape[1] // TOKEN_BYTES
    keys = kv[:, :bs * HEAD_DIM].reshape(nb, bs, HEAD_DIM).view(fp8_dtype)
    scales = kv[:, bs * HEAD_DIM:].contiguous().view(torch.float32)
    return keys, scales


def _check_cache(op: str, kv_cache, block_size=None):
    checks.tensor(op, "kv_cache", kv_cache, ndim=(2, 4), dtype=torch.uint8)
    checks.require(kv_cache.is_contiguous(), op, "kv_cache must be contiguous")
    per_block = kv_cache[0].numel() if kv_cache.shape[0] else 0
    checks.require(per_block % TOKEN_BYTES == 0, op,
                   f"kv_cache bytes per block {per_block} is not block_size * {TOKEN_BYTES} "
                   f"(shape {tuple(kv_cache.shape)})")
    if block_size is not None:
        checks.require(per_block == block_size * TOKEN_BYTES, op,
                       f"kv_cache bytes per block {per_block} != block_size {block_size} * {TOKEN_BYTES}")


# -- store ----------------------------------------------------------------------------
def indexer_k_quant_and_cache_native(k, kv_cache, slot_mapping, block_size, fp8_format="e4m3fn"):
    """Quantize keys per token to fp8 and write codes + fp32 scale into the paged cache."""
    kv = cache_blocks(kv_cache)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    codes, scale = _fp8.quantize_rows(k[keep].float(), fp8_format)   # [n, 128], [n, 1]
    blk, off = slots // block_size, slots % block_size
    d = torch.arange(HEAD_DIM, device=k.device)
    kv[blk[:, None], off[:, None] * HEAD_DIM + d] = codes.view(torch.uint8)
    b4 = torch.arange(4, device=k.device)
    # the scales' bytes via a 1-D view: [n, 1] may carry any stride on its unit dim (torch.compile's does)
    kv[blk[:, None], block_size * HEAD_DIM + off[:, None] * 4 + b4] = scale.reshape(-1).view(torch.uint8).view(-1, 4)


def validate_store(k, kv_cache, slot_mapping, block_size, fp8_format="e4m3fn"):
    checks.tensor(OP_STORE, "k", k, ndim=2, dtype=checks.FLOATS)
    checks.require(k.shape[1] == HEAD_DIM, OP_STORE, f"k shape {tuple(k.shape)} != (T, {HEAD_DIM})")
    checks.require(isinstance(block_size, int) and block_size > 0, OP_STORE,
                   f"block_size must be a positive int, got {block_size!r}")
    checks.tensor(OP_STORE, "kv_cache", kv_cache, device=k.device)
    _check_cache(OP_STORE, kv_cache, block_size)
    checks.tensor(OP_STORE, "slot_mapping", slot_mapping, shape=(k.shape[0],),
                  dtype=(torch.int32, torch.int64), device=k.device)
    _fp8.check_format(OP_STORE, fp8_format)


def _store_case(T, num_blocks, bs, fmt="e4m3fn", pad=0):
    def make(device, dtype, gen):
        k = (2 * torch.randn(T, HEAD_DIM, generator=gen)).to(device=device, dtype=dtype)
        kv = torch.randint(0, 256, (num_blocks, bs * TOKEN_BYTES), generator=gen, dtype=torch.uint8)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:T].to(torch.int64)
        slots[:pad] = -1                                    # padding tokens: not written
        return (k, kv.to(device), slots.to(device), bs), dict(fp8_format=fmt)
    return Case(f"T{T}-NB{num_blocks}-BS{bs}-{fmt}" + (f"-pad{pad}" if pad else ""), make)


def store_cases():
    return [_store_case(1, 2, 16), _store_case(63, 5, 16, pad=3), _store_case(65, 3, 64, fmt="e4m3fnuz"),
            _store_case(100, 7, 32)]


def _store_bytes(args, kwargs):
    k = args[0]
    return k.numel() * k.element_size() + k.shape[0] * (TOKEN_BYTES + args[2].element_size())


def store_bench_cases():
    def make(device, dtype, gen):
        T, bs, nb = 16384, 64, 4096
        k = torch.randn(T, HEAD_DIM, device=device, dtype=dtype)
        kv = torch.zeros(nb, bs * TOKEN_BYTES, device=device, dtype=torch.uint8)
        return (k, kv, torch.randperm(nb * bs, device=device)[:T], bs), {}
    return [Case("T16384-BS64", make, dtypes=(torch.bfloat16,), bytes=_store_bytes)]


def compare_cache(name, out, ref, dtype):
    """Caches after a store: fp32 scales bit-exact; fp8 code bytes within one code on at most
    _fp8.ULP_FRACTION of them (the bound the q quantizer is held to; a GPU may round a value on
    the boundary of two codes the other way), identical elsewhere (untouched slots)."""
    o, r = cache_blocks(out).cpu(), cache_blocks(ref).cpu()
    bs = o.shape[1] // TOKEN_BYTES
    so, sr = o[:, bs * HEAD_DIM:], r[:, bs * HEAD_DIM:]
    bad = int((so != sr).sum())
    assert bad == 0, f"{name}: {bad} of {sr.numel()} scale bytes differ"
    dist = _fp8.code_distance(o[:, :bs * HEAD_DIM], r[:, :bs * HEAD_DIM])
    far, near = int((dist > 1).sum()), int((dist == 1).sum())
    assert far == 0, f"{name}: {far} code bytes differ by more than one fp8 code"
    assert near <= _fp8.ULP_FRACTION * dist.numel(), f"{name}: {near} of {dist.numel()} code bytes one code apart"


indexer_k_quant_and_cache = declare(
    OP_STORE, indexer_k_quant_and_cache_native, validate=validate_store, mutates=("kv_cache",),
    compare_mutated=compare_cache, cases=store_cases, bench_cases=store_bench_cases)
indexer_k_quant_and_cache.implementation(
    "triton", "kernelgate.ops.triton.indexer_k_cache:indexer_k_quant_and_cache_triton", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), priority=10, doc="per-token amax, exact fp8 encode, paged write")


# -- logits ---------------------------------------------------------------------------
def fp8_paged_mqa_logits_native(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    """Indexer logits over the paged fp8 key cache; fp32 math, -inf where invalid."""
    B, next_n, H, _ = q_fp8.shape
    keys, scales = read_cache(kv_cache, q_fp8.dtype)
    nb, bs = scales.shape
    t = torch.arange(max_context_len, device=q_fp8.device)                  # [L]
    lb = (t // bs).clamp(max=block_tables.shape[1] - 1)
    blk = block_tables[:, lb].long().clamp(0, nb - 1)                       # [B, L] (masked below)
    k = keys[blk, t % bs].float()                                           # [B, L, 128]
    s_k = scales[blk, t % bs]                                               # [B, L]
    scores = torch.einsum("bnhd,bld->bnhl", q_fp8.float(), k).relu()        # [B, next_n, H, L]
    logits = (scores * weights.view(B, next_n, H, 1)).sum(2) * s_k[:, None, :]
    ctx = context_lens.long()[:, None, None]
    q_pos = ctx - next_n + torch.arange(next_n, device=q_fp8.device)[None, :, None]
    valid = (t < ctx) & (t <= q_pos)                                        # [B, next_n, L]
    return logits.masked_fill(~valid, float("-inf")).reshape(B * next_n, max_context_len)


def validate_logits(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    checks.tensor(OP_LOGITS, "q_fp8", q_fp8, ndim=4, dtype=tuple(_fp8.DTYPE_FORMAT))
    B, next_n, H, D = q_fp8.shape
    checks.require(D == HEAD_DIM, OP_LOGITS, f"q_fp8 head dim {D} != {HEAD_DIM}")
    checks.tensor(OP_LOGITS, "kv_cache", kv_cache, device=q_fp8.device)
    _check_cache(OP_LOGITS, kv_cache)
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
    OP_LOGITS, fp8_paged_mqa_logits_native, validate=validate_logits, cases=logits_cases,
    bench_cases=logits_bench_cases,
    # fp8 products are exact in fp32; the sums differ in order (and Hopper's fp8 MMA keeps
    # fewer accumulator bits), hence 2e-4 rather than fp32's 1e-5
    rtol={torch.float8_e4m3fn: 2e-4, torch.float8_e4m3fnuz: 2e-4})


fp8_paged_mqa_logits.implementation(
    "triton", "kernelgate.ops.triton.indexer_logits:fp8_paged_mqa_logits_triton", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), priority=10,
    doc="per (sequence, context split): keys x q^T tl.dot over 64-key tiles (fp8 upcast, or decoded from the "
        "bytes where the device has no conversion for the format), relu, weighted head sum")
