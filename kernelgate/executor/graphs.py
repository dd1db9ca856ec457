"""Captured decode steps: one device graph per (batch bucket, context bucket), replayed.

A decode step launches a few hundred small kernels; at small batches the host's launch
work, not the device, sets the pace. Where torch exposes device graphs for the model's
device (`torch.<device>.graph`: CUDA and ROCm today), the engine captures the whole decode
step once per shape and replays it:

- batch bucket: the number of sequences rounded up to a power of two; the padding rows
  decode token 0 into a reserved scratch state slot and scratch cache block, so real slots
  and blocks are never touched by them;
- context bucket: the block table's width (how many cache positions attention may read)
  rounded up to a power of two >= 128 positions, capped at max_model_len; positions past a
  sequence's own length are never read, so the result does not depend on the bucket.

Inputs live in static device buffers, refreshed before each replay by one non-blocking
upload; the logits come back in a static buffer that the caller consumes before the next
replay. Block tables are not uploaded whole each step (at 128k context that is 2,048
entries a sequence, built and copied by the host every step): one device table, a row per
state slot, is kept by DecodeGraphs and only the entries that changed since the last step
are written (a sequence gains a block every block_size steps); the captured step gathers
its rows by slot. Entries past a sequence's own blocks are never read. Each shape is warmed up eagerly first (which also runs any autotuning), run once
more with host syncs turned into errors (an op that syncs every step, like the native
fused_experts' per-expert loop, cannot be captured), and then captured. If any of that
fails the engine says why once and decodes eagerly from then on; platforms without graphs
decode eagerly too.
"""
from __future__ import annotations

import warnings

import torch

from .. import alloc, envs
from ..registry import FallbackWarning, checked
from ..models.batch import StepBatch, padded_rows

MIN_CONTEXT = 128


def graph_api(device: torch.device):
    """(graph class, capture context, pool handle fn) for `device`, or a reason there are none."""
    if not envs.get("KERNELGATE_GRAPHS"):
        return None, "KERNELGATE_GRAPHS=0"
    mod = getattr(torch, device.type, None)
    cls = getattr(mod, "CUDAGraph", None) or getattr(mod, "XPUGraph", None)
    if device.type == "cpu" or cls is None or not hasattr(mod, "graph"):
        return None, f"torch has no device graphs for {device.type!r}"
    return (cls, mod.graph, mod.graph_pool_handle), None


