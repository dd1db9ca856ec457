"""Triton kernel: quantize indexer keys per token to fp8 and write them into the paged cache
(layout in k_cache.py). One program per BLOCK_T tokens."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import platform
from ..common import fp8 as _fp8
from .indexer_q_triton import _quant
from .k_cache import cache_blocks

OP_STORE = "indexer_k_quant_and_cache"

BLOCK_T = 16


@triton.jit
def _k_store_kernel(k_ptr, slot_ptr, kv_ptr, kvs_ptr, T, s_k, s_kd, s_slot, n_slots, block_size, blk_bytes, fmax,
                    FNUZ: tl.constexpr, BLOCK_T: tl.constexpr, HW: tl.constexpr, FAST_DIV: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + tok.to(tl.int64) * s_slot, mask=tok < T, other=-1).to(tl.int64)
    keep = (slot >= 0) & (slot < n_slots)                        # slot < 0: padding; past the cache: skipped
    d = tl.arange(0, 128)
    x = tl.load(k_ptr + tok.to(tl.int64)[:, None] * s_k + d[None, :] * s_kd, mask=keep[:, None], other=0.0)
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-4), fmax)          # [BLOCK_T]
    sc = scale[:, None]
    inv = tl.math.div_rn(tl.full((BLOCK_T, 1), 1.0, tl.float32), sc)
    blk = slot // block_size
    off = slot % block_size
    tl.store(kv_ptr + (blk * blk_bytes + off * 128)[:, None] + d[None, :], _quant(x, inv, sc, fmax, FNUZ, HW, FAST_DIV),
             mask=keep[:, None])
    # the scales sit after the block's block_size * 128 code bytes; kvs_ptr is the fp32 view
    tl.store(kvs_ptr + blk * (blk_bytes // 4) + block_size * 32 + off, scale, mask=keep)


def launch_config(plat: platform.Platform, fp8_format: str = "e4m3fn") -> dict:
    """As the q kernel on NVIDIA GPUs: x * (1 / scale) (within one code of x / scale, the parity bound)
    and the hardware e4m3fn encode where the device has one; elsewhere (and under the interpreter) the
    exact division and the integer encoder."""
    nvidia = plat.name == "cuda" and plat.triton_mode == "compiled" and (plat.capability or "").startswith("sm_")
    return dict(fast_div=nvidia, hw_encode=nvidia and fp8_format == "e4m3fn" and platform.fp8_hardware(plat.capability))


def indexer_k_quant_and_cache_triton(k, kv_cache, slot_mapping, block_size, fp8_format="e4m3fn"):
    T = k.shape[0]
    if T == 0:
        return None
    kv = cache_blocks(kv_cache)
    _, fmax = _fp8.FORMATS[fp8_format]
    cfg = launch_config(platform.current(), fp8_format)
    _k_store_kernel[(triton.cdiv(T, BLOCK_T),)](
        k, slot_mapping, kv, kv.view(torch.float32), T, *k.stride(), slot_mapping.stride(0), kv.shape[0] * block_size,
        block_size, kv.shape[1], fmax,
        FNUZ=fp8_format == "e4m3fnuz", BLOCK_T=BLOCK_T, num_warps=4,
        HW=cfg["hw_encode"], FAST_DIV=cfg["fast_div"])
    return None

