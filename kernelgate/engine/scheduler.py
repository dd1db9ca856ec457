"""Continuous batching with a token budget per step, chunked prefill and preemption.

Every request is a token list (prompt, then its outputs) of which `num_computed` are in the
cache. Each step first gives every decoding request its one token, then each running prompt,
oldest first, the rest of its tokens (or a chunk of them) until the step's budget
(`max_num_batched_tokens`) is spent. By default the decodes ride on top of the budget (SGLang's
mixed chunks): a long prompt's chunk beside running streams keeps the budget's length, the
length attention is planned for, and the prompt needs as many steps as alone; with
`decode_tokens_in_budget` on, a chunk takes what the decodes leave (vLLM's policy) -- then waiting
requests join while the budget, a state slot and enough cache blocks for their first chunk are
there. A long prompt is thus
prefilled over several steps, each chunk attending to its cached prefix, side by side with
the other requests' decodes. A request whose chunk reaches the end of its tokens samples one.

Admission delay (`delay_factor`, vLLM's scheduler_delay_factor): while requests are running, a
step that admits new prompts runs eagerly (it is no decode graph) and costs about the same host
time whether it admits one prompt or twenty. So with a factor f > 0 the waiting queue is admitted
only once its oldest request has waited f x the duration of the last step that admitted prompts
(or when nothing runs): prompts arriving over a few steps join one step instead of one each.

When a running request needs a block and none is free, the newest running request is
preempted: its blocks and slot are freed, and it waits at the head of the queue to be
recomputed from its prompt + outputs (its sampling generator keeps its state, so its tokens
are those of an uninterrupted run). Nothing is lost; the oldest request always progresses.

Prefix caching (prefix_cache.py): a request that joins starts where the longest cached
snapshot of its tokens ends (its state restored, the attention blocks shared) and prefills only
the rest; its prefill chunks also end where snapshots are wanted (the point where its tokens
leave the cached ones, a few blocks before a long prompt's end), and each chunk end within the
prompt, and the request's end, is snapshot.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..executor.plan import CacheOps, StepResult
from .block_manager import BlockManager
from .params import SamplingParams
from .prefix_cache import PrefixCache, snapshot_points

_order = itertools.count()


@dataclass
class Request:
    request_id: str
    prompt: list
    params: SamplingParams
    output: list = field(default_factory=list)
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    error: str | None = None
    slot: int | None = None
    blocks: list = field(default_factory=list)
    num_computed: int = 0                 # tokens whose state / latents are in the cache
    generator: object = None
    num_preemptions: int = 0
    order: int = field(default_factory=lambda: next(_order))
    pending: int | None = None            # index in `output` of a token sampled but not read yet
    logprobs: list = field(default_factory=list)   # TokenLogprobs per output token, if params.logprobs is set
    arrived: float = 0.0                  # when it joined the waiting queue (the scheduler's clock)
    num_cached: int = 0                   # prompt tokens restored from the prefix cache when it was admitted
    block_hashes: list = field(default_factory=list)   # chained hashes of its full blocks (prefix cache)
    snap_at: list = field(default_factory=list)        # positions where a prefill chunk must end (snapshots)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def known_tokens(self) -> int:
        """Tokens whose ids the host has (a sampled token not read yet is not)."""
        return self.num_tokens if self.pending is None else len(self.prompt) + self.pending

    def tokens(self, a: int, b: int) -> list:
        """Token ids at positions a..b-1 of prompt + output."""
        P = len(self.prompt)
        if b <= P:
            return self.prompt[a:b]
        return self.prompt[a:P] + self.output[max(a - P, 0):b - P]


@dataclass
class Scheduled:
    req: Request
    start: int            # position of the first token fed this step (= tokens already cached)
    n: int                # tokens fed this step
    samples: bool = field(init=False)   # the chunk reaches the end of the request's tokens: it samples one

    def __post_init__(self):
        self.samples = self.start + self.n == self.req.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list                                        # [Scheduled], running order
    preempted: list = field(default_factory=list)     # requests sent back to the queue this step

    @property
    def num_tokens(self) -> int:
        return sum(s.n for s in self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, config: EngineConfig, clock=time.monotonic,
                 prefix: PrefixCache | None = None):
        self.blocks, self.prefix = blocks, prefix
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.decode_tokens_in_budget = config.decode_tokens_in_budget
        self.max_model_len = config.max_model_len
        delay_factor = config.scheduler_delay_factor
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # admission order: newest last
        self.delay_factor, self.clock = delay_factor, clock
        self.admit_seconds = 0.0                  # duration of the last step that admitted prompts
        self._last_schedule: float | None = None
        self._admitted = False                    # the last schedule() admitted prompts

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, req: Request) -> None:
        req.arrived = self.clock()
        self.waiting.append(req)

    def _may_admit(self, now: float) -> bool:
        """Whether waiting requests may join this step (the admission delay, module docstring)."""
        if self.delay_factor <= 0 or not self.running or not self.waiting:
            return True
        return now - self.waiting[0].arrived >= self.delay_factor * self.admit_seconds

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        if self._admitted and self._last_schedule is not None:   # that step ran from then to now
            self.admit_seconds = now - self._last_schedule
        self._last_schedule, self._admitted = now, False
        if self.prefix is not None:
            self.prefix.settle()          # snapshots of the requests that ended, before their slots move on
        out = SchedulerOutput([])
        budget = self.max_num_batched_tokens
        # decodes first (one token each: a long prompt's chunks never stall the others' streams),
        # then the running prompts' next chunks, oldest first, in what the budget leaves
        decodes = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        chunks = [r for r in self.running if r.num_tokens - r.num_computed != 1]
        ride = not self.decode_tokens_in_budget     # decodes on top of the budget (config)
        decode_ids = {id(r) for r in decodes}
        for k, req in enumerate(decodes + chunks):
            decode = k < len(decodes)
            if budget <= 0 and not (ride and decode):
                break
            if req.slot is None:          # preempted in this step
                continue
            n = 1 if decode else self._chunk(req, req.num_computed, budget)
            while not self.blocks.grow(req.blocks, req.num_computed + n):
                victim = self.running[-1]         # the newest: it may already be in this step
                for j, sch in enumerate(out.seqs):
                    if sch.req is victim:
                        gone = out.seqs.pop(j)
                        if not (ride and id(gone.req) in decode_ids):
                            budget += gone.n
                        break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.slot is None:
                continue
            out.seqs.append(Scheduled(req, req.num_computed, n))
            if not (ride and decode):
                budget -= n
        admit = self._may_admit(now)
        while admit and self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs \
                and self.blocks.free_slots:
            req = self.waiting[0]
            hit = self.prefix.lookup(req) if self.prefix is not None else None
            snap = hit.snapshot if hit is not None else None
            start = snap.length if snap is not None else 0
            if snap is not None:
                self.prefix.attach(req, snap)      # its full blocks shared, pinned for this step
            if self.prefix is not None:
                req.snap_at = snapshot_points(len(req.prompt), start, hit.diverge, self.blocks.block_size)
            n = self._chunk(req, start, budget)
            ok = self.blocks.grow(req.blocks, start + n)
            if not ok and snap is not None:
                self.blocks.release(req.blocks)   # the restore needs a block more (its partial block's copy):
                snap.pinned = False               # without it, as if nothing were cached
                snap, start = None, 0
                req.snap_at = snapshot_points(len(req.prompt), 0, hit.diverge, self.blocks.block_size)
                n = self._chunk(req, 0, budget)
                ok = self.blocks.grow(req.blocks, n)
            if not ok:
                self.blocks.release(req.blocks)
                break                      # waits for blocks
            self.waiting.popleft()
            req.slot = self.blocks.take_slot()
            if snap is not None:
                self.prefix.restore(req, snap)
            if self.prefix is not None and req.num_preemptions == 0:
                req.num_cached = start
                self.prefix.queries += req.known_tokens
                self.prefix.hits += start
            self.running.append(req)
            out.seqs.append(Scheduled(req, start, n))
            budget -= n
            self._admitted = True
        return out

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """Tokens of `req` from `start` this step: the rest, within the budget, up to the next
        position where a snapshot is wanted."""
        n = min(req.num_tokens - start, budget)
        for p in req.snap_at:
            if p > start:
                return min(n, p - start)
        return n

    def cache_ops(self) -> CacheOps | None:
        """The prefix cache's device work for the step about to launch."""
        return self.prefix.take_ops() if self.prefix is not None else None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.snap_at = []
        req.num_preemptions += 1
        self.waiting.appendleft(req)      # victims go newest first: the oldest ends up in front

    def _release(self, req: Request) -> None:
        self.blocks.release(req.blocks)
        if req.slot is not None:
            self.blocks.give_slot(req.slot)
            req.slot = None

    def advance(self, out: SchedulerOutput) -> None:
        """The step `out` has been launched: its tokens are in the cache, and each sequence that
        samples holds a placeholder for its token (read later by `resolve`). The next step can be
        scheduled now, before the device has produced the token. A request that reaches
        max_new_tokens / max_model_len with this token finishes now ("length"), so no step
        runs past it; only its placeholder remains to be filled."""
        for s in out.seqs:
            req = s.req
            if req.done:                   # aborted or stopped while the step was queued
                continue
            req.num_computed = s.start + s.n
            if self.prefix is not None and req.num_computed <= len(req.prompt):
                self.prefix.take(req, req.num_computed)      # a chunk's or the prompt's end
            if not s.samples:
                continue
            req.pending = len(req.output)
            req.output.append(None)
            if len(req.output) >= req.params.max_new_tokens or req.num_tokens >= self.max_model_len:
                self.finish(req, "length")

    def resolve(self, out: SchedulerOutput, result: StepResult) -> None:
        """Fill the placeholders of the launched step `out` with their tokens (or end the
        request with its error); a stop token ends the request, and drops the placeholder
        of a later step already launched for it."""
        for k, s in enumerate(out.seqs):
            req = s.req
            if not s.samples or req.pending != s.start + s.n - len(req.prompt):
                continue                   # aborted / stopped earlier: its placeholder is gone
            i, req.pending = req.pending, None
            if result.errors[k] is not None:
                del req.output[i:]
                self._end(req, "error", result.errors[k])
                continue
            tok = result.tokens[k]
            req.output[i] = tok
            if result.logprobs[k] is not None:
                req.logprobs.append(result.logprobs[k])   # one per output token, in order
            if tok in req.params.stop_token_ids:
                self._end(req, "stop")

    def _end(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.done:                       # finished by length at this very token: stop / error win
            req.finish_reason, req.error = reason, error
        else:
            self.finish(req, reason, error)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End `req` now (any state) and free what it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.prefix is not None and reason != "error":
            self.prefix.defer(req, req.num_computed)          # turn N+1 resumes where turn N ended
        self._release(req)
        req.finish_reason, req.error = reason, error
        if reason != "length" and req.pending is not None:   # a token that will never be read
            del req.output[req.pending:]
            req.pending = None
