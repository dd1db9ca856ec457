"""What one model step sees: a varlen batch of sequences, each bound to a state slot.

Tokens of all sequences are packed along dim 0 (`cu_seqlens`, int32 [N+1]); sequence i owns
slot `slots[i]` in the state pool and already has `starts[i]` tokens cached there (its
first new token sits at position `starts[i]`). `decode` means every sequence brings exactly
one token, which lets layers take their single-step kernels. `context_len` bounds every
sequence's length after the step (attention reads that many cache positions; a captured
decode graph rounds it up). The metadata goes to the device in one non-blocking upload;
`cu_seqlens_cpu` / `slots_cpu` are the host copies, handed to ops as hints so that no op
needs a device->host copy (which would sync the stream).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import alloc


@dataclass
class StepBatch:
    cu_seqlens: torch.Tensor       # int32 [N+1] on the model device
    slots: torch.Tensor            # int32 [N] on the model device
    starts: list                   # [N] python ints: tokens already cached per sequence
    lengths: list                  # [N] python ints: new tokens per sequence
    decode: bool
    cu_seqlens_cpu: torch.Tensor | None = None   # int32 [N+1] on the CPU, same values
    slots_cpu: torch.Tensor | None = None        # int32 [N] on the CPU, same values
    starts_dev: torch.Tensor | None = None       # int32 [N] on the model device: `starts`
    context_len: int = 0                         # >= max(starts[i] + lengths[i])

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def last_token_index(self) -> torch.Tensor:
        """Row of each sequence's last new token in the packed [T, ...] layout."""
        return (self.cu_seqlens[1:] - 1).long()

    @classmethod
    def build(cls, lengths: list, slots: list, starts: list, device) -> "StepBatch":
        N = len(lengths)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        host = torch.tensor(cu + list(slots) + list(starts), dtype=torch.int32)
        cu_dev, slots_dev, starts_dev = alloc.upload(host, device).split([N + 1, N, N])
        cu_cpu, slots_cpu, _ = host.split([N + 1, N, N])
        return cls(cu_seqlens=cu_dev, slots=slots_dev, starts=list(starts), lengths=list(lengths),
                   decode=N > 0 and all(n == 1 for n in lengths), cu_seqlens_cpu=cu_cpu, slots_cpu=slots_cpu,
                   starts_dev=starts_dev, context_len=max((s + n for s, n in zip(starts, lengths)), default=0))
