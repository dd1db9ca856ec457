"""The messages of one step between the engine and the executor, each defined once.

    StepPlan   what a step runs: per sequence its new tokens (or None: they are the last step's
               samples, still on the device), length, state slot, cached prefix and block table,
               plus the slots / blocks to zero first and the prefix cache's device work
               (`CacheOps`). A tensor-parallel driver sends it to every rank as int words
               (`to_words` / `from_words`: the one place it is packed).
    Launched   a step queued on the device, not read yet.
    StepResult a launched step read back: per sequence its sampled token (None: a chunk that
               does not reach the end of its tokens), its error text, its logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import alloc


@dataclass
class CacheOps:
    """The prefix cache's device work before one step, in this order: save slots into the
    snapshot pool (the state the steps before left there: a prompt's or a chunk's end, a request
    that ended -- before this step's zeroing may hand its slot on), then, after the zeroing,
    restore snapshots into slots and copy partial blocks, then the model."""
    saves: list = field(default_factory=list)          # (slot, snapshot)
    restores: list = field(default_factory=list)       # (snapshot, slot)
    copies: list = field(default_factory=list)         # (source block, destination block, rows)

    def __bool__(self) -> bool:
        return bool(self.saves or self.restores or self.copies)

    def to_words(self) -> list:
        words = [len(self.saves), len(self.restores), len(self.copies)]
        for pairs in (self.saves, self.restores, self.copies):
            for p in pairs:
                words += p
        return words

    @classmethod
    def from_words(cls, w: list) -> tuple[CacheOps, int]:
        """-> (ops, words read)."""
        counts, i = w[:3], 3
        lists = []
        for k, width in zip(counts, (2, 2, 3)):
            lists.append([tuple(w[i + j * width:i + (j + 1) * width]) for j in range(k)])
            i += k * width
        return cls(*lists), i


@dataclass
class StepPlan:
    lengths: list                   # new tokens per sequence
    slots: list                     # state slot per sequence
    starts: list                    # tokens already cached per sequence
    tables: list                    # cache block ids per sequence (covering starts + lengths)
    tokens: list | None = None      # all new token ids, packed; None: fed back on the device
    fresh_slots: list = field(default_factory=list)    # zero these before the step
    fresh_blocks: list = field(default_factory=list)
    cache_ops: CacheOps = field(default_factory=CacheOps)

    @property
    def decode(self) -> bool:
        return bool(self.lengths) and all(n == 1 for n in self.lengths)

    def to_words(self) -> list:
        """int words: [N, T, #fresh slots, #fresh blocks, tokens, lengths, slots, starts,
        table widths, tables, fresh slots, fresh blocks, cache ops] (tokens on the host)."""
        tables = self.tables
        words = [len(self.lengths), len(self.tokens), len(self.fresh_slots), len(self.fresh_blocks)]
        words += self.tokens
        words += self.lengths
        words += self.slots
        words += self.starts
        words += [len(t) for t in tables]
        for t in tables:
            words += t
        words += self.fresh_slots
        words += self.fresh_blocks
        words += self.cache_ops.to_words()
        return words

    @classmethod
    def from_words(cls, w: list) -> StepPlan:
        n, nt, nfs, nfb = w[:4]
        i = 4

        def take(k):
            nonlocal i
            i += k
            return list(w[i - k:i])
        tokens, lengths, slots, starts, widths = take(nt), take(n), take(n), take(n), take(n)
        tables = [take(k) for k in widths]
        fresh_slots, fresh_blocks = take(nfs), take(nfb)
        ops, _ = CacheOps.from_words(w[i:])
        return cls(lengths, slots, starts, tables, tokens, fresh_slots, fresh_blocks, ops)


class Launched(NamedTuple):
    """A queued step's outputs: sampled tokens on the device (-1 where the logits were not
    finite), the indices of the scheduled sequences that sampled, the logprobs handle (None
    unless a request asked) and the tokens' copy on its way to the host."""
    tokens: torch.Tensor | None
    rows: list
    logprobs: tuple | None
    host: alloc.Download | None


@dataclass
class StepResult:
    tokens: list                    # per sequence: the sampled token id, or None
    errors: list                    # per sequence: why its request failed (non-finite logits), or None
    logprobs: list                  # per sequence: its TokenLogprobs, or None

    @classmethod
    def empty(cls, n: int) -> StepResult:
        return cls([None] * n, [None] * n, [None] * n)
