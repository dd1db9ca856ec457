"""Engine streams -> OpenAI responses: whole bodies, or SSE chunks (`data: {...}\\n\\n`, then
`data: [DONE]\\n\\n`), for /v1/completions and /v1/chat/completions alike.

One engine output becomes one chunk (its text may be "" while the detokenizer holds back a
partial character or a possible stop string), so a client sees every token's arrival time;
a chunk's logprobs are those of its tokens. A stop string ends the request early: leaving
the engine stream aborts it.

A request that fails in the engine (finish_reason "error": non-finite logits, a step that
raised) never shows that finish_reason: as vLLM does, a whole response becomes 500 with an
OpenAI error body, and a stream ends with an error event (`data: {"error": {..., "code":
500}}`, then `data: [DONE]`) instead of its last chunk; the other choices of the request
are aborted.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

from ..serving.async_engine import RequestStream
from ..text.detokenizer import Detokenizer
from .jobs import Job
from .logprobs import LogprobsFormatter
from .protocol import APIError


@dataclass
class Delta:
    text: str
    token_ids: list
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list | None = None       # TokenLogprobs of token_ids, when asked for
    cached: int = 0                    # prompt tokens served from the prefix cache


@dataclass
class Choice:
    """One job's whole output (non-streaming)."""
    text: str
    token_ids: list
    finish_reason: str
    logprobs: list | None = None
    cached: int = 0


async def deltas(stream: RequestStream, detok: Detokenizer):
    """A request's text deltas; the last one has a finish_reason."""
    try:
        async for out in stream:
            text = detok.update(out.new_token_ids)
            if detok.stopped is not None:
                yield Delta(text, out.new_token_ids, "stop", logprobs=out.logprobs, cached=out.num_cached_tokens)
                return
            if out.finished:
                text += detok.finish()
                yield Delta(text, out.new_token_ids, out.finish_reason or "error", out.error, out.logprobs,
                            out.num_cached_tokens)
                return
            yield Delta(text, out.new_token_ids, logprobs=out.logprobs, cached=out.num_cached_tokens)
    finally:
        stream.abort()      # no-op when finished; otherwise frees the slot now


async def merged(gens: list):
    """(index, Delta) from several requests in arrival order."""
    if len(gens) == 1:
        try:
            async for d in gens[0]:
                yield 0, d
        finally:
            await gens[0].aclose()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, g):
        try:
            async for d in g:
                await q.put((i, d))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, d = await q.get()
            if d is None:
                left -= 1
            else:
                yield i, d
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            await g.aclose()


class Responder:
    """Shapes deltas into one endpoint's OpenAI objects."""

    def __init__(self, chat: bool, model: str, jobs: list[Job], return_token_ids: bool, echo: bool,
                 include_usage: bool, logprobs: LogprobsFormatter | None = None):
        self.chat, self.model, self.jobs = chat, model, jobs
        self.logprobs = logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns():x}{id(self) & 0xffff:04x}"
        self.created = int(time.time())
        self.return_token_ids, self.echo, self.include_usage = return_token_ids, echo, include_usage
        self.completion_tokens = 0
        self.cached = [0] * len(jobs)          # per job: prompt tokens its engine request found cached

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        """OpenAI's usage; a prompt of n choices counts once (its first choice's cached tokens)."""
        p = sum(len(j.prompt_ids) for j in self.jobs if j.counts_prompt)
        cached = sum(c for c, j in zip(self.cached, self.jobs) if j.counts_prompt)
        return {"prompt_tokens": p, "completion_tokens": self.completion_tokens,
                "total_tokens": p + self.completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}

    def _logprobs(self, i: int, ids: list, entries: list | None) -> dict | None:
        return self.logprobs.format(i, ids, entries) if self.logprobs is not None else None

    def body(self, results: list[Choice]) -> dict:
        """Non-streaming response, one Choice per job."""
        choices = []
        for i, r in enumerate(results):
            job = self.jobs[i]
            lp = self._logprobs(i, r.token_ids, r.logprobs)
            if self.chat:
                c = {"index": i, "message": {"role": "assistant", "content": r.text}, "logprobs": lp,
                     "finish_reason": r.finish_reason}
            else:
                c = {"index": i, "text": (job.prompt_text or "") + r.text if self.echo else r.text,
                     "logprobs": lp, "finish_reason": r.finish_reason}
            if self.return_token_ids:
                c.update(prompt_token_ids=job.prompt_ids, token_ids=r.token_ids)
            choices.append(c)
        self.completion_tokens = sum(len(r.token_ids) for r in results)
        self.cached = [r.cached for r in results]
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": self.usage()}

    def chunk(self, i: int, text: str | None, ids: list | None, reason: str | None, first: bool,
              logprobs: list | None = None) -> str:
        lp = self._logprobs(i, ids, logprobs) if ids else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            c = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": reason}
        if self.return_token_ids and ids is not None:
            c["token_ids"] = ids
            if first:
                c["prompt_token_ids"] = self.jobs[i].prompt_ids
        obj = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [c]}
        if self.include_usage:
            obj["usage"] = None
        return sse(obj)

    async def stream(self, gens: list):
        """SSE text for all jobs; an engine error ends it with an error event (see the top)."""
        started = set()
        if self.chat:          # OpenAI opens every chat stream with the role
            for i in range(len(self.jobs)):
                yield self.chunk(i, None, None, None, first=True)
                started.add(i)
        elif self.echo:
            for i, j in enumerate(self.jobs):
                yield self.chunk(i, j.prompt_text or "", [] if self.return_token_ids else None, None, first=True)
                started.add(i)
        async with contextlib.aclosing(merged(gens)) as outs:
            async for i, d in outs:
                self.completion_tokens += len(d.token_ids)
                self.cached[i] = max(self.cached[i], d.cached)
                failed = d.finish_reason == "error"
                if d.text or d.token_ids or not failed:
                    first = self.return_token_ids and not self.chat and i not in started
                    yield self.chunk(i, d.text, d.token_ids, None if failed else d.finish_reason, first, d.logprobs)
                    started.add(i)
                if failed:             # closing `merged` aborts the other choices
                    yield sse(APIError(500, _failure(d)).body())
                    yield "data: [DONE]\n\n"
                    return
        if self.include_usage:
            yield sse({**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                       "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"


def _failure(d: Delta) -> str:
    return f"request failed in the engine: {d.error or 'unknown error'}"


async def collect(gens: list) -> list[Choice]:
    """Run every job to the end -> one Choice each; APIError 500 on an engine error."""
    out = [Choice("", [], "") for _ in gens]
    async for i, d in merged(gens):
        if d.finish_reason == "error":
            raise APIError(500, _failure(d))
        c = out[i]
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        c.cached = max(c.cached, d.cached)
        if d.logprobs is not None:
            c.logprobs = c.logprobs or []
            c.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
    return out


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
