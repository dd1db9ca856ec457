"""One engine, one thread, many asyncio clients: the loop under `kernelgate serve`.

The model is not thread-safe, so exactly one background thread touches the `Engine`:

    loop:  take new requests and aborts from the inbox (a lock-guarded list)
           -> engine.add_request / engine.abort
           -> engine.step()  (one batch over everything running)
           -> each RequestOutput to its request's asyncio.Queue (one call_soon_threadsafe
              per event loop per step); a client that fell behind reads the outputs queued
              for it as one (its tokens in order)

Clients call `await add_request(...)`, which returns once the engine thread admitted the
request (or raises why not), then iterate the returned stream. Leaving the iteration early
(a client disconnect cancels the task) aborts the request, which frees its slot and cache at
the next step boundary. A step that raises fails the requests it was running with
finish_reason "error" and the loop goes on. The inbox plus the engine's own waiting queue
are bounded: past `max_queued` requests not running (as of the latest step) a new request
raises `QueueFull` at once.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from ..platform import KernelgateError
from .engine import RequestOutput
from .sampling import SamplingParams

log = logging.getLogger("kernelgate.engine")


class QueueFull(KernelgateError):
    """Too many requests waiting; the server answers 503."""


class EngineStopped(KernelgateError):
    """The engine is shutting down or its thread has died."""


class RequestRejected(KernelgateError):
    """The engine refused the request when adding it (an invalid request)."""


class Observer:
    """Metrics hooks, called on the engine thread (kernelgate.server.metrics implements them)."""

    def on_step(self, running: int, waiting: int, cache_usage: float) -> None: ...
    def on_first_token(self, seconds: float, prompt_tokens: int) -> None: ...
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
    def __init__(self, engine, max_queued: int = 1024, observer: Observer | None = None):
        self.engine = engine
        self.max_queued = max_queued
        self.observer = observer or Observer()
        self._cv = threading.Condition()
        self._inbox: list[str] = []            # request ids to add, in arrival order
        self._aborts: list[str] = []
        self._tracked: dict[str, _Tracked] = {}
        self._running = 0                      # engine.num_running after the latest step
        self._stopping = False                 # no new requests
        self._exit = False                     # the thread aborts everything and returns
        self._thread: threading.Thread | None = None
        self.dead: str | None = None           # why the loop thread stopped, if it did

    # ---- client side (any thread / event loop) ----
    def start(self) -> AsyncEngine:
        self._thread = threading.Thread(target=self._run, name="kernelgate-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def num_unfinished(self) -> int:
        with self._cv:
            return len(self._tracked)

    async def add_request(self, request_id: str, prompt_ids: list, params: SamplingParams) -> RequestStream:
        """Queue a request; returns its output stream once the engine thread admitted it.
        Raises QueueFull, EngineStopped, or RequestRejected (with the engine's message)."""
        loop = asyncio.get_running_loop()
        t = _Tracked(loop, asyncio.Queue(), loop.create_future(), list(prompt_ids), params)
        with self._cv:
            if self._stopping or self.dead:
                raise EngineStopped(f"engine: not accepting requests ({self.dead or 'shutting down'})")
            if len(self._tracked) - self._running >= self.max_queued:
                raise QueueFull(f"engine: {self.max_queued} requests are already waiting; retry later")
            if request_id in self._tracked:
                raise RequestRejected(f"engine: request id {request_id!r} is already running")
            self._tracked[request_id] = t
            self._inbox.append(request_id)
            self._cv.notify()
        try:
            await t.admitted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, t.queue)

    def abort(self, request_id: str) -> None:
        """Stop a request (its stream gets no more outputs); unknown ids are ignored."""
        with self._cv:
            t = self._tracked.pop(request_id, None)
            if t is not None:
                self._aborts.append(request_id)
                self._cv.notify()
        if t is not None:
            self.observer.on_finish(time.perf_counter() - t.arrival, "abort")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop taking requests, let running ones finish for up to `timeout` s, abort the rest."""
        with self._cv:
            self._stopping = True
        deadline = time.monotonic() + timeout
        while self.num_unfinished and time.monotonic() < deadline and not self.dead:
            await asyncio.sleep(0.05)
        with self._cv:
            left = list(self._tracked)
        for rid in left:
            self._finish(rid, "abort", "server shutting down")
        with self._cv:
            self._exit = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    # ---- engine thread ----
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._aborts or self.engine.has_unfinished()
                               or self._exit):
                        self._cv.wait()
                    if self._exit:
                        ids, aborts = [], list(self._tracked) + self._aborts
                    else:
                        ids, aborts = self._inbox, self._aborts
                    self._inbox, self._aborts = [], []
                    adds = [(rid, self._tracked.get(rid)) for rid in ids]
                for rid in aborts:
                    self.engine.abort(rid)
                if self._exit:
                    return
                for rid, t in adds:
                    if t is not None:
                        self._admit(rid, t)
                if self.engine.has_unfinished():
                    self._step()
                else:                  # aborts freed everything: the gauges must say so
                    self._report()
        except BaseException as e:  # noqa: BLE001 - the loop must never die silently
            self.dead = f"engine loop died: {type(e).__name__}: {e}"
            log.exception("kernelgate: %s", self.dead)
            with self._cv:
                left = list(self._tracked)
            for rid in left:
                self._finish(rid, "error", self.dead)

    def _admit(self, rid: str, t: _Tracked) -> None:
        try:
            self.engine.add_request(rid, t.prompt_ids, t.params)
        except Exception as e:  # noqa: BLE001 - a bad request is the client's error, not the loop's
            with self._cv:
                self._tracked.pop(rid, None)
            msg = str(e) if isinstance(e, KernelgateError) else f"{type(e).__name__}: {e}"
            t.loop.call_soon_threadsafe(_resolve, t.admitted, RequestRejected(msg))
            return
        t.loop.call_soon_threadsafe(_resolve, t.admitted, None)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail what was running, keep serving
            msg = f"engine step failed: {type(e).__name__}: {e}"
            log.exception("kernelgate: %s", msg)
            with self._cv:
                victims = list(self._tracked)
            for rid in victims:
                self.engine.abort(rid)
                self._finish(rid, "error", msg)
            outs = []
        self._report()            # before delivering: a client that saw a token sees its gauges
        now = time.perf_counter()
        by_loop: dict = {}        # one wake-up per event loop per step, not one per request
        for out in outs:
            t = self._deliver(out, now)
            if t is not None:
                by_loop.setdefault(t.loop, []).append((t.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _report(self) -> None:
        self._running = self.engine.num_running
        self.observer.on_step(self._running, self.engine.num_waiting, self.engine.cache_usage)

    def _deliver(self, out: RequestOutput, now: float) -> _Tracked | None:
        """Metrics for one output; its request (whose queue gets it), or None if aborted."""
        with self._cv:
            t = self._tracked.get(out.request_id)
            if t is None:              # aborted meanwhile: nobody listens
                return None
            if out.finished:
                del self._tracked[out.request_id]
        n = len(out.new_token_ids)
        if n:
            if t.last is None:
                self.observer.on_first_token(now - t.arrival, out.prompt_len)
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
        with self._cv:
            t = self._tracked.pop(rid, None)
            if t is not None and reason == "abort":
                self._aborts.append(rid)
                self._cv.notify()
        if t is None:
            return
        self.observer.on_finish(time.perf_counter() - t.arrival, reason)
        out = RequestOutput(rid, [], True, reason, len(t.prompt_ids), 0, error=error)
        t.loop.call_soon_threadsafe(_resolve, t.admitted, None)
        t.loop.call_soon_threadsafe(t.queue.put_nowait, out)


def _put_all(items: list) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (b is the later)."""
    lp = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, b.finished, b.finish_reason, b.prompt_len,
                         b.num_output_tokens, error=b.error, logprobs=lp)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
