"""How many cache blocks and state slots an engine gets: the capacity report.

On an accelerator (vLLM's recipe): after the weights are in, run one step at the token
budget (`max_num_batched_tokens` tokens of prefill) and measure its activation peak; then
what `gpu_memory_utilization` of the device leaves -- minus memory used outside torch (other
processes, the driver's context), the weights, that peak and a reserve for the decode graphs
-- goes to the caches: `max_num_seqs` state slots first, MLA latent blocks with the rest.
`num_cache_blocks` pins the block count instead (vLLM's num_gpu_blocks_override). On the CPU
there is nothing to measure: the default is enough blocks for max_num_seqs sequences of
max_model_len tokens.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..config import EngineConfig
from ..errors import KernelgateError

GRAPH_RESERVE = 512 << 20      # decode graphs' private memory pool (bytes)
GiB = 1 << 30


@dataclass
class Capacity:
    num_blocks: int               # usable MLA cache blocks (scratch excluded)
    block_size: int
    num_slots: int                # sequences in flight (state slots, scratch excluded)
    max_model_len: int
    max_num_batched_tokens: int
    block_bytes: int              # one block over all MLA layers
    slot_bytes: int               # one sequence's KDA + conv states over all KDA layers
    num_snapshots: int            # the prefix cache's state snapshots (each slot_bytes)
    cache_bytes: int              # everything the caches hold (scratch included)
    weights_bytes: int
    activation_bytes: int | None = None   # measured peak of one step at the token budget
    device_bytes: int | None = None       # device memory in total
    source: str = ""              # how the block count was chosen

    @property
    def cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrent_full_length(self) -> float:
        """How many max_model_len sequences the blocks hold at once."""
        return self.cache_tokens / self.max_model_len

    def as_dict(self) -> dict:
        return {**asdict(self), "cache_tokens": self.cache_tokens}

    def report(self) -> str:
        act = "" if self.activation_bytes is None else f", activation peak {self.activation_bytes / GiB:.2f} GiB"
        return (f"cache: {self.cache_tokens:,} tokens of MLA latents ({self.num_blocks:,} blocks of {self.block_size}), "
                f"{self.num_slots} sequences, {self.cache_bytes / GiB:.2f} GiB; "
                + (f"prefix cache: {self.num_snapshots} state snapshots ({self.num_snapshots * self.slot_bytes / GiB:.2f} GiB); "
                   if self.num_snapshots else "prefix cache off; ")
                + f"weights {self.weights_bytes / GiB:.2f} GiB"
                f"{act}; up to {self.max_concurrent_full_length:.1f}x max_model_len {self.max_model_len} at once "
                f"[{self.source}]")


def _accel(device: torch.device):
    mod = getattr(torch, device.type, None)
    need = ("mem_get_info", "max_memory_allocated", "reset_peak_memory_stats", "memory_allocated", "synchronize")
    return mod if device.type != "cpu" and mod is not None and all(hasattr(mod, n) for n in need) else None


def plan(model, config: EngineConfig, profile, graphs: bool) -> Capacity:
    """-> Capacity (usable counts; the caller adds the scratch slot / block for graphs).
    profile(): runs the budget step and returns the bytes of its temporary cache."""
    max_num_seqs, max_model_len, block_size = config.max_num_seqs, config.max_model_len, config.block_size
    max_num_batched_tokens, util, num_cache_blocks = (config.max_num_batched_tokens, config.gpu_memory_utilization,
                                                      config.num_cache_blocks)
    bb, sb = model.block_bytes(block_size), model.slot_bytes()
    snaps = config.num_snapshots
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    slots = max_num_seqs
    full = -(-max_model_len // block_size)
    mod = _accel(model.device)
    act = total = None
    if num_cache_blocks is not None:
        blocks, source = num_cache_blocks, "num_cache_blocks"
    elif mod is None:
        blocks, source = slots * full, "max_num_seqs x max_model_len (no device memory to measure)"
    else:
        mod.synchronize()
        if hasattr(mod, "empty_cache"):
            mod.empty_cache()
        base = mod.memory_allocated()
        mod.reset_peak_memory_stats()
        tmp = profile()
        mod.synchronize()
        act = max(0, mod.max_memory_allocated() - base - tmp)
        if hasattr(mod, "empty_cache"):
            mod.empty_cache()
        free, total = mod.mem_get_info()
        reserved = mod.memory_reserved() if hasattr(mod, "memory_reserved") else mod.memory_allocated()
        outside = max(0, total - free - reserved)        # other processes, driver context
        left = int(total * util) - outside - mod.memory_allocated() - act - (GRAPH_RESERVE if graphs else 0) \
            - (slots + 1 + snaps) * sb - bb
        blocks = max(0, left // bb) if bb else full * slots
        source = f"gpu_memory_utilization {util}"
        if blocks < full:
            raise KernelgateError(
                f"engine: gpu_memory_utilization {util} leaves room for {blocks} cache blocks of {block_size} "
                f"tokens ({blocks * block_size} tokens) after weights {weights / GiB:.2f} GiB, activations "
                f"{act / GiB:.2f} GiB, {slots} state slots and {snaps} prefix-cache snapshots; one max_model_len {max_model_len} sequence needs "
                f"{full}: lower max_model_len, max_num_seqs, max_num_batched_tokens or prefix_snapshots, or raise "
                "gpu_memory_utilization")
    return Capacity(num_blocks=blocks, block_size=block_size, num_slots=slots, max_model_len=max_model_len,
                    max_num_batched_tokens=max_num_batched_tokens, block_bytes=bb, slot_bytes=sb, num_snapshots=snaps,
                    cache_bytes=(blocks + 1) * bb + (slots + 1 + snaps) * sb, weights_bytes=weights,
                    activation_bytes=act, device_bytes=total, source=source)
