"""A fixed pool of per-sequence state slots, one set of tensors per layer.

    KDA layer : recurrent state [S, H, K, V] fp32 (K-first, fla's layout) and
                conv state      [S, 3*H*K, W-1] (last W-1 inputs of q|k|v, model dtype)
    MLA layer : latent cache    [S, max_len, kv_lora_rank + qk_rope_head_dim] (model dtype):
                the normalised compressed KV and the shared NoPE "rope" key, per position

A slot is zeroed when handed out, so a new sequence always starts from empty state.
"""
from __future__ import annotations

import torch

from ..platform import KernelgateError


class StatePool:
    def __init__(self, config, num_slots: int, max_len: int, device, dtype: torch.dtype):
        c = config
        self.num_slots, self.max_len = num_slots, max_len
        self.device, self.dtype = torch.device(device), dtype
        H, K = c.linear_num_heads, c.linear_head_dim
        self.kda_state, self.conv_state, self.mla_cache = {}, {}, {}
        for i, kind in enumerate(c.layer_types):
            if kind == "kda":
                self.kda_state[i] = torch.zeros(num_slots, H, K, K, dtype=torch.float32, device=device)
                self.conv_state[i] = torch.zeros(num_slots, 3 * H * K, c.conv_kernel_size - 1,
                                                 dtype=dtype, device=device)
            else:
                self.mla_cache[i] = torch.zeros(num_slots, max_len, c.kv_lora_rank + c.qk_rope_head_dim,
                                                dtype=dtype, device=device)
        self._free = list(range(num_slots - 1, -1, -1))   # pop() hands out slot 0 first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise KernelgateError(f"state pool: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        for t in (*self.kda_state.values(), *self.conv_state.values()):
            t[slot].zero_()
        return slot

    def reserve(self) -> int:
        """Take a slot out of circulation for good (the decode graphs' padding rows use it)."""
        return self.alloc()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise KernelgateError(f"state pool: slot {slot} is not in use")
        self._free.append(slot)

    def nbytes(self) -> int:
        ts = [*self.kda_state.values(), *self.conv_state.values(), *self.mla_cache.values()]
        return sum(t.numel() * t.element_size() for t in ts)
