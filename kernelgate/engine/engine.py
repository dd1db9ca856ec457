"""The engine core: requests in, per-step outputs out. One loop drives it (kernelgate.serving:
`generate()`, `kernelgate run`, the warm-up, the async engine under `kernelgate serve`);
nothing else calls the model.

    engine = Engine(model, EngineConfig(max_num_seqs=16))     # or Engine(model, max_num_seqs=16)
    print(engine.capacity.report())    # tokens of cache, sequences, bytes
    engine.add_request("r0", prompt_ids, SamplingParams(...))
    while engine.has_unfinished():
        for out in engine.step():      # RequestOutput: the tokens each request gained this step
            ...

The scheduler (scheduler.py) picks the tokens of each step; the executor's runner
(kernelgate/executor, made by `make_runner`) runs them and samples; the block manager tracks
cache ownership.
"""
from __future__ import annotations

import contextlib
import gc
import logging

import torch

from ..config import EngineConfig
from ..errors import KernelgateError
from ..executor import make_runner
from .block_manager import BlockManager
from ..executor.sampling import make_generator
from .checks import check_prompt
from .outputs import RequestOutput, StepStats
from .params import SamplingParams
from .prefix_cache import PrefixCache
from .scheduler import Request, Scheduler

log = logging.getLogger("kernelgate.engine")


def _model_key(model) -> tuple:
    """What a prefix-cache snapshot records of the model it belongs to."""
    c = model.config
    return (type(model).__name__, id(model), hash(repr(sorted(vars(c).items(), key=lambda kv: kv[0]))))


