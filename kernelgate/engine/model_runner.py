"""The model runner: owns the cache, the decode graphs and sampling; runs one step.

The scheduler decides which requests run and which of their tokens; the runner sizes the
cache (engine/memory.py), zeroes what the block manager handed out since the last step,
turns the scheduled chunks into a `StepBatch`, calls the model (eagerly, or through a
captured decode graph) and samples the next token of each sequence whose chunk reached the
end of its tokens. It never decides who runs.
"""
from __future__ import annotations

import logging

import torch

from .. import alloc
from ..models.batch import StepBatch
from . import memory
from .graphs import DecodeGraphs, graph_api
from .sampling import sample, sampled_logprobs

log = logging.getLogger("kernelgate.engine")


class ModelRunner:
    def __init__(self, model, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 gpu_memory_utilization: float, block_size: int, num_cache_blocks: int | None, graphs: bool):
        """The cache gets one extra slot and one extra block beyond the capacity: the scratch
        that a captured decode graph's padding rows (and the memory profile) write into."""
        self.model = model
        self.block_size, self.max_model_len = block_size, max_model_len
        api, self.graphs_reason = graph_api(model.device) if graphs else (None, "graphs=False")
        self.capacity = memory.plan(model, max_num_seqs, max_model_len, max_num_batched_tokens,
                                    gpu_memory_utilization, block_size, num_cache_blocks,
                                    lambda: self._profile(max_num_batched_tokens), api is not None)
        cap = self.capacity
        self.cache = model.new_cache(cap.num_slots + 1, cap.num_blocks + 1, block_size)
        self.scratch = (cap.num_slots, cap.num_blocks)          # (slot, block) outside the manager's range
        self.graphs = DecodeGraphs(model, self.cache, self.scratch, max_model_len) if api is not None else None

    def _profile(self, tokens: int) -> int:
        """One prefill step of `tokens` tokens on a throw-away cache -> that cache's bytes."""
        nb = -(-tokens // self.block_size)
        cache = self.model.new_cache(1, nb, self.block_size)
        batch = StepBatch.build([tokens], [0], [0], self.model.device, [list(range(nb))], self.block_size)
        # distinct tokens: one repeated token would route every row to the same experts
        ids = torch.arange(tokens, device=self.model.device) * 7919 % self.model.config.vocab_size
        self.model.step(ids, batch, cache)
        size = cache.nbytes()
        del cache
        return size

    @torch.inference_mode()
    def execute(self, seqs: list, fresh: tuple) -> list:
        """seqs: [Scheduled]; fresh: (slots, blocks) to zero first. -> per seq: the sampled token,
        None (a chunk that does not reach the end of its tokens) or an error text."""
        reqs = [s.req for s in seqs]
        starts = [s.start for s in seqs]
        inputs = [s.req.tokens(s.start, s.start + s.n) for s in seqs]
        meta = {"fresh": fresh, "tokens": [t for x in inputs for t in x], "lengths": [s.n for s in seqs],
                "slots": [r.slot for r in reqs], "starts": starts, "tables": [list(r.blocks) for r in reqs]}
        logits = self.run(meta)
        rows = [i for i, s in enumerate(seqs) if s.samples]
        out: list = [None] * len(seqs)
        if rows:
            pick = logits if len(rows) == len(seqs) else logits[torch.tensor(rows, device=logits.device)]
            params = [reqs[i].params for i in rows]
            toks = sample(pick, params, [reqs[i].generator for i in rows])
            lps = sampled_logprobs(pick, toks, params)          # all None unless a request asked
            for i, t, lp in zip(rows, toks, lps):
                if t < 0:
                    out[i] = f"non-finite logits at position {seqs[i].start + seqs[i].n - 1}"
                    log.error("kernelgate: request %s: %s; finished with an error", reqs[i].request_id, out[i])
                else:
                    out[i] = t
                    if lp is not None:
                        reqs[i].logprobs.append(lp)             # one per output token, in order
        return out

    @torch.inference_mode()
    def run(self, meta: dict) -> torch.Tensor:
        """One model step from plain metadata (what a tensor-parallel driver broadcasts to its
        ranks): zero the fresh slots / blocks, decode through a graph or eagerly -> logits [N, V]."""
        self.cache.clear(*meta["fresh"])
        flat, slots, starts, tables = meta["tokens"], meta["slots"], meta["starts"], meta["tables"]
        logits = None
        if all(n == 1 for n in meta["lengths"]) and self.graphs is not None:
            logits = self.graphs.run(flat, slots, starts, tables)                    # None: decode eagerly
        if logits is None:
            device = self.model.device
            batch = StepBatch.build(meta["lengths"], slots, starts, device, tables, self.block_size)
            tokens = alloc.upload(torch.tensor(flat, dtype=torch.long), device)
            logits = self.model.step(tokens, batch, self.cache)                      # [N, V] fp32
        return logits
