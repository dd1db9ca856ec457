"""Many asyncio clients over one engine loop: the front end under `kernelgate serve`.

The model is not thread-safe, so exactly one loop (`core_loop.run_loop`) touches the
`Engine`: on a background thread of this process, or in an engine process of its own
(`core_process.EngineProcess`: the HTTP server's Python work then never holds the GIL the
engine's step needs). This front end sends it commands and handles its events:

    add_request / abort        -> AddRequest / Abort to the loop (messages.py)
    loop: adds and aborts, engine.step() -> Admitted and Outputs events
    events -> each RequestOutput to its request's asyncio.Queue (one call_soon_threadsafe
              per event loop per step); a client that fell behind reads the outputs queued
              for it as one (its tokens in order)

Clients call `await add_request(...)`, which returns once the engine admitted the request
(or raises why not), then iterate the returned stream. Leaving the iteration early (a client
disconnect cancels the task) aborts the request, which frees its slot and cache at the next
step boundary. A step that raises fails the requests it was running with finish_reason
"error" and the loop goes on; a loop (or engine process) that dies fails every request and
marks the engine dead. Requests not yet running are bounded: a group of requests
(`add_requests`: one HTTP request's prompts x n) that would take them past `max_queued` (as of
the latest step) raises `QueueFull` at once, whole.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from ..errors import KernelgateError
from ..engine.outputs import RequestOutput
from ..engine.params import SamplingParams
from .core_loop import ThreadCore
from .messages import Abort, AddRequest, Admitted, Dead, Exit, Failed, Outputs

log = logging.getLogger("kernelgate.engine")


class QueueFull(KernelgateError):
    """Too many requests waiting; the server answers 429."""


class EngineStopped(KernelgateError):
    """The engine is shutting down or its thread has died."""


class RequestRejected(KernelgateError):
    """The engine refused the request when adding it (an invalid request)."""


class Observer:
    """Metrics hooks, called on the engine thread (kernelgate.server.metrics implements them)."""

    def on_step(self, running: int, waiting: int, cache_usage: float, step=None) -> None:
        """step: (kind "prefill" | "decode" | "mixed", tokens, seconds) of the engine step, or None."""
    def on_first_token(self, seconds: float, prompt_tokens: int, cached_tokens: int = 0) -> None: ...
    def on_tokens(self, n: int, seconds_per_token: float) -> None: ...
    def on_finish(self, e2e_seconds: float, reason: str) -> None: ...


@dataclass
class _Tracked:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    admitted: asyncio.Future
    prompt_ids: list
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    last: float | None = None      # time of the latest token


class RequestStream:
    """Async iterator of a request's RequestOutputs; the last one has finished=True."""

    def __init__(self, owner: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self.owner, self.request_id, self.queue = owner, request_id, queue
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self.queue.get()
        except BaseException:        # cancelled: the client went away
            self.abort()
            raise
        while not out.finished and not self.queue.empty():   # the client fell behind: one output
            out = _merged(out, self.queue.get_nowait())       # for every step it missed
        self.finished = out.finished
        return out

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncEngine:
    """engine: an `Engine` (or anything with its interface), run on a thread of this process,
    or a started `core_process.EngineProcess` (the engine in a process of its own)."""

    def __init__(self, engine, max_queued: int = 1024, observer: Observer | None = None):
        self.core = engine if hasattr(engine, "send") else ThreadCore(engine)
        self.max_queued = max_queued
        self.observer = observer or Observer()
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._running = 0                      # requests running after the latest step
        self._stopping = False                 # no new requests
        self.dead: str | None = None           # why the engine loop stopped, if it did
        self._shutdown: asyncio.Future | None = None

    # ---- client side (any thread / event loop) ----
    def start(self) -> AsyncEngine:
        self.core.start(self._on_events)
        return self

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._tracked)

    async def add_request(self, request_id: str, prompt_ids: list, params: SamplingParams) -> RequestStream:
        """Queue a request; returns its output stream once the engine admitted it.
        Raises QueueFull, EngineStopped, or RequestRejected (with the engine's message)."""
        [stream] = await self.add_requests([(request_id, prompt_ids, params)])
        return stream

    async def add_requests(self, requests: list) -> list[RequestStream]:
        """Queue (request_id, prompt_ids, SamplingParams) requests together: all of them or none
        (the queue bound counts every one; a refusal or a cancel aborts the others); their
        streams once the engine admitted them all."""
        loop = asyncio.get_running_loop()
        new = [(rid, _Tracked(loop, asyncio.Queue(), loop.create_future(), list(ids), params))
               for rid, ids, params in requests]
        with self._lock:
            if self._stopping or self.dead:
                raise EngineStopped(f"engine: not accepting requests ({self.dead or 'shutting down'})")
            queued = len(self._tracked) - self._running
            if queued + len(new) > self.max_queued:
                raise QueueFull(f"engine: {max(queued, 0)} requests are already waiting for a slot and this one "
                                f"brings {len(new)} (at most {self.max_queued} wait); retry later")
            ids = [rid for rid, _ in new]
            clash = next((rid for rid in ids if rid in self._tracked), None)
            if clash is not None or len(set(ids)) != len(ids):
                raise RequestRejected(f"engine: request id {clash or ids[0]!r} is already running")
            for rid, t in new:
                self._tracked[rid] = t
            self.core.send_many([AddRequest(rid, t.prompt_ids, t.params) for rid, t in new])   # one step admits all
        if log.isEnabledFor(logging.DEBUG):        # with core_loop's step lines: a timeline of arrivals
            for rid, t in new:
                log.debug("kernelgate add: t=%.6f id=%s prompt=%d", t.arrival, rid, len(t.prompt_ids))
        try:
            await asyncio.gather(*(t.admitted for _, t in new))
        except BaseException:         # one refused, or the caller cancelled: none stays
            for rid, _ in new:
                self.abort(rid)
            raise
        return [RequestStream(self, rid, t.queue) for rid, t in new]

    def abort(self, request_id: str) -> None:
        """Stop a request (its stream gets no more outputs); unknown ids are ignored."""
        with self._lock:
            t = self._tracked.pop(request_id, None)
            if t is not None:
                self.core.send(Abort(request_id))
        if t is not None:
            self.observer.on_finish(time.perf_counter() - t.arrival, "abort")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop taking requests, let running ones finish for up to `timeout` s, abort the rest.
        A second call (the server's signal handler, then its lifespan end) waits for the first."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._shutdown_now(timeout))
        await asyncio.shield(self._shutdown)

    async def _shutdown_now(self, timeout: float) -> None:
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + timeout
        while self.num_unfinished and time.monotonic() < deadline and not self.dead:
            await asyncio.sleep(0.05)
        with self._lock:
            left = list(self._tracked)
        for rid in left:
            self._finish(rid, "abort", "server shutting down")
        self.core.send(Exit())
        await asyncio.to_thread(self.core.join, 5.0)

    # ---- the engine's events (on the core's thread) ----
    def _on_events(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, Outputs):
                self._outputs(ev.outputs, ev.running, ev.waiting, ev.cache_usage, ev.step)
            elif isinstance(ev, Admitted):
                self._admitted(ev.request_id, ev.error)
            elif isinstance(ev, Failed):
                for rid in ev.request_ids:
                    self._finish(rid, "error", ev.message)
            elif isinstance(ev, Dead):
                with self._lock:      # at once: no request is seen both open and on a dead engine
                    self.dead = ev.message
                    left, self._tracked = self._tracked, {}
                for rid, t in left.items():
                    self._end(rid, t, "error", ev.message)

    def _admitted(self, rid: str, error: str | None) -> None:
        with self._lock:
            t = self._tracked.get(rid) if error is None else self._tracked.pop(rid, None)
        if t is not None:
            t.loop.call_soon_threadsafe(_resolve, t.admitted, None if error is None else RequestRejected(error))

    def _outputs(self, outs: list, running: int, waiting: int, cache_usage: float, step=None) -> None:
        self._running = running
        # gauges before delivering: a client that saw a token sees its gauges
        self.observer.on_step(running, waiting, cache_usage, step)
        now = time.perf_counter()
        by_loop: dict = {}        # one wake-up per event loop per step, not one per request
        for out in outs:
            t = self._deliver(out, now)
            if t is not None:
                by_loop.setdefault(t.loop, []).append((t.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, out: RequestOutput, now: float) -> _Tracked | None:
        """Metrics for one output; its request (whose queue gets it), or None if aborted."""
        with self._lock:
            t = self._tracked.get(out.request_id)
            if t is None:              # aborted meanwhile: nobody listens
                return None
            if out.finished:
                del self._tracked[out.request_id]
        n = len(out.new_token_ids)
        if n:
            if t.last is None:
                self.observer.on_first_token(now - t.arrival, out.prompt_len, out.num_cached_tokens)
                if n > 1:
                    self.observer.on_tokens(n - 1, 0.0)
            else:
                self.observer.on_tokens(n, (now - t.last) / n)
            t.last = now
        if out.finished:
            if out.finish_reason == "error":
                log.error("kernelgate: request %s failed: %s", out.request_id, out.error)
            self.observer.on_finish(now - t.arrival, out.finish_reason or "error")
        return t

    def _finish(self, rid: str, reason: str, error: str | None) -> None:
        """End a tracked request from outside the engine's outputs (step failure, shutdown)."""
        with self._lock:
            t = self._tracked.pop(rid, None)
            if t is not None and reason == "abort":
                self.core.send(Abort(rid))
        if t is not None:
            self._end(rid, t, reason, error)

    def _end(self, rid: str, t: _Tracked, reason: str, error: str | None) -> None:
        self.observer.on_finish(time.perf_counter() - t.arrival, reason)
        out = RequestOutput(rid, [], True, reason, len(t.prompt_ids), 0, error=error)
        try:
            t.loop.call_soon_threadsafe(_resolve, t.admitted, None)
            t.loop.call_soon_threadsafe(t.queue.put_nowait, out)
        except RuntimeError:   # its event loop is closed: nobody listens
            pass


def _put_all(items: list) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (b is the later)."""
    lp = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, b.finished, b.finish_reason, b.prompt_len,
                         b.num_output_tokens, error=b.error, logprobs=lp,
                         num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens))


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
