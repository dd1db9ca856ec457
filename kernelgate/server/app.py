"""The HTTP app (Starlette, served by uvicorn): OpenAI routes over one AsyncEngine.

    GET  /v1/models              the served model (with max_model_len and vocab_size)
    POST /v1/completions         text or token-id prompts (one or a list), stream or not
    POST /v1/chat/completions    messages through the tokenizer's chat template
    GET  /health                 200 while the engine loop is alive, else 503
    GET  /metrics                Prometheus text

Every error is an OpenAI error body ({"error": {"message", "type", "param", "code"}}) with
its status; an unexpected exception is logged here with its traceback and answered 500
with a one-line message, never the traceback.

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
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..serving.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestRejected
from ..text.detokenizer import Detokenizer
from .jobs import ModelInfo, chat_jobs, completion_jobs
from .logprobs import LogprobsFormatter
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, num_logprobs, parse
from .responses import Responder, collect, deltas

log = logging.getLogger("kernelgate.server")


def create_app(engine: AsyncEngine, info: ModelInfo, metrics: Metrics, api_key: str | None = None,
               shutdown_timeout: float = 10.0) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await engine.shutdown(shutdown_timeout)     # drain, then abort what is left

    created = int(time.time())

    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    async def _unexpected(request: Request, e: Exception):
        log.exception("kernelgate: unexpected error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}".splitlines()[0]).body(),
                            status_code=500)

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
        jobs = completion_jobs(info, req)
        return await _serve(request, req, jobs, chat=False, echo=req.echo)

    async def chat(request: Request):
        auth(request)
        req = parse(ChatRequest, await _json(request))
        return await _serve(request, req, chat_jobs(info, req), chat=True, echo=False)

    async def _serve(request: Request, req, jobs: list, chat: bool, echo: bool):
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        lp = (None if num_logprobs(req) is None
              else LogprobsFormatter(info.tokenizer, chat, req.return_tokens_as_token_ids))
        resp = Responder(chat, info.name, jobs, req.return_token_ids, echo, include_usage, lp)
        streams = await _admit(resp.id, jobs)
        gens = [deltas(s, Detokenizer(info.tokenizer, j.stop, req.skip_special_tokens))
                for s, j in zip(streams, jobs)]

        async def abort_all():    # (async: Starlette runs a plain function on its thread pool)
            for s in streams:
                s.abort()

        if req.stream:
            # the background task runs after the response ends, a client disconnect included
            return StreamingResponse(resp.stream(gens), media_type="text/event-stream",
                                     background=BackgroundTask(abort_all))
        task = asyncio.ensure_future(collect(gens))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return JSONResponse(resp.body(task.result()))
                if await request.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)
        finally:
            await abort_all()

    async def _admit(rid: str, jobs: list) -> list:
        streams = []
        try:
            for i, j in enumerate(jobs):
                streams.append(await engine.add_request(f"{rid}-{i}-{uuid.uuid4().hex[:6]}", j.prompt_ids, j.params))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFull):
                raise APIError(503, str(e)) from None
            if isinstance(e, EngineStopped):
                raise APIError(503, str(e)) from None
            if isinstance(e, RequestRejected):
                raise APIError(400, str(e)) from None
            raise
        return streams

    routes = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics_text, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]), Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    handlers = {APIError: _api_error, StarletteHTTPException: _http_error, Exception: _unexpected}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
