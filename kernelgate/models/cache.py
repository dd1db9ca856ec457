"""The caches the layers read and write, one set of tensors per layer.

    KDA layer : recurrent state [S, H, K, V] fp32 (K-first, fla's layout) and
                conv state      [S, 3*H*K, W-1] (last W-1 inputs of q|k|v, model dtype),
                one slot per sequence in flight (fixed size: the point of linear attention)
    MLA layer : paged latent cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
                (model dtype): the normalised compressed KV and the shared NoPE "rope" key per
                position; a sequence holds as many blocks as its length needs (layout:
                kernelgate/ops/mla/paged.py)

Who owns which slot / block is the engine's business (its block manager); a slot or block
handed to a new owner is zeroed first (`clear`), so nothing of its last owner -- not even a
non-finite value, which a mask by multiplication would let through (0 * NaN = NaN) -- reaches
the next one.
"""
from __future__ import annotations

import torch

from .. import alloc


def slot_bytes(config, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one sequence's KDA + conv states take over all layers (on one of tp_size ranks)."""
    c = config
    H, K, W = c.linear_num_heads // tp_size, c.linear_head_dim, c.conv_kernel_size
    per = H * K * K * 4 + 3 * H * K * (W - 1) * dtype.itemsize
    return per * sum(t == "kda" for t in c.layer_types)


def block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one cache block takes over all MLA layers."""
    c = config
    return block_size * (c.kv_lora_rank + c.qk_rope_head_dim) * dtype.itemsize * sum(t == "mla" for t in c.layer_types)


class KVCache:
    def __init__(self, config, num_slots: int, num_blocks: int, block_size: int, device, dtype: torch.dtype,
                 tp_size: int = 1):
        """tp_size: the KDA states hold this rank's linear_num_heads / tp_size heads."""
        c = config
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.device, self.dtype = torch.device(device), dtype
        H, K = c.linear_num_heads // tp_size, c.linear_head_dim
        self.kda_state, self.conv_state, self.mla_cache = {}, {}, {}
        for i, kind in enumerate(c.layer_types):
            if kind == "kda":
                self.kda_state[i] = torch.zeros(num_slots, H, K, K, dtype=torch.float32, device=device)
                self.conv_state[i] = torch.zeros(num_slots, 3 * H * K, c.conv_kernel_size - 1,
                                                 dtype=dtype, device=device)
            else:
                self.mla_cache[i] = torch.zeros(num_blocks, block_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                                dtype=dtype, device=device)

    def clear(self, slots: list = (), blocks: list = ()) -> None:
        """Zero the states of `slots` and the latents of `blocks` (for their next owner)."""
        if slots:
            idx = alloc.upload(torch.tensor(list(slots), dtype=torch.long), self.device)   # (no host wait)
            for t in (*self.kda_state.values(), *self.conv_state.values()):
                t.index_fill_(0, idx, 0)
        if blocks:
            idx = alloc.upload(torch.tensor(list(blocks), dtype=torch.long), self.device)
            for t in self.mla_cache.values():
                t.index_fill_(0, idx, 0)

    def nbytes(self) -> int:
        ts = [*self.kda_state.values(), *self.conv_state.values(), *self.mla_cache.values()]
        return sum(t.numel() * t.element_size() for t in ts)
