"""Who owns which cache block and state slot (host bookkeeping only; the tensors live in the
model's KVCache).

A sequence holds one state slot (recurrent + conv states) and ceil(len / block_size) blocks of
attention cache, allocated as it grows and returned when it ends or is preempted. A block may
have several owners -- a running sequence and the prefix cache's snapshots that reuse it
(prefix_cache.py) -- so blocks are reference-counted: a block is free when its last owner lets
go. When a sequence needs blocks and none are free, `evict(n)` (the prefix cache's LRU) is
asked to let go of some.

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
        self._refs = [0] * num_blocks            # owners of each block
        self._held = [0] * num_blocks            # of which sequences (the rest: the prefix cache)
        self.held_blocks = 0                     # blocks some sequence holds
        self.fresh_slots: set[int] = set()      # handed out, not zeroed yet (a freed one leaves)
        self.fresh_blocks: set[int] = set()
        self.evict = None                       # evict(n) -> frees up to n blocks (the prefix cache)

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
        taken) when there are not enough free blocks, even after evicting cached ones."""
        need = self.blocks_for(tokens) - len(blocks)
        if need <= 0:
            return True
        if need > len(self._blocks) and self.evict is not None:
            self.evict(need - len(self._blocks))
        if need > len(self._blocks):
            return False
        new = [self._blocks.pop() for _ in range(need)]
        for b in new:
            self._refs[b] = self._held[b] = 1
        self.held_blocks += need
        blocks.extend(new)
        self.fresh_blocks.update(new)
        return True

    def share(self, blocks, cache: bool = False) -> None:
        """One more owner for each of `blocks` (blocks in use): a sequence, or the prefix cache."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._refs[b] == 0:
                raise KernelgateError(f"block manager: block {b} is not in use (cannot share it)")
        for b in blocks:
            self._refs[b] += 1
            if not cache:
                self._held[b] += 1
                self.held_blocks += self._held[b] == 1

    def release(self, blocks: list, cache: bool = False) -> None:
        """One owner fewer for each of `blocks` (the list is emptied); a block whose last owner
        let go is free."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._refs[b] == 0 or (not cache and self._held[b] == 0):
                raise KernelgateError(f"block manager: block {b} is not in use")
        for b in reversed(blocks):
            self._refs[b] -= 1
            if not cache:
                self._held[b] -= 1
                self.held_blocks -= self._held[b] == 0
            if self._refs[b] == 0:
                self._blocks.append(b)
                self.fresh_blocks.discard(b)
        blocks.clear()

    def refs(self, block: int) -> int:
        return self._refs[block]

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
