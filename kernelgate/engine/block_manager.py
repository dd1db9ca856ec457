"""Who owns which cache block and state slot (host bookkeeping only; the tensors live in the
model's KVCache).

A sequence holds one state slot (KDA recurrent + conv states) and ceil(len / block_size)
blocks of MLA latents, allocated as it grows and returned when it ends or is preempted.
Everything handed out is remembered in `fresh_slots` / `fresh_blocks` until the model runner
zeroes it (before the step that first writes it), so a new owner never sees old data.
"""
from __future__ import annotations

from ..errors import KernelgateError


class BlockManager:
    def __init__(self, num_blocks: int, num_slots: int, block_size: int):
        self.num_blocks, self.num_slots, self.block_size = num_blocks, num_slots, block_size
        self._blocks = list(range(num_blocks - 1, -1, -1))   # pop() hands out block 0 first
        self._slots = list(range(num_slots - 1, -1, -1))
        self.fresh_slots: set[int] = set()      # handed out, not zeroed yet (a freed one leaves)
        self.fresh_blocks: set[int] = set()

    @property
    def free_blocks(self) -> int:
        return len(self._blocks)

    @property
    def free_slots(self) -> int:
        return len(self._slots)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow(self, blocks: list, tokens: int) -> bool:
        """Extend `blocks` (a sequence's list) to cover `tokens` positions; False (nothing
        taken) when there are not enough free blocks."""
        need = self.blocks_for(tokens) - len(blocks)
        if need <= 0:
            return True
        if need > len(self._blocks):
            return False
        new = [self._blocks.pop() for _ in range(need)]
        blocks.extend(new)
        self.fresh_blocks.update(new)
        return True

    def release(self, blocks: list) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise KernelgateError(f"block manager: block {b} is not in use")
        self._blocks.extend(reversed(blocks))
        self.fresh_blocks.difference_update(blocks)
        blocks.clear()

    def take_slot(self) -> int:
        if not self._slots:
            raise KernelgateError(f"block manager: all {self.num_slots} state slots are in use")
        slot = self._slots.pop()
        self.fresh_slots.add(slot)
        return slot

    def give_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._slots:
            raise KernelgateError(f"block manager: slot {slot} is not in use")
        self._slots.append(slot)
        self.fresh_slots.discard(slot)

    def take_fresh(self) -> tuple[list, list]:
        """(slots, blocks) handed out since the last call that are still owned: to be zeroed.
        (Cost: what was handed out, never the size of the cache: a step is not slower for a
        cache of a million blocks.)"""
        slots, blocks = sorted(self.fresh_slots), sorted(self.fresh_blocks)
        self.fresh_slots, self.fresh_blocks = set(), set()
        return slots, blocks
