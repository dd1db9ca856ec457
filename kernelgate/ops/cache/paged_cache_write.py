"""Write a step's new rows into one or two paged caches, in place (the K / V caches of grouped-query
attention: kernelgate/ops/attention/paged.py's layout).

    paged_cache_write(slot_mapping, k, k_cache, v=None, v_cache=None) -> None
        slot_mapping [T] int32 / int64: token t's flat cache row, block * block_size + offset;
                     < 0: a padding token, skipped
        k            [T, ...] float: token t's row, C values (its dims after the first, e.g. [Hkv, D]
                     or [Hkv * D]); any row stride (a slice of a fused projection is fine)
        k_cache      [num_blocks, block_size, ...] of k's dtype, C values a row after the first two
                     dims, those dims contiguous; the first two may have any strides that keep rows
                     apart (a column range of a wider cache is fine)
        v, v_cache   a second pair, the same way (both or neither); MLA writes its latent's two parts,
                     the normed latent and the rope key, into the two column ranges of its one cache

k_cache[slot // block_size, slot % block_size] = k[t] for every t with slot_mapping[t] >= 0, and
the same for v; two tokens never share a slot (the engine's slot mapping). One launch writes both
caches: a decode step of Qwen3-Next / Qwen3.5 attention wrote them with an int64 cast of the
mapping and two index_copy_ (three launches a layer, none of which lets the next kernel start
early; ops/common/pdl.py).

A slot past the cache: the native reference, any call on CPU tensors and checked mode
(KERNELGATE_CHECKS=1) raise KernelgateError; a device kernel cannot check values without a host
sync (decode runs in captured graphs) and skips the row -- never a write out of bounds.
"""
from __future__ import annotations

import math

import torch

from ... import checks
from ...registry import GPU_TRITON, Case, declare
from ..common import index_checks

OP = "paged_cache_write"


def _pairs(k, k_cache, v, v_cache):
    return [(n, x, c) for n, x, c in (("k", k, k_cache), ("v", v, v_cache)) if x is not None]