def freeze_heap() -> None:
    """Collect, then move every object alive now (the model, its kernels' caches, the imported
    libraries: ~10^5-10^6 objects) out of the garbage collector's sight. A collection of the
    oldest generation otherwise walks all of them, a stall of a tenth of a second or more that
    lands in some step and holds every stream behind it. vLLM's engine core does the same after
    start-up. Objects that die later are still freed by reference counting;
    only reference cycles among them wait for `gc.unfreeze()` (Engine.close)."""
    gc.collect()
    gc.freeze()


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, *, runner=None, **settings):
        """config: the knobs (kernelgate.config.EngineConfig: vLLM's names and meanings); keyword
        settings override its fields (`Engine(model, max_num_seqs=64)`). The runner comes from the
        executor (`make_runner`): tensor_parallel_size > 1, or a model from
        load_model(..., tensor_parallel_size=N), runs sharded over N processes. `runner`: one
        already made for this model and config."""
        config = EngineConfig.of(config).replace(**settings) if settings else (config or EngineConfig())
        if not isinstance(config, EngineConfig):
            raise KernelgateError(f"engine: config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        self.runner = runner if runner is not None else make_runner(model, config)
        self.model = getattr(self.runner, "owner", self.runner.model)   # a sharded model: its driver's handle
        self.device = self.runner.model.device        # (a sharded model's handle may lose its ranks)
        self.max_num_seqs = config.max_num_seqs
        self.capacity = self.runner.capacity
        self.blocks = BlockManager(self.capacity.num_blocks, self.capacity.num_slots, config.block_size)
        self.prefix_cache = PrefixCache(self.blocks, self.capacity.num_snapshots, _model_key(self.model)) \
            if self.capacity.num_snapshots else None
        self.scheduler = Scheduler(self.blocks, config, prefix=self.prefix_cache)
        self.requests: dict[str, Request] = {}
        self._sent: dict[str, int] = {}
        self.last_step: StepStats | None = None     # the step this call launched (None: none)
        self.read_step: StepStats | None = None     # the step whose tokens this call read (with async
        #                                             scheduling, the one the previous call launched)
        self.async_scheduling = config.async_scheduling and self.runner.feeds_back
        self._pending = None                          # (SchedulerOutput, launched) queued, not read yet
        self._froze = self.device.type != "cpu"
        if self._froze:                               # (on a CPU an engine is often short-lived: tests)
            freeze_heap()
        log.info("kernelgate: %s", self.capacity.report())

    def add_request(self, request_id: str, prompt_ids, params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise KernelgateError(f"engine: request_id must be a non-empty str, got {request_id!r}")
        if request_id in self.requests:
            raise KernelgateError(f"engine: request id {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise KernelgateError(f"engine: params must be a SamplingParams, got {type(params).__name__}")
        prompt = check_prompt(prompt_ids, self.model.config.vocab_size, f"request {request_id!r}")
        cap = self.capacity
        need = len(prompt) + params.max_new_tokens
        if need > cap.max_model_len:
            raise KernelgateError(f"engine: request {request_id!r}: prompt ({len(prompt)}) + max_new_tokens "
                                  f"({params.max_new_tokens}) = {need} exceeds max_model_len {cap.max_model_len}")
        blocks = self.blocks.blocks_for(need)
        if blocks > cap.num_blocks:
            raise KernelgateError(f"engine: request {request_id!r} needs {blocks} cache blocks of {cap.block_size} "
                                  f"tokens ({need} tokens) but the cache holds {cap.num_blocks}: raise "
                                  "num_cache_blocks / gpu_memory_utilization or shorten the request")
        req = Request(request_id, prompt, params)
        req.generator = make_generator(params.seed, self.device)
        self.scheduler.add(req)
        self.requests[request_id] = req
        self._sent[request_id] = 0

    @contextlib.contextmanager
    def prefix_cache_off(self):
        """Run requests without the prefix cache (the warm-up: its made-up prompts share prefixes
        on purpose of their shapes, and must leave nothing cached)."""
        saved, self.scheduler.prefix = self.scheduler.prefix, None
        try:
            yield
        finally:
            self.scheduler.prefix = saved

    def abort(self, request_id: str) -> None:
        """Stop a request now and free what it holds; unknown or finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is None or req.done:
            return
        self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def cache_usage(self) -> float:
        """Share of the attention cache blocks that running requests hold, 0..1 (state slots when
        the model has no attention layer); blocks only the prefix cache keeps count as free, as
        vLLM counts them (they are evicted when a request needs them)."""
        b = self.blocks
        if b.num_blocks and self.capacity.block_bytes:
            return b.held_blocks / b.num_blocks
        return 1.0 - b.free_slots / b.num_slots

    def step(self) -> list[RequestOutput]:
        """Run one step; an output for every request that gained tokens or finished.

        With async scheduling (the default where the runner allows it) a step is queued on the
        device and read back during the next call: that call schedules and queues its own step
        first -- its decodes of the requests that just sampled fed their tokens on the device, its
        prompt chunks from the host (`_feed`) -- and only then waits for the previous one, so the
        host's work overlaps the device's, in mixed and prefill steps too. Outputs thus arrive one call late; a stop token is seen one step
        late (the extra step's writes go to the slot and blocks being freed, zeroed before reuse)."""
        pending, self._pending = self._pending, None
        self.read_step = None
        out = self.scheduler.schedule()
        if not out.seqs and pending is None and self.scheduler.waiting and not self.scheduler.running:
            raise KernelgateError("engine: internal: a waiting request cannot be scheduled on an idle engine")
        prev, wait = self._feed(pending, out) if pending is not None else (None, False)
        if wait:                                     # this step needs the previous tokens on the host
            self._resolve(pending)
            pending = None
            out.seqs = [s for s in out.seqs if not s.req.done]
        self.last_step = None
        if out.seqs:
            pre = sum(s.n for s in out.seqs if not (s.n == 1 and s.start > 0 and s.samples))
            dec = out.num_tokens - pre
            launched = self.runner.launch(out.seqs, self.blocks.take_fresh(), prev, self.scheduler.cache_ops())
            if pending is not None:
                self._resolve(pending)               # waits for the previous step only
            self.scheduler.advance(out)
            kind = "mixed" if pre and dec else ("prefill" if pre else "decode")
            self.last_step = StepStats(kind, out.num_tokens, len(out.seqs), pre, dec, len(out.preempted))
            if self.async_scheduling and launched.rows:
                self._pending = (out, launched, self.last_step)
            else:
                self.scheduler.resolve(out, self.runner.read(out.seqs, launched))
                self.read_step = self.last_step
        elif pending is not None:
            self._resolve(pending)
        outs = []
        for rid, req in list(self.requests.items()):
            sent = self._sent[rid]
            upto = len(req.output) if req.pending is None else req.pending
            finished = req.done and req.pending is None
            if upto > sent or finished:
                lps = req.logprobs[sent:upto] if req.params.logprobs is not None else None
                outs.append(RequestOutput(rid, req.output[sent:upto], finished, req.finish_reason if finished else None,
                                          len(req.prompt), upto, req.error if finished else None, lps,
                                          req.num_cached))
                self._sent[rid] = upto
            if finished:
                del self.requests[rid], self._sent[rid]
        return outs

    def _resolve(self, pending) -> None:
        out, launched, self.read_step = pending
        self.scheduler.resolve(out, self.runner.read(out.seqs, launched))

    @staticmethod
    def _feed(pending, out):
        """-> (prev, wait): how this step gets its inputs while the previous one is still queued.
        prev: (tokens, rows, tail) -- the leading sequences that are one-token decodes of a request
        whose input is the token that step sampled (its placeholder) take it from the previous
        step's device tokens (`rows`: the row of each, None where they are the first rows in
        order); the rest -- a mixed step's prompt chunks, whose tokens the host has -- are `tail`,
        the host token ids after them (None: none). prev None and no wait: no sequence needs a
        placeholder (a step of prompt chunks only), the host has every input. wait: a sequence
        after the tail needs a placeholder, or a tail sequence's request has one pending: the
        step waits for the previous one (as it would without async scheduling)."""
        p_out, (toks, rows, *_), _ = pending
        if not rows:
            return None, True
        row_of = {id(p_out.seqs[i].req): j for j, i in enumerate(rows)}
        idx, tail = [], []
        for k, s in enumerate(out.seqs):
            r = s.req
            j = row_of.get(id(r))
            if j is not None and s.n == 1 and r.pending is not None and s.start == len(r.prompt) + r.pending \
                    and len(idx) == k:
                idx.append(j)
            elif r.pending is None:
                tail += r.tokens(s.start, s.start + s.n)
            else:
                return None, True
        if not idx:
            return None, False
        tail = tail or None
        if idx == list(range(len(idx))):
            return ((toks if len(idx) == len(rows) else toks[:len(idx)]), None, tail), False
        return (toks, idx, tail), False

    def close(self) -> None:
        """Drop the cache and graphs now (device memory back to the allocator), not at the next
        garbage collection: a later engine sizes its cache from the memory left."""
        self.runner = None
        if getattr(self, "_froze", False):
            gc.unfreeze()         # what froze with this engine (its cache, graphs) can be collected again
        gc.collect()
        mod = getattr(torch, self.device.type, None)
        if self.device.type != "cpu" and hasattr(mod, "empty_cache"):
            mod.empty_cache()
