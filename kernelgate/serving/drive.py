"""The one loop that drives an `Engine` to the end of a set of requests, and its timing.

`generate()`, `kernelgate run` and the warm-up all run through `drive`, so they count prefill
and decode the same way: a step that ran prompt tokens is a prefill step (its prompt tokens,
its seconds), any other step a decode step (its tokens, its seconds). A step's seconds are the
wall time of the `engine.step()` call that read it back (with async scheduling, the call after
the one that launched it: that call waits for it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.outputs import StepStats


@dataclass
class Timing:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: list = field(default_factory=list)    # (kind, tokens, seconds); kind "launch": a call that read nothing

    def add(self, stats: StepStats | None, seconds: float) -> None:
        if stats is None:
            self.steps.append(("launch", 0, seconds))
            return
        self.steps.append((stats.kind, stats.tokens, seconds))
        if stats.prefill_tokens:
            self.prefill_tokens += stats.prefill_tokens
            self.prefill_s += seconds
        else:
            self.decode_tokens += stats.tokens
            self.decode_s += seconds

    def rate(self, kind: str) -> float:
        tok, s = (self.prefill_tokens, self.prefill_s) if kind == "prefill" else (self.decode_tokens, self.decode_s)
        return tok / s if s > 0 else 0.0


@dataclass
class Finished:
    """One request's whole output."""
    token_ids: list
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_cached_tokens: int = 0
    logprobs: list | None = None


def drive(engine, requests, on_output=None, timing: Timing | None = None, progress=None) -> dict:
    """Add `requests` ((request_id, prompt_ids, SamplingParams) each) and step the engine until
    all of them have finished -> {request_id: Finished}. on_output(out) sees each of their
    outputs as it comes (it may `engine.abort` its request, and return more requests to add and
    drive to their end: a prompt that joins running decodes); progress(tokens so far) runs after
    every step. Other requests on a shared engine keep running; their outputs are not ours. If
    any request is refused, none of them stays in the engine."""
    ids: list = []
    got: dict = {}

    def add(reqs) -> None:
        for rid, _, _ in reqs:
            ids.append(rid)
            got[rid] = Finished([])
        try:
            for rid, prompt, params in reqs:
                engine.add_request(rid, prompt, params)
        except BaseException:
            for rid in ids:
                engine.abort(rid)
            raise
    add(requests)
    done: dict = {}
    tokens = 0
    try:
        while len(done) < len(ids):
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            for o in outs:
                f = got.get(o.request_id)
                if f is None or o.request_id in done:
                    continue
                f.token_ids.extend(o.new_token_ids)
                f.num_cached_tokens = max(f.num_cached_tokens, o.num_cached_tokens)
                if o.logprobs is not None:
                    f.logprobs = (f.logprobs or []) + o.logprobs
                tokens += len(o.new_token_ids)
                if on_output is not None:
                    more = on_output(o)
                    if more:
                        add(more)
                if o.finished:
                    f.finish_reason, f.error = o.finish_reason, o.error
                    done[o.request_id] = f
            if timing is not None:
                timing.add(engine.read_step, dt)
            if progress is not None:
                progress(tokens)
    except BaseException:
        for rid in ids:            # a shared engine keeps nothing of a call that failed or was interrupted
            if rid not in done:
                engine.abort(rid)
        raise
    return got
