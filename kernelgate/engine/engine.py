"""The engine core: requests in, per-step outputs out. One loop drives it (`generate()`,
`kernelgate run`, the async engine under `kernelgate serve`); nothing else calls the model.

    engine = Engine(model, max_num_seqs=16)
    engine.add_request("r0", prompt_ids, SamplingParams(...))
    while engine.has_unfinished():
        for out in engine.step():      # RequestOutput: the tokens each request gained this step
            ...
"""
from __future__ import annotations

from dataclasses import dataclass

from ..platform import KernelgateError
from .sampling import SamplingParams
from .scheduler import Request, Scheduler


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list            # tokens this request gained in this step (may be empty)
    finished: bool
    finish_reason: str | None      # "stop" | "length" | "abort" | "error" once finished
    prompt_len: int
    num_output_tokens: int
    error: str | None = None       # why, when finish_reason == "error"


class Engine:
    def __init__(self, model, max_num_seqs: int = 16, max_model_len: int = 4096,
                 max_num_batched_tokens: int = 8192, gpu_memory_utilization: float = 0.9,
                 block_size: int = 64, num_cache_blocks: int | None = None, graphs: bool = True):
        """The knobs have vLLM's names and meanings: sequences in flight, longest prompt + output,
        tokens per step, share of device memory to use, MLA cache block size and a pinned count."""
        self.model = model
        self.scheduler = Scheduler(model, max_slots=max_num_seqs, max_len=max_model_len,
                                   max_prefill_tokens=max_num_batched_tokens, graphs=graphs)
        self.requests: dict[str, Request] = {}
        self._sent: dict[str, int] = {}
        self.last_step = None      # StepStats of the latest step (kind, tokens, seqs)

    def add_request(self, request_id: str, prompt_ids: list, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise KernelgateError(f"engine: request id {request_id!r} is already running")
        req = Request(list(prompt_ids), params)
        self.scheduler.add(req)
        self.requests[request_id] = req
        self._sent[request_id] = 0

    def abort(self, request_id: str) -> None:
        """Stop a request now and free what it holds; unknown or finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is None or req.done:
            return
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        if req in self.scheduler.running:
            self.scheduler.running.remove(req)
        if req.slot is not None:
            self.scheduler.pool.free(req.slot)
            req.slot = None
        req.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return not self.scheduler.idle

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def cache_usage(self) -> float:
        """Share of the cache (state slots / latent blocks) in use, 0..1."""
        pool = self.scheduler.pool
        return 1.0 - pool.free_slots / pool.num_slots

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; an output for every request that gained tokens or finished."""
        self.last_step = self.scheduler.step()
        outs = []
        for rid, req in list(self.requests.items()):
            sent = self._sent[rid]
            if len(req.output) > sent or req.done:
                outs.append(RequestOutput(rid, req.output[sent:], req.done, req.finish_reason,
                                          len(req.prompt), len(req.output)))
                self._sent[rid] = len(req.output)
            if req.done:
                del self.requests[rid], self._sent[rid]
        return outs
