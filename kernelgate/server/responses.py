"""Engine streams -> OpenAI responses: whole bodies, or SSE chunks (`data: {...}\\n\\n`, then
`data: [DONE]\\n\\n`), for /v1/completions and /v1/chat/completions alike.

One engine output becomes one chunk (its text may be "" while the detokenizer holds back a
partial character or a possible stop string), so a client sees every token's arrival time.
A stop string ends the request early: leaving the engine stream aborts it.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from ..engine.async_engine import RequestStream
from .detokenizer import Detokenizer
from .jobs import Job
from .protocol import APIError


@dataclass
class Delta:
    text: str
    token_ids: list
    finish_reason: str | None = None
    error: str | None = None


async def deltas(stream: RequestStream, detok: Detokenizer):
    """A request's text deltas; the last one has a finish_reason."""
    try:
        async for out in stream:
            text = detok.update(out.new_token_ids)
            if detok.stopped is not None:
                yield Delta(text, out.new_token_ids, "stop")
                return
            if out.finished:
                text += detok.finish()
                yield Delta(text, out.new_token_ids, out.finish_reason or "error", out.error)
                return
            yield Delta(text, out.new_token_ids)
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
                 include_usage: bool):
        self.chat, self.model, self.jobs = chat, model, jobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns():x}{id(self) & 0xffff:04x}"
        self.created = int(time.time())
        self.return_token_ids, self.echo, self.include_usage = return_token_ids, echo, include_usage
        self.completion_tokens = 0

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        p = sum(len(j.prompt_ids) for j in self.jobs)
        return {"prompt_tokens": p, "completion_tokens": self.completion_tokens,
                "total_tokens": p + self.completion_tokens}

    def body(self, results: list[tuple[str, list, str]]) -> dict:
        """Non-streaming response from (text, token_ids, finish_reason) per job."""
        choices = []
        for i, (text, ids, reason) in enumerate(results):
            job = self.jobs[i]
            if self.chat:
                c = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": reason}
            else:
                c = {"index": i, "text": (job.prompt_text or "") + text if self.echo else text,
                     "logprobs": None, "finish_reason": reason}
            if self.return_token_ids:
                c.update(prompt_token_ids=job.prompt_ids, token_ids=ids)
            choices.append(c)
        self.completion_tokens = sum(len(ids) for _, ids, _ in results)
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": self.usage()}

    def chunk(self, i: int, text: str | None, ids: list | None, reason: str | None, first: bool) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            c = {"index": i, "text": text or "", "logprobs": None, "finish_reason": reason}
        if self.return_token_ids and ids is not None:
            c["token_ids"] = ids
            if first:
                c["prompt_token_ids"] = self.jobs[i].prompt_ids
        obj = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [c]}
        if self.include_usage:
            obj["usage"] = None
        return sse(obj)

    async def stream(self, gens: list):
        """SSE text for all jobs; an engine error ends with an error event."""
        started = set()
        if self.chat:          # OpenAI opens every chat stream with the role
            for i in range(len(self.jobs)):
                yield self.chunk(i, None, None, None, first=True)
                started.add(i)
        elif self.echo:
            for i, j in enumerate(self.jobs):
                yield self.chunk(i, j.prompt_text or "", [] if self.return_token_ids else None, None, first=True)
                started.add(i)
        failed = None
        async for i, d in merged(gens):
            self.completion_tokens += len(d.token_ids)
            if self.return_token_ids and i not in started and not self.chat:
                yield self.chunk(i, d.text, d.token_ids, d.finish_reason, first=True)
            else:
                yield self.chunk(i, d.text, d.token_ids, d.finish_reason, first=False)
            started.add(i)
            if d.finish_reason == "error":
                failed = d.error or "engine error"
        if failed is not None:
            yield sse(APIError(500, failed).body())
        elif self.include_usage:
            yield sse({**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                       "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"


async def collect(gens: list) -> list[tuple[str, list, str]]:
    """Run every job to the end -> (text, token_ids, finish_reason) each; APIError 500 on an
    engine error."""
    texts = [[] for _ in gens]
    ids = [[] for _ in gens]
    reasons = [None] * len(gens)
    async for i, d in merged(gens):
        texts[i].append(d.text)
        ids[i].extend(d.token_ids)
        if d.finish_reason == "error":
            raise APIError(500, f"request failed in the engine: {d.error or 'unknown error'}")
        if d.finish_reason is not None:
            reasons[i] = d.finish_reason
    return [("".join(t), x, r) for t, x, r in zip(texts, ids, reasons)]


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
