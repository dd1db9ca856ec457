"""The model runner: owns the cache, the decode graphs and sampling; runs one step.

The engine's scheduler decides which requests run and which of their tokens; the runner sizes
the cache (memory.py), zeroes what the block manager handed out since the last step, turns the
step's `StepPlan` into a `StepBatch`, calls the model (eagerly, or through a captured decode
graph) and samples the next token of each sequence whose chunk reached the end of its tokens.
It never decides who runs.
"""
from __future__ import annotations

import logging

import torch

from .. import alloc
from ..config import EngineConfig
from ..models.batch import StepBatch
from . import memory
from .graphs import DecodeGraphs, graph_api
from .plan import CacheOps, Launched, StepPlan, StepResult
from .sampling import logprobs_async, read_logprobs, sample_async

log = logging.getLogger("kernelgate.engine")


def padded_tokens(tokens: int, budget: int, largest: int | None = None) -> int:
    """The token count an eager (prefill / mixed) step of `tokens` tokens is padded to: the next
    multiple of 64 up to 1,024 tokens, of 256 up to 4,096, of 512 up to the budget, of 64 past
    it (decodes riding on top of a full chunk: `decode_tokens_in_budget` off), never past
    `largest` (the memory profile's step: the budget, or EngineConfig.max_step_tokens). A
    server's steps then come in a few dozen sizes, which the warm-up meets ahead of requests,
    instead of a new size nearly every step: each new size costs the GEMM library's choice of
    kernel per shape (host time per GEMM shape, some 20 per step) and, now and then, a kernel
    specialisation."""
    step = 64 if tokens <= 1024 or tokens > budget else 256 if tokens <= 4096 else 512
    padded = -(-tokens // step) * step
    if tokens <= budget:
        padded = min(padded, budget)
    return min(padded, max(tokens, largest or budget))


class ModelRunner:
    # Whether `launch` may take the previous step's sampled tokens on the device (a tensor-parallel
    # driver sends host token ids to its ranks, so it cannot).
    feeds_back = True

    def __init__(self, model, config: EngineConfig):
        """The cache gets one extra slot and one extra block beyond the capacity: the scratch
        that a captured decode graph's padding rows (and the memory profile) write into."""
        self.model, self.config = model, config
        api, self.graphs_reason = graph_api(model.device) if config.graphs else (None, "graphs=False")
        self.capacity = memory.plan(model, config, lambda: self._profile(config.max_step_tokens),
                                    api is not None)
        self._make_cache()
        # eager prefill / mixed steps padded to a few sizes (padded_tokens) by one more sequence
        # in the scratch slot and block; not on the CPU, where a shape costs nothing to meet
        self.pad_steps = model.device.type != "cpu"

    @property
    def alive(self) -> bool:
        """Whether steps can still run (a tensor-parallel runner's ranks may be gone)."""
        return self.cache is not None

    def _make_cache(self) -> None:
        cap = self.capacity
        self.cache = None
        self.cache = self.model.new_cache(cap.num_slots + 1, cap.num_blocks + 1, self.config.block_size,
                                          cap.num_snapshots)
        self.scratch = (cap.num_slots, cap.num_blocks)          # (slot, block) outside the manager's range
        api = graph_api(self.model.device)[0] if self.config.graphs else None
        self.graphs = self._new_graphs() if api is not None else None

    def _new_graphs(self) -> DecodeGraphs:
        return DecodeGraphs(self.model, self.cache, self.scratch, self.config.max_model_len)

    def _profile(self, tokens: int) -> int:
        """One prefill step of `tokens` tokens on a throw-away cache -> that cache's bytes."""
        nb = -(-tokens // self.config.block_size)
        cache = self.model.new_cache(1, nb, self.config.block_size)
        batch = StepBatch.build([tokens], [0], [0], self.model.device, [list(range(nb))], self.config.block_size)
        # distinct tokens: one repeated token would route every row to the same experts
        ids = torch.arange(tokens, device=self.model.device) * 7919 % self.model.config.vocab_size
        self.model.step(ids, batch, cache)
        size = cache.nbytes()
        del cache
        return size

    @torch.inference_mode()
    def launch(self, seqs: list, fresh: tuple, prev=None, cache_ops: CacheOps | None = None) -> Launched:
        """Queue one step without waiting for the device: seqs: [Scheduled]; fresh: (slots,
        blocks) to zero first; prev: None (the input tokens come from the requests), or the
        previous step's sampled tokens on the device, per leading seq the row holding its input
        token (None: the same rows) -- the step feeds them back unread -- and the host token ids
        of the seqs after them (a mixed step's prompt chunks; None: none); cache_ops: the prefix
        cache's saves, restores and copies around the step."""
        reqs = [s.req for s in seqs]
        plan = StepPlan([s.n for s in seqs], [r.slot for r in reqs], [s.start for s in seqs],
                        [list(r.blocks) for r in reqs], fresh_slots=list(fresh[0]), fresh_blocks=list(fresh[1]),
                        cache_ops=cache_ops or CacheOps())
        tokens = None
        if prev is None:
            plan.tokens = [t for s in seqs for t in s.req.tokens(s.start, s.start + s.n)]
        else:
            tokens, rows, tail = prev
            tokens = tokens.clamp(min=0)       # -1 (non-finite row): that request ends; its input must still be an id
            if rows is not None:
                tokens = tokens[alloc.upload(torch.tensor(rows, dtype=torch.long), tokens.device)]
            if tail is not None:               # a mixed step's prompt chunks after its fed decodes
                tokens = torch.cat([tokens, alloc.upload(torch.tensor(tail, dtype=tokens.dtype), tokens.device)])
        logits = self.run(plan, tokens)
        rows = [i for i, s in enumerate(seqs) if s.samples]
        if not rows:
            return Launched(None, rows, None, None)
        pick = logits if len(rows) == len(seqs) else logits[alloc.upload(torch.tensor(rows), logits.device)]
        params = [reqs[i].params for i in rows]
        toks = sample_async(pick, params, [reqs[i].generator for i in rows])
        lp = logprobs_async(pick, toks, params)                 # (None unless a request asked)
        if lp is not None:
            lp = (*lp[:2], alloc.Download(lp[2]))
        return Launched(toks, rows, lp, alloc.Download(toks))

    def read(self, seqs: list, launched: Launched) -> StepResult:
        """The tokens of a launched step, read back (waits for that step, not for any launched
        after it)."""
        rows, lp = launched.rows, launched.logprobs
        res = StepResult.empty(len(seqs))
        if not rows:
            return res
        toks = launched.host.tolist()
        for i, t, entry in zip(rows, toks, read_logprobs(lp, toks, [seqs[i].req.params for i in rows])):
            if t < 0:
                res.errors[i] = f"non-finite logits at position {seqs[i].start + seqs[i].n - 1}"
                log.error("kernelgate: request %s: %s; finished with an error", seqs[i].req.request_id,
                          res.errors[i])
            else:
                res.tokens[i], res.logprobs[i] = t, entry
        return res

    @torch.inference_mode()
    def run(self, plan: StepPlan, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One model step (what a tensor-parallel driver sends its ranks too): save snapshots of
        slots, zero the fresh slots / blocks, restore snapshots and copy partial blocks, decode
        through a graph or eagerly -> logits [N, V]. tokens: the input ids on the device,
        instead of plan.tokens."""
        ops = plan.cache_ops
        self.cache.save(ops.saves)
        self.cache.clear(plan.fresh_slots, plan.fresh_blocks)
        self.cache.restore(ops.restores)
        self.cache.copy_rows(ops.copies)
        slots, starts, tables = plan.slots, plan.starts, plan.tables
        if tokens is None:
            tokens = plan.tokens
        logits = None
        if plan.decode and self.graphs is not None:
            logits = self.graphs.run(tokens, slots, starts, tables)                  # None: decode eagerly
        if logits is None:
            device = self.model.device
            lengths, n = plan.lengths, len(plan.lengths)
            T = sum(lengths)
            pad = padded_tokens(T, self.config.max_num_batched_tokens, self.config.max_step_tokens) - T \
                if self.pad_steps and any(k > 1 for k in lengths) else 0
            if pad:   # one more sequence in the scratch slot, its positions all in the scratch block
                slot0, block0 = self.scratch
                lengths, slots, starts = lengths + [pad], slots + [slot0], starts + [0]
                tables = tables + [[block0] * -(-pad // self.config.block_size)]
                extra = [(7919 * i + 1) % self.model.config.vocab_size for i in range(pad)]   # varied experts
                tokens = tokens + extra if isinstance(tokens, list) else \
                    torch.cat([tokens, torch.tensor(extra, dtype=tokens.dtype).to(device)])
            batch = StepBatch.build(lengths, slots, starts, device, tables, self.config.block_size)
            d = batch.leading_decodes
            if self.graphs is not None and 0 < d < len(lengths):
                batch.decode_view = self.graphs.decode_view(starts[:d], tables[:d])
            if isinstance(tokens, list):
                tokens = alloc.upload(torch.tensor(tokens, dtype=torch.long), device)
            logits = self.model.step(tokens, batch, self.cache)[:n]                  # [N, V] fp32
        return logits