def _without_host_syncs(device: torch.device, fn) -> None:
    """Run fn with the device's sync debug mode at "error" (where torch has one), so an op that
    waits for the device every step raises here, before any capture: a capture that fails
    half-way can leave the device's RNG in capture state."""
    set_mode = getattr(getattr(torch, device.type, None), "set_sync_debug_mode", None)
    if set_mode is None:
        fn()
        return
    set_mode("error")
    try:
        fn()
    finally:
        set_mode("default")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _Captured:
    def __init__(self, model, cache, nb: int, width: int, scratch: tuple, table: torch.Tensor, mempool, api):
        """table: DecodeGraphs' block table [slots, max_blocks] (a row per state slot)."""
        cls, capture, _ = api
        dev = model.device
        self.nb, self.width, self.scratch = nb, width, scratch
        self.bs = bs = cache.block_size
        self.tokens = torch.zeros(nb, dtype=torch.long, device=dev)
        # cu | slots | starts | seq_lens | slot_mapping, each part 16-byte aligned (alloc.pack)
        self.parts = [nb + 1, nb, nb, nb, nb]
        self.meta = torch.zeros(alloc.packed_size(self.parts, 4), dtype=torch.int32, device=dev)
        self.meta.copy_(self._host([], [], []))
        cu, slots, starts, lens, mapping = alloc.unpack(self.meta, self.parts)
        self.rows, self.table = slots, table[:, :width]
        self.batch = StepBatch(cu_seqlens=cu, slots=slots, starts=[0] * nb, lengths=[1] * nb, decode=True,
                               starts_dev=starts, context_len=width * bs, seq_lens=lens,
                               slot_mapping=mapping, block_size=bs)
        self.model, self.cache = model, cache
        # Checked mode's host reads of index values would sync (and the padding rows share one
        # scratch slot on purpose): a captured step runs no Python checks, so capture without them.
        with checked(False):
            self.run()                            # warm-up: lazy inits, autotuning, dispatch caches
            _without_host_syncs(dev, self.run)    # an op that syncs every step cannot be captured
            self.graph = cls()
            with capture(self.graph, pool=mempool):
                self.logits = self.run()

    def run(self) -> torch.Tensor:
        """The captured step (a method, not a stored closure: no reference cycle keeps the cache alive)."""
        self.batch.block_table = self.table.index_select(0, self.rows)          # [nb, width] by slot
        return self.model.step(self.tokens, self.batch, self.cache)

    def _host(self, slots: list, starts: list, tables: list) -> torch.Tensor:
        """Host metadata; padding rows decode into the scratch slot / block (position 0)."""
        nb = self.nb
        slot0, block0 = self.scratch
        pad = nb - len(slots)
        bs = self.bs
        mapping = [t[s // bs] * bs + s % bs for t, s in zip(tables, starts)] + [block0 * bs] * pad
        return alloc.pack([torch.tensor(v, dtype=torch.int32) for v in (
            list(range(nb + 1)), list(slots) + [slot0] * pad, list(starts) + [0] * pad,
            [s + 1 for s in starts] + [1] * pad, mapping)])

    def replay(self, tokens, slots: list, starts: list, tables: list) -> torch.Tensor:
        """tokens: host ids (a list) or ids already on the device (the last step's samples)."""
        n, pad = len(tokens), self.nb - len(tokens)
        if isinstance(tokens, torch.Tensor):
            self.tokens[:n].copy_(tokens)            # padding rows keep earlier (valid) ids
        else:
            host_tok = torch.tensor(tokens + [0] * pad, dtype=torch.long)
            self.tokens.copy_(alloc.upload(host_tok, self.tokens.device), non_blocking=True)
        self.meta.copy_(alloc.upload(self._host(slots, starts, tables), self.meta.device), non_blocking=True)
        with checked(False):   # a device graph replays no Python (a stand-in graph would re-run the checks)
            self.graph.replay()
        return self.logits[:n]


class DecodeGraphs:
    """Decode through captured graphs; `run` returns None where the caller must decode eagerly."""

    def __init__(self, model, cache, scratch: tuple, max_model_len: int):
        """scratch: (slot, block) reserved for the padding rows."""
        self.model, self.cache, self.scratch = model, cache, scratch
        self.max_blocks = -(-max_model_len // cache.block_size)
        self.api, self.reason = graph_api(model.device)
        self.mempool = self.api[2]() if self.api else None
        self.graphs: dict = {}
        # the block table of every state slot (the scratch slot's row: the scratch block), and
        # the host's copy of what each row holds, so a step writes only the entries that changed
        self.table = torch.full((cache.num_slots, self.max_blocks), scratch[1], dtype=torch.int32,
                                device=model.device) if self.api else None
        self.rows: dict = {}

    @property
    def enabled(self) -> bool:
        return self.api is not None

    def run(self, tokens, slots: list, starts: list, tables: list):
        if self.api is None:
            return None
        graph = self._get(_pow2(len(tokens)), max(MIN_CONTEXT, _pow2(max(starts) + 1)))
        if graph is None:
            return None
        self._update_table(slots, tables)
        return graph.replay(tokens, slots, starts, tables)

    def decode_view(self, starts: list, tables: list):
        """(block_table [P, W], seq_lens [P]) on the device for sequences that bring one token each
        at positions `starts`, padded with empty rows to the shape of the captured graph that would
        decode them; None where no such graph is captured."""
        graph = self.graphs.get((_pow2(len(starts)), self._context(starts)))
        if graph is None:
            return None
        nb, width = graph.nb, graph.width
        lens = torch.tensor([s + 1 for s in starts] + [0] * (nb - len(starts)), dtype=torch.int32)
        table, lens = alloc.upload_parts([padded_rows(tables, nb, width).view(-1), lens], self.table.device)
        return table.view(nb, width), lens

    def _context(self, starts: list) -> int:
        """The context bucket (positions, a multiple of the block size) of decodes at `starts`."""
        ctx = max(MIN_CONTEXT, _pow2(max(starts) + 1))
        return min(-(-ctx // self.cache.block_size), self.max_blocks) * self.cache.block_size

    def _update_table(self, slots: list, tables: list) -> None:
        """Write the entries of the slots' table rows that differ from what the device holds:
        a sequence's new blocks, or the whole row when the slot has a new owner (or its blocks
        were given back and taken again). One upload and one scatter, only if anything changed."""
        at, vals = [], []
        for slot, t in zip(slots, tables):
            t = t[:self.max_blocks]
            have = self.rows.get(slot)
            k = len(have) if have is not None and len(have) <= len(t) and t[:len(have)] == have else 0
            if k < len(t):
                at.extend(range(slot * self.max_blocks + k, slot * self.max_blocks + len(t)))
                vals.extend(t[k:])
                self.rows[slot] = list(t)
        if at:
            up = alloc.upload(torch.tensor(at + vals, dtype=torch.int32), self.table.device)
            self.table.view(-1).index_put_((up[:len(at)].long(),), up[len(at):])

    def prepare(self, max_batch: int) -> int:
        """Capture every (batch bucket, context bucket) up to max_batch sequences and the longest
        context now, not at first use (where a capture -- eager warm-up, sync check, capture --
        stalls the step that meets it, and every request in it); -> graphs captured."""
        nb = 1
        while self.api is not None:
            ctx = MIN_CONTEXT
            while self.api is not None:
                self._get(nb, ctx)
                if ctx >= self.max_blocks * self.cache.block_size:
                    break
                ctx *= 2
            if nb >= max_batch:
                break
            nb *= 2
        return len(self.graphs)

    def _get(self, nb: int, ctx: int):
        """The graph of nb sequences (a power of two) reading up to ctx positions, captured on first
        use; None (graphs now off, said once) if a capture fails."""
        width = min(-(-ctx // self.cache.block_size), self.max_blocks)
        key = (nb, width * self.cache.block_size)
        if key not in self.graphs:
            captured, why = None, None
            try:
                captured = _Captured(self.model, self.cache, nb, width, self.scratch, self.table, self.mempool, self.api)
            except Exception as e:  # noqa: BLE001 - report once, decode eagerly from now on
                why = f"capture failed ({type(e).__name__}: {str(e)[:160]})"
            why = self.agree(why)
            if why is not None:
                self.api, self.reason = None, why
                self.graphs.clear()
                warnings.warn(f"kernelgate: decode graphs off, eager decode: {self.reason}", FallbackWarning,
                              stacklevel=3)
                return None
            self.graphs[key] = captured
        return self.graphs[key]

    def agree(self, why: str | None) -> str | None:
        """Why not to use the graph just captured (None: use it). Tensor-parallel ranks override
        this (kernelgate.distributed.runner) so that all of them replay or all decode eagerly."""
        return why
