"""What one model step sees: a varlen batch of sequences, each bound to a state slot and to
the cache blocks that hold its MLA latents.

Tokens of all sequences are packed along dim 0 (`cu_seqlens`, int32 [N+1]); sequence i owns
KDA / conv state slot `slots[i]` and already has `starts[i]` tokens cached (its first new
token sits at position `starts[i]`, `seq_lens[i] = starts[i] + lengths[i]`). Its latents live
in the paged cache: position p at `cache[block_table[i, p // block_size], p % block_size]`;
`slot_mapping[t]` is the flat cache row (`block * block_size + offset`) new token t writes.
`decode` means every sequence brings exactly one token, which lets layers take their
single-step kernels. The metadata goes to the device in one non-blocking upload; the `_cpu`
fields are host copies, handed to ops as hints so that no op needs a device->host copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from .. import alloc


def padded_rows(tables: list, rows: int, width: int) -> torch.Tensor:
    """int32 [rows, width] on the CPU: row i holds the first `width` entries of tables[i], zeros
    after them and in the rows past len(tables). Built from the entries alone (a server's step
    holds a few 32k-token sequences among many short ones: padding every row in Python cost
    milliseconds a step)."""
    lens = [min(len(t), width) for t in tables]
    out = torch.zeros(rows * width, dtype=torch.int32)
    total = sum(lens)
    if total:
        flat = torch.tensor(list(chain.from_iterable(t if len(t) <= width else t[:width] for t in tables)),
                            dtype=torch.int32)
        n = torch.tensor(lens)
        row = torch.repeat_interleave(torch.arange(len(tables)), n)
        col = torch.arange(total) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        out[row * width + col] = flat
    return out.view(rows, width)


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
    seq_lens: torch.Tensor | None = None         # int32 [N] on the device: starts + lengths
    seq_lens_cpu: torch.Tensor | None = None     # int32 [N] on the CPU
    block_table: torch.Tensor | None = None      # int32 [N, max_blocks] on the device
    slot_mapping: torch.Tensor | None = None     # int32 [T] on the device: flat cache row per new token
    block_size: int = 0
    # a mixed step's leading single-token sequences (its decodes): (block_table [P, W], seq_lens
    # [P]) padded with empty rows (length 0) to a captured decode graph's shape, so the kernels
    # that attend for them meet shapes compiled at capture (None: their rows of the batch's own)
    decode_view: tuple | None = None
    _parts: dict = field(default_factory=dict, repr=False)

    def prefill_part(self, d: int) -> tuple:
        """(cu_seqlens, slots, cu_seqlens_cpu, slots_cpu) of sequences d.. as a batch of their own: a
        mixed step's prefill part after its d leading decodes. Made once per step; the device tensors
        are fresh ones (a view at an odd offset would give kernels a misaligned pointer: a compile
        variant of its own)."""
        if d == 0:
            return self.cu_seqlens, self.slots, self.cu_seqlens_cpu, self.slots_cpu
        if d not in self._parts:
            cpu = self.cu_seqlens_cpu
            self._parts[d] = (self.cu_seqlens[d:] - d, self.slots[d:].clone(),
                              None if cpu is None else cpu[d:] - d,
                              None if self.slots_cpu is None else self.slots_cpu[d:].clone())
        return self._parts[d]

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def leading_decodes(self) -> int:
        """How many sequences at the front bring one token each (the scheduler puts a mixed step's
        decodes first)."""
        d = 0
        for n in self.lengths:
            if n != 1:
                break
            d += 1
        return d

    @property
    def last_token_index(self) -> torch.Tensor:
        """Row of each sequence's last new token in the packed [T, ...] layout."""
        return (self.cu_seqlens[1:] - 1).long()

    @classmethod
    def build(cls, lengths: list, slots: list, starts: list, device, block_tables: list | None = None,
              block_size: int = 0) -> "StepBatch":
        """block_tables: per sequence, the list of its cache blocks (covering starts + lengths)."""
        N = len(lengths)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        seq_lens = [s + n for s, n in zip(starts, lengths)]
        tables = block_tables or [[] for _ in range(N)]
        width = max((len(t) for t in tables), default=0)
        table = padded_rows(tables, N, width).view(-1)
        T = cu[-1]
        if block_tables is not None and T:
            for t, s, n in zip(tables, seq_lens, lengths):
                if n and -(-s // block_size) > len(t):
                    raise ValueError(f"StepBatch: a block table of {len(t)} blocks of {block_size} does not cover "
                                     f"{s} positions")
            # the cache row of every new token: its sequence's block at position p // block_size
            n = torch.tensor(lengths)
            seq = torch.repeat_interleave(torch.arange(N), n, output_size=T)
            pos = torch.tensor(starts)[seq] + torch.arange(T) - torch.tensor(cu[:-1])[seq]
            mapping = (table[seq * width + pos // block_size] * block_size + pos % block_size).to(torch.int32)
        else:
            mapping = torch.zeros(0, dtype=torch.int32)
        i32 = torch.int32
        host = [torch.tensor(cu, dtype=i32), torch.tensor(list(slots), dtype=i32), torch.tensor(list(starts), dtype=i32),
                torch.tensor(seq_lens, dtype=i32), table, mapping]
        cu_d, slots_d, starts_d, lens_d, table_d, map_d = alloc.upload_parts(host, device)   # one copy, aligned parts
        cu_c, slots_c, _, lens_c, _, _ = host
        return cls(cu_seqlens=cu_d, slots=slots_d, starts=list(starts), lengths=list(lengths),
                   decode=N > 0 and all(n == 1 for n in lengths), cu_seqlens_cpu=cu_c, slots_cpu=slots_c,
                   starts_dev=starts_d, context_len=max(seq_lens, default=0), seq_lens=lens_d,
                   seq_lens_cpu=lens_c, block_table=table_d.view(N, width), slot_mapping=map_d,
                   block_size=block_size)
