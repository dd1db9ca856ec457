"""Triton kernel for `paged_cache_write` (CUDA, ROCm, XPU; CPU tensors under TRITON_INTERPRET=1).

Grid (token, block of BLOCK values of the longer row): a program reads its token's slot, then
copies its part of the k row into k_cache and of the v row into v_cache (one launch for both).
A slot < 0 or past the cache writes nothing. On sm_90+ it is a programmatic dependent launch
(ops/common/pdl.py): the rows come from the kernel before it (rms_norm_rope, the projection).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import platform
from ..common.pdl import inputs_ready, pdl_args

BLOCK = 512          # values a program copies per cache (Qwen3.5's Hkv x D = 2 x 256: one program a token)


@triton.jit
def _write_kernel(slot_ptr, k_ptr, kc_ptr, v_ptr, vc_ptr, s_slot, s_k, s_kcb, s_kct, s_v, s_vcb, s_vct,
                  CK, CV, bs, rows, HAS_V: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inputs_ready(PDL)
    slot = tl.load(slot_ptr + t * s_slot).to(tl.int64)
    keep = (slot >= 0) & (slot < rows)
    ok = (tl.zeros([BLOCK], dtype=tl.int32) + keep.to(tl.int32)) > 0   # a vector (the interpreter takes no scalar)
    blk, off = slot // bs, slot % bs
    mk = ok & (c < CK)
    tl.store(kc_ptr + blk * s_kcb + off * s_kct + c, tl.load(k_ptr + t * s_k + c, mask=mk), mask=mk)
    if HAS_V:
        mv = ok & (c < CV)
        tl.store(vc_ptr + blk * s_vcb + off * s_vct + c, tl.load(v_ptr + t * s_v + c, mask=mv), mask=mv)


def _rows(x):
    """[T, C] with unit stride along C (a view where x's dims after the first are packed)."""
    x2 = x.reshape(x.shape[0], -1)
    return x2 if x2.stride(1) == 1 or x2.shape[1] <= 1 else x2.contiguous()


def paged_cache_write_triton(slot_mapping, k, k_cache, v=None, v_cache=None):
    T = k.shape[0]
    if T == 0:
        return None
    k2 = _rows(k)
    v2 = _rows(v) if v is not None else k2
    vc = v_cache if v is not None else k_cache
    CK, CV = k2.shape[1], v2.shape[1] if v is not None else 0
    widest = max(CK, CV)
    # the interpreter pays per program: one a token; a GPU: BLOCK values a program (one a token at Qwen3.5's 512)
    block = triton.next_power_of_2(max(16, widest if platform.interpreting() else min(widest, BLOCK)))
    _write_kernel[(T, triton.cdiv(widest, block))](
        slot_mapping, k2, k_cache, v2, vc, slot_mapping.stride(0), k2.stride(0), k_cache.stride(0), k_cache.stride(1),
        v2.stride(0), vc.stride(0), vc.stride(1), CK, CV, k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1],
        HAS_V=v is not None, BLOCK=block, num_warps=4, **pdl_args())
    return None
