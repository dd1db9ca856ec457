"""The messages of one step between the engine and the executor, each defined once.

    StepPlan   what a step runs: per sequence its new tokens (or None: they are the last step's
               samples, still on the device), length, state slot, cached prefix and block table,
               plus the slots / blocks to zero first. A tensor-parallel driver sends it to every
               rank as int words (`to_words` / `from_words`: the one place it is packed).
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
class StepPlan:
    lengths: list                   # new tokens per sequence
    slots: list                     # state slot per sequence
    starts: list                    # tokens already cached per sequence
    tables: list                    # cache block ids per sequence (covering starts + lengths)
    tokens: list | None = None      # all new token ids, packed; None: fed back on the device
    fresh_slots: list = field(default_factory=list)    # zero these before the step
    fresh_blocks: list = field(default_factory=list)

    @property
    def decode(self) -> bool:
        return bool(self.lengths) and all(n == 1 for n in self.lengths)

    def to_words(self) -> list:
        """int words: [N, T, #fresh slots, #fresh blocks, tokens, lengths, slots, starts,
        table widths, tables, fresh slots, fresh blocks] (tokens must be on the host)."""
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
        return cls(lengths, slots, starts, tables, tokens, take(nfs), take(nfb))


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
