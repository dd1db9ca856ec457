"""DeepSeek V3.2 / V4 indexer key cache: the paged FP8 layout both indexer ops and their kernels read.

Cache layout (DeepGEMM's `fp8_paged_mqa_logits`, vLLM's indexer cache): uint8
[num_blocks, block_size * (128 + 4)] -- vLLM views the same memory as
[num_blocks, block_size, 1, 132]; both shapes are accepted. Within one block:

    bytes [0, block_size*128)                  block_size keys of 128 fp8 codes, token-major
    bytes [block_size*128, block_size*132)     their block_size fp32 scales

Token t of sequence b lives in physical block block_tables[b, t // block_size] at offset
t % block_size.
"""
from __future__ import annotations

import torch

from ... import checks

HEAD_DIM = 128
TOKEN_BYTES = HEAD_DIM + 4


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


def check_cache(op: str, kv_cache, block_size=None):
    checks.tensor(op, "kv_cache", kv_cache, ndim=(2, 4), dtype=torch.uint8)
    checks.require(kv_cache.is_contiguous(), op, "kv_cache must be contiguous")
    per_block = kv_cache[0].numel() if kv_cache.shape[0] else 0
    checks.require(per_block % TOKEN_BYTES == 0, op,
                   f"kv_cache bytes per block {per_block} is not block_size * {TOKEN_BYTES} "
                   f"(shape {tuple(kv_cache.shape)})")
    if block_size is not None:
        checks.require(per_block == block_size * TOKEN_BYTES, op,
                       f"kv_cache bytes per block {per_block} != block_size {block_size} * {TOKEN_BYTES}")
