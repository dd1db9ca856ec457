"""The HTTP app (Starlette, served by uvicorn): OpenAI routes over one AsyncEngine.

    GET  /v1/models              the served model (with max_model_len and vocab_size)
    POST /v1/completions         text or token-id prompts (one or a list), stream or not
    POST /v1/chat/completions    messages through the tokenizer's chat template
    GET  /health                 200 while the engine loop is alive, else 503
    GET  /metrics                Prometheus text

Every error is an OpenAI error body ({"error": {"message", "type", "param", "code"}}) with
its status; an unexpected exception is logged here with its traceback and answered 500
with a one-line message, never the traceback (no request body reaches it: a body that is
not JSON, not UTF-8, nested past the parser or over `MAX_BODY_BYTES` is 400 / 413). A client that
disconnects while sending its body is dropped with a debug line: nothing was admitted yet.

Work is bounded per request and per server: a request's prompts x n choices are admitted
together, each counted against the engine's queue bound (over it: 429 with Retry-After), at
most `protocol.MAX_CHOICES` (and no more than the queue holds: 400); every one of them is
aborted as soon as the client disconnects (streaming or not, even while none has produced a
token) or the request fails.

Plain Starlette rather than FastAPI: request bodies are parsed and validated here
(server/protocol.py), so FastAPI's layer would add only dependencies (FastAPI >= 0.16x pulls
in OpenTelemetry), not function.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..serving.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestRejected
from ..text.detokenizer import Detokenizer
from .jobs import ModelInfo, chat_jobs, completion_jobs
from .logprobs import LogprobsFormatter
from .metrics import Metrics
from .protocol import MAX_CHOICES, APIError, ChatRequest, CompletionRequest, num_logprobs, parse
from .responses import Responder, collect, deltas

log = logging.getLogger("kernelgate.server")

MAX_BODY_BYTES = 64 << 20     # a request body (a prompt of a million token ids is ~8 MB of JSON)


def create_app(engine: AsyncEngine, info: ModelInfo, metrics: Metrics, api_key: str | None = None,
               shutdown_timeout: float = 10.0, max_choices: int = MAX_CHOICES) -> Starlette:
    """max_choices: most prompts x n of one request (also at most the engine's queue bound)."""
    limit = min(max_choices, engine.max_queued)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await engine.shutdown(shutdown_timeout)     # drain, then abort what is left

    created = int(time.time())

    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    async def _unexpected(request: Request, e: Exception):
        log.exception("kernelgate: unexpected error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}".splitlines()[0]).body(),
                            status_code=500)

    async def _client_gone(request: Request, e: ClientDisconnect):
        # raised while a request body is read (_json): nothing was admitted, nobody reads an answer
        log.debug("kernelgate: client disconnected while sending the body of %s", request.url.path)
        return Response(status_code=499)

    def auth(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, f"{'wrong' if given else 'missing'} API key: send 'Authorization: Bearer <key>'")

    async def health(request: Request):
        if engine.dead:
            return JSONResponse(APIError(503, engine.dead).body(), status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(request: Request):
        return Response(metrics.render(), media_type=metrics.content_type)

    async def models(request: Request):
        auth(request)
        card = {"id": info.name, "object": "model", "created": created, "owned_by": "kernelgate",
                "root": info.name, "max_model_len": info.max_model_len, "vocab_size": info.vocab_size}
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(request: Request):
        auth(request)
        req = parse(CompletionRequest, await _json(request))
        jobs = completion_jobs(info, req, limit)
        return await _serve(request, req, jobs, chat=False, echo=req.echo)

    async def chat(request: Request):
        auth(request)
        req = parse(ChatRequest, await _json(request))
        return await _serve(request, req, chat_jobs(info, req, limit), chat=True, echo=False)

    async def _serve(request: Request, req, jobs: list, chat: bool, echo: bool):
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        lp = (None if num_logprobs(req) is None
              else LogprobsFormatter(info.tokenizer, chat, req.return_tokens_as_token_ids))
        resp = Responder(chat, info.name, jobs, req.return_token_ids, echo, include_usage, lp)
        streams = await _admit(resp.id, jobs)
        gens = [deltas(s, Detokenizer(info.tokenizer, j.stop, req.skip_special_tokens))
                for s, j in zip(streams, jobs)]

        def abort_all():
            for s in streams:
                s.abort()

        if req.stream:
            return EventStream(resp.stream(gens), abort_all)
        try:
            answer = await _unless_disconnected(request.receive, collect(gens))
        finally:
            abort_all()
        return Response(status_code=499) if answer is None else JSONResponse(resp.body(answer))

    async def _admit(rid: str, jobs: list) -> list:
        tag = uuid.uuid4().hex[:6]
        try:
            return await engine.add_requests([(f"{rid}-{i}-{tag}", j.prompt_ids, j.params) for i, j in enumerate(jobs)])
        except QueueFull as e:
            raise APIError(429, str(e), headers={"Retry-After": "1"}) from None
        except EngineStopped as e:
            raise APIError(503, str(e)) from None
        except RequestRejected as e:
            raise APIError(400, str(e)) from None

    routes = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics_text, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]), Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    handlers = {APIError: _api_error, StarletteHTTPException: _http_error, ClientDisconnect: _client_gone,
                Exception: _unexpected}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


async def _json(request: Request):
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise APIError(413, f"request body of {int(size)} bytes is over the server's {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is over the server's {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(bytes(raw))
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 text: {e}") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None


async def _until_disconnect(receive) -> None:
    """Returns when the client has gone (the body is read: the server's next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive, work):
    """work's result, or None (work cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


class EventStream(Response):
    """An SSE response whose `on_close` (aborting the request's jobs) runs however it ends: its
    last chunk, a failure, or the client disconnecting -- noticed at once, even while no chunk
    is due (a queued job produces none), not only when a write fails."""

    media_type = "text/event-stream"

    def __init__(self, chunks, on_close):
        self.status_code, self.background = 200, None
        self.init_headers(None)           # no body: no content-length
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope, receive, send) -> None:
        async def body():
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        try:
            await _unless_disconnected(receive, body())
        except OSError:              # the client went away mid-write
            pass
        finally:
            self.on_close()
            await self.chunks.aclose()
