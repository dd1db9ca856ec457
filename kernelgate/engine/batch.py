"""What one model step sees: a varlen batch of sequences, each bound to a state slot.

Tokens of all sequences are packed along dim 0 (`cu_seqlens`, int32 [N+1]); sequence i owns
slot `slots[i]` in the state pool and already has `starts[i]` tokens cached there (its
first new token sits at position `starts[i]`). `decode` means every sequence brings exactly
one token, which lets layers take their single-step kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepBatch:
    cu_seqlens: torch.Tensor       # int32 [N+1] on the model device
    slots: torch.Tensor            # int32 [N] on the model device
    starts: list                   # [N] python ints: tokens already cached per sequence
    lengths: list                  # [N] python ints: new tokens per sequence
    decode: bool

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def last_token_index(self) -> torch.Tensor:
        """Row of each sequence's last new token in the packed [T, ...] layout."""
        return (self.cu_seqlens[1:] - 1).long()

    @classmethod
    def build(cls, lengths: list, slots: list, starts: list, device) -> "StepBatch":
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return cls(cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
                   slots=torch.tensor(slots, dtype=torch.int32, device=device),
                   starts=list(starts), lengths=list(lengths),
                   decode=all(n == 1 for n in lengths))