def paged_cache_write_native(slot_mapping, k, k_cache, v=None, v_cache=None):
    """Index assignment of the kept tokens' rows."""
    for name, x, cache in _pairs(k, k_cache, v, v_cache):
        rows = cache.shape[0] * cache.shape[1]
        index_checks.ids_below(OP, "slot_mapping", slot_mapping, rows, f"{name}_cache rows")
        keep = slot_mapping >= 0
        s = slot_mapping[keep].long()
        cache[s // cache.shape[1], s % cache.shape[1]] = x[keep].reshape(-1, *cache.shape[2:])


def validate(slot_mapping, k, k_cache, v=None, v_cache=None):
    checks.require((v is None) == (v_cache is None), OP,
                   f"v and v_cache go together: got v {'None' if v is None else 'a tensor'}, "
                   f"v_cache {'None' if v_cache is None else 'a tensor'}")
    checks.tensor(OP, "k", k, dtype=checks.FLOATS)
    checks.require(k.dim() >= 1, OP, "k must have a token dim")
    T = k.shape[0]
    checks.tensor(OP, "slot_mapping", slot_mapping, shape=(T,), dtype=(torch.int32, torch.int64), device=k.device)
    for name, x, cache in _pairs(k, k_cache, v, v_cache):
        checks.tensor(OP, name, x, dtype=checks.FLOATS, device=k.device)
        checks.require(x.dim() >= 1 and x.shape[0] == T, OP,
                       f"{name} shape {tuple(x.shape)}: tokens != slot_mapping's {T}")
        checks.tensor(OP, f"{name}_cache", cache, dtype=x.dtype, device=k.device)
        checks.require(cache.dim() >= 3, OP, f"{name}_cache must have 3 or more dims "
                       f"[num_blocks, block_size, ...], got shape {tuple(cache.shape)}")
        C = math.prod(cache.shape[2:])
        checks.require(math.prod(x.shape[1:]) == C, OP, f"{name} shape {tuple(x.shape)}: {math.prod(x.shape[1:])} "
                       f"values a token != {C} a row of {name}_cache {tuple(cache.shape)}")
        row = cache[0, 0] if cache.shape[0] and cache.shape[1] else None
        apart = cache.stride(1) >= C and cache.stride(0) >= cache.shape[1] * cache.stride(1)
        checks.require(row is None or row.is_contiguous() and apart, OP,
                       f"{name}_cache rows (dims after the first two) must be contiguous and apart (strides of "
                       f"the first two dims >= a row, a block), got strides {cache.stride()}")
    if k.device.type == "cpu":   # values are free to read on the host (never a device sync here)
        check_values(slot_mapping, k, k_cache, v, v_cache)


def check_values(slot_mapping, k, k_cache, v=None, v_cache=None):
    for name, _, cache in _pairs(k, k_cache, v, v_cache):
        index_checks.ids_below(OP, "slot_mapping", slot_mapping, cache.shape[0] * cache.shape[1],
                               f"{name}_cache rows")


def make_inputs(T, nb, bs, Hkv, D, dtype, gen, device="cpu", pad=0, fused=False, only_k=False):
    """(slot_mapping, k, k_cache, v, v_cache): distinct random slots (the first `pad` -1), caches
    of random values (rows not written must stay as they were); `fused`: v a slice of a wider
    [T, ...] projection, as the model passes it."""
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[:pad] = -1
    k = torch.randn(T, Hkv, D, generator=gen)
    v = torch.randn(T, Hkv * D * (3 if fused else 1), generator=gen)[:, Hkv * D:2 * Hkv * D] if fused \
        else torch.randn(T, Hkv, D, generator=gen)
    kc, vc = torch.randn(nb, bs, Hkv, D, generator=gen), torch.randn(nb, bs, Hkv, D, generator=gen)
    out = [slots.to(torch.int32).to(device), k.to(dtype).to(device), kc.to(dtype).to(device)]
    if not only_k:
        out += [v.to(dtype).to(device), vc.to(dtype).to(device)]
    return tuple(out)


def latent_inputs(T, nb, bs, R, Dr, dtype, gen, device="cpu"):
    """MLA's write: (slot_mapping, c [T, R], cache[..., :R], k_r [T, Dr] (a slice of the projection),
    cache[..., R:]) -- two column ranges of one [nb, bs, R + Dr] cache."""
    slots = torch.randperm(nb * bs, generator=gen)[:T].to(torch.int32)
    proj = torch.randn(T, 2 * R + Dr, generator=gen)                 # [q | c | k_r] of a fused projection
    cache = torch.randn(nb, bs, R + Dr, generator=gen).to(dtype).to(device)
    return (slots.to(device), torch.randn(T, R, generator=gen).to(dtype).to(device), cache[..., :R],
            proj[:, R + R:].to(dtype).to(device), cache[..., R:])


def _case(T, nb, bs, Hkv, D, pad=0, fused=False, only_k=False, dtypes=(torch.float32, torch.bfloat16)):
    def make(device, dtype, gen):
        return make_inputs(T, nb, bs, Hkv, D, dtype, gen, device, pad, fused, only_k), {}
    return Case(f"T{T}-NB{nb}-BS{bs}-Hkv{Hkv}-D{D}" + (f"-pad{pad}" if pad else "") + ("-vslice" if fused else "")
                + ("-k-only" if only_k else ""), make, dtypes=dtypes)


def cases():
    return [
        _case(1, 3, 16, 2, 256, fused=True),                         # a Qwen3.5 decode token, v a slice of qkv
        _case(37, 4, 16, 2, 60, pad=5, dtypes=checks.FLOATS),        # padding tokens, odd head dim
        _case(9, 2, 8, 1, 96, only_k=True),                          # one cache
        _case(0, 2, 16, 2, 64),                                      # no tokens
        Case("MLA-latent-T3-R64-Dr16", lambda device, dtype, gen: (latent_inputs(3, 2, 4, 64, 16, dtype, gen,
                                                                                 device), {})),
    ]


def _bytes(args, kwargs):
    return 2 * sum(x.numel() * x.element_size() for x in args[1::2])   # read a row, write it


def bench_cases():
    def make(T):
        def f(device, dtype, gen):
            return make_inputs(T, max(2, -(-T // 64)) * 2, 64, 2, 256, dtype, gen, device), {}
        return f
    return [Case(f"T{T}-Hkv2-D256-BS64", make(T), dtypes=(torch.bfloat16,), bytes=_bytes) for T in (1, 64, 8192)]


paged_cache_write = declare(OP, paged_cache_write_native, validate=validate, check_values=check_values, dtype_arg="k",
                            mutates=("k_cache", "v_cache"), cases=cases, bench_cases=bench_cases)
paged_cache_write.implementation(
    "triton", ".paged_cache_write_triton:paged_cache_write_triton", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), dtypes=checks.FLOATS, priority=10,
    doc="one launch for both caches: a program copies a block of a token's row into each")
