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

from ..platform import KernelgateError
from .model_runner import ModelRunner
from .sampling import SamplingParams, make_generator

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
        self.model = model
        self.runner = ModelRunner(model, max_slots, max_len, graphs)
        self.pool, self.graphs = self.runner.pool, self.runner.graphs
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
        starts = [0] * len(reqs) if kind == "prefill" else [r.cached for r in reqs]
        new = self.runner.execute(reqs, inputs, starts, kind == "decode")
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
        return StepStats(kind, sum(len(x) for x in inputs), len(reqs))
