"""Continuous batching over a fixed pool of state slots.

Each `step()` either prefills newly admitted requests (one varlen batch: prompts packed,
`cu_seqlens` + slot indices) or, when none are waiting for a slot, decodes one token for
every running request (batched). Requests join whenever a slot is free and leave as soon
as they hit a stop token or their token budget; their slot is reused by the next one.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from .. import alloc
from ..platform import KernelgateError
from .batch import StepBatch
from .graphs import DecodeGraphs, graph_api
from .sampling import SamplingParams, make_generator, sample

_ids = itertools.count()


@dataclass
class Request:
    prompt: list
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    output: list = field(default_factory=list)
    finish_reason: str | None = None      # "stop" | "length"
    slot: int | None = None
    generator: object = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def cached(self) -> int:
        """Tokens whose state is in the pool (prompt + all outputs but the newest)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)


@dataclass
class StepStats:
    kind: str            # "prefill" | "decode"
    tokens: int          # tokens fed to the model
    seqs: int


class Scheduler:
    def __init__(self, model, max_slots: int = 16, max_len: int = 4096, max_prefill_tokens: int = 8192,
                 graphs: bool = True):
        """graphs: decode through captured device graphs where the platform has them
        (engine/graphs.py); the pool then keeps one extra slot as the padding rows' scratch."""
        self.model = model
        api, self.graphs_reason = graph_api(model.device) if graphs else (None, "graphs=False")
        self.pool = model.new_pool(max_slots + (api is not None), max_len)
        self.graphs = DecodeGraphs(model, self.pool, self.pool.reserve()) if api is not None else None
        self.max_len, self.max_prefill_tokens = max_len, max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> Request:
        if not req.prompt:
            raise KernelgateError(f"generate: request {req.id} has an empty prompt")
        need = len(req.prompt) + req.params.max_new_tokens
        if need > self.max_len:
            raise KernelgateError(f"generate: prompt ({len(req.prompt)}) + max_new_tokens "
                                  f"({req.params.max_new_tokens}) = {need} exceeds max_len {self.max_len}")
        vocab = self.model.config.vocab_size
        if min(req.prompt) < 0 or max(req.prompt) >= vocab:
            raise KernelgateError(f"generate: request {req.id} has token ids outside [0, {vocab})")
        self.waiting.append(req)
        return req

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> StepStats | None:
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting and self.pool.free_slots and (not admitted or len(self.waiting[0].prompt) <= budget):
            req = self.waiting.popleft()
            req.slot = self.pool.alloc()
            req.generator = make_generator(req.params.seed, self.model.device)
            budget -= len(req.prompt)
            admitted.append(req)
        if admitted:
            return self._run(admitted, [r.prompt for r in admitted], "prefill")
        if self.running:
            return self._run(list(self.running), [[r.output[-1]] for r in self.running], "decode")
        return None

    def _run(self, reqs: list, inputs: list, kind: str) -> StepStats:
        device = self.model.device
        starts = [0] * len(reqs) if kind == "prefill" else [r.cached for r in reqs]
        flat = [t for x in inputs for t in x]
        logits = None
        if kind == "decode" and self.graphs is not None:
            logits = self.graphs.run(flat, [r.slot for r in reqs], starts)  # None: decode eagerly
        if logits is None:
            batch = StepBatch.build([len(x) for x in inputs], [r.slot for r in reqs], starts, device)
            batch.decode = kind == "decode"
            tokens = alloc.upload(torch.tensor(flat, dtype=torch.long), device)
            logits = self.model.step(tokens, batch, self.pool)               # [N, V] fp32
        new = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        if kind == "prefill":
            self.running.extend(reqs)
        for r, tok in zip(reqs, new):
            r.output.append(tok)
            if tok in r.params.stop_token_ids:
                r.finish_reason = "stop"
            elif len(r.output) >= r.params.max_new_tokens:
                r.finish_reason = "length"
            if r.done:
                self.running.remove(r)
                self.pool.free(r.slot)
                r.slot = None
        return StepStats(kind, len(flat), len(reqs))
