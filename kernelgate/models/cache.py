"""The caches the layers read and write, one set of tensors per layer.

A `LayerCache` is built from the model's specs (per-slot and per-block tensors by kind); Kimi
Linear's is `KVCache`:

    KDA layer : recurrent state [S, H, K, V] fp32 (K-first, fla's layout) and
                conv state      [S, 3*H*K, W-1] (last W-1 inputs of q|k|v, model dtype),
                one slot per sequence in flight (fixed size: the point of linear attention)
    MLA layer : paged latent cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
                (model dtype): the normalised compressed KV and the shared NoPE "rope" key per
                position; a sequence holds as many blocks as its length needs (layout:
                kernelgate/ops/mla/paged.py)

Qwen3-Next / Qwen3.5 (qwen3_next.py's cache_specs): per Gated DeltaNet layer a recurrent state
[S, HV, K, V] fp32 and a conv state [S, 2*HK*K + HV*V, W-1]; per full-attention layer K and V
caches [num_blocks, block_size, Hkv, Dh] (kernelgate/ops/attention/paged.py).

Who owns which slot / block is the engine's business (its block manager); a slot or block
handed to a new owner is zeroed first (`clear`), so nothing of its last owner -- not even a
non-finite value, which a mask by multiplication would let through (0 * NaN = NaN) -- reaches
the next one.

The snapshot pool (`num_snapshots` rows of every per-slot state) holds the prefix cache's saved
states: `save` copies slots into it, `restore` copies rows back into slots, `copy_rows` copies
the first rows of cache blocks (a prefix's partial block into a new owner's fresh one).
"""
from __future__ import annotations

import math

import torch

from .. import alloc


def slot_bytes(config, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one sequence's KDA + conv states take over all layers (on one of tp_size ranks)."""
    return spec_bytes(kimi_specs(config, dtype, tp_size)[0])


def block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one cache block takes over all MLA layers."""
    return block_size * spec_bytes(kimi_specs(config, dtype)[1])


class LayerCache:
    """Per-slot and per-block tensors of every layer, by kind, from the model's specs:

        slot_specs  {kind: {layer: (shape, dtype)}} -> [num_slots, *shape] per layer
        block_specs {kind: {layer: (shape, dtype)}} -> [num_blocks, block_size, *shape] per layer

    Each kind is an attribute ({layer: tensor}): `cache.conv_state[i]`, `cache.k_cache[i]`."""

    def __init__(self, slot_specs: dict, block_specs: dict, num_slots: int, num_blocks: int, block_size: int,
                 device, dtype: torch.dtype, num_snapshots: int = 0):
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.num_snapshots = num_snapshots
        self.device, self.dtype = torch.device(device), dtype
        self.slot_tensors, self.block_tensors = [], []
        for specs, lead, out in ((slot_specs, (num_slots,), self.slot_tensors),
                                 (block_specs, (num_blocks, block_size), self.block_tensors)):
            for kind, layers in specs.items():
                tensors = {i: torch.zeros(*lead, *shape, dtype=dt, device=device) for i, (shape, dt) in layers.items()}
                setattr(self, kind, tensors)
                out.extend(tensors.values())
        # the snapshot pool: num_snapshots rows of every per-slot tensor (the prefix cache's saved states)
        self.snapshot_tensors = [torch.zeros(num_snapshots, *t.shape[1:], dtype=t.dtype, device=device)
                                 for t in self.slot_tensors]

    def _index(self, values) -> torch.Tensor:
        return alloc.upload(torch.tensor(list(values), dtype=torch.long), self.device)   # (no host wait)

    def clear(self, slots: list = (), blocks: list = ()) -> None:
        """Zero the states of `slots` and the latents of `blocks` (for their next owner)."""
        if slots:
            idx = self._index(slots)
            for t in self.slot_tensors:
                t.index_fill_(0, idx, 0)
        if blocks:
            idx = self._index(blocks)
            for t in self.block_tensors:
                t.index_fill_(0, idx, 0)

    def save(self, pairs: list) -> None:
        """[(slot, snapshot)]: copy each slot's states into that snapshot row."""
        if pairs:
            idx = self._index([v for p in pairs for v in p]).view(-1, 2)
            for t, snap in zip(self.slot_tensors, self.snapshot_tensors):
                snap.index_copy_(0, idx[:, 1], t.index_select(0, idx[:, 0]))

    def restore(self, pairs: list) -> None:
        """[(snapshot, slot)]: copy each snapshot row's states into that slot."""
        if pairs:
            idx = self._index([v for p in pairs for v in p]).view(-1, 2)
            for t, snap in zip(self.slot_tensors, self.snapshot_tensors):
                t.index_copy_(0, idx[:, 1], snap.index_select(0, idx[:, 0]))

    def copy_rows(self, copies: list) -> None:
        """[(source block, destination block, rows)]: the first `rows` positions of the source
        block into the destination block, in every block tensor."""
        if copies:
            bs = self.block_size
            src = [s * bs + r for s, _, n in copies for r in range(n)]
            dst = [d * bs + r for _, d, n in copies for r in range(n)]
            idx = self._index(src + dst)
            for t in self.block_tensors:
                flat = t.view(-1, *t.shape[2:])
                flat.index_copy_(0, idx[len(src):], flat.index_select(0, idx[:len(src)]))

    def nbytes(self) -> int:
        ts = [*self.slot_tensors, *self.snapshot_tensors, *self.block_tensors]
        return sum(t.numel() * t.element_size() for t in ts)


class KVCache(LayerCache):
    """Kimi Linear's cache: KDA states and conv states per KDA layer, MLA latents per MLA layer."""

    def __init__(self, config, num_slots: int, num_blocks: int, block_size: int, device, dtype: torch.dtype,
                 tp_size: int = 1, num_snapshots: int = 0):
        """tp_size: the KDA states hold this rank's linear_num_heads / tp_size heads."""
        super().__init__(*kimi_specs(config, dtype, tp_size), num_slots, num_blocks, block_size, device, dtype,
                         num_snapshots)


def kimi_specs(config, dtype: torch.dtype, tp_size: int = 1) -> tuple:
    """(slot_specs, block_specs) of Kimi Linear (see LayerCache)."""
    c = config
    H, K = c.linear_num_heads // tp_size, c.linear_head_dim
    kda = [i for i, t in enumerate(c.layer_types) if t == "kda"]
    mla = [i for i, t in enumerate(c.layer_types) if t != "kda"]
    slot = {"kda_state": {i: ((H, K, K), torch.float32) for i in kda},
            "conv_state": {i: ((3 * H * K, c.conv_kernel_size - 1), dtype) for i in kda}}
    block = {"mla_cache": {i: ((c.kv_lora_rank + c.qk_rope_head_dim,), dtype) for i in mla}}
    return slot, block


def spec_bytes(specs: dict) -> int:
    """Bytes of one row (slot, or block position) of every tensor in `specs`."""
    return sum(math.prod(shape) * dt.itemsize for layers in specs.values() for shape, dt in layers.values())
