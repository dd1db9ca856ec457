"""indexer_k_quant_and_cache(k[T,128], kv_cache, slot_mapping[T], block_size, fp8_format="e4m3fn")

Per token scale = max(amax, 1e-4) / FP8_MAX, codes = clamp(k / scale) in fp8, written into the
paged indexer cache (layout: k_cache.py) at slot = block * block_size + offset; slot < 0
(padding) is skipped, and so is a slot past the cache (checked mode, KERNELGATE_CHECKS=1,
raises for it). In place, returns None.
"""
from __future__ import annotations

import torch

from ... import checks
from ...registry import GPU_TRITON, Case, declare
from ..common import fp8 as _fp8
from ..common import index_checks
from .k_cache import HEAD_DIM, TOKEN_BYTES, cache_block_size, cache_blocks, check_cache, read_cache  # noqa: F401

OP_STORE = "indexer_k_quant_and_cache"


# -- store ----------------------------------------------------------------------------
def indexer_k_quant_and_cache_native(k, kv_cache, slot_mapping, block_size, fp8_format="e4m3fn"):
    """Quantize keys per token to fp8 and write codes + fp32 scale into the paged cache."""
    kv = cache_blocks(kv_cache)
    keep = (slot_mapping >= 0) & (slot_mapping < kv.shape[0] * block_size)
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
    check_cache(OP_STORE, kv_cache, block_size)
    checks.tensor(OP_STORE, "slot_mapping", slot_mapping, shape=(k.shape[0],),
                  dtype=(torch.int32, torch.int64), device=k.device)
    _fp8.check_format(OP_STORE, fp8_format)


def check_store(k, kv_cache, slot_mapping, block_size, fp8_format="e4m3fn"):
    index_checks.ids_below(OP_STORE, "slot_mapping", slot_mapping, cache_blocks(kv_cache).shape[0] * block_size,
                           "cache slots")


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
    OP_STORE, indexer_k_quant_and_cache_native, validate=validate_store, check_values=check_store,
    mutates=("kv_cache",),
    compare_mutated=compare_cache, cases=store_cases, bench_cases=store_bench_cases)
indexer_k_quant_and_cache.implementation(
    "triton", ".indexer_k_cache_triton:indexer_k_quant_and_cache_triton", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), priority=10, doc="per-token amax, exact fp8 encode, paged write")
