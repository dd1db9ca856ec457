"""OpenAI request bodies (pydantic, strict types: "5" is not an int) and the error body.

Fields kernelgate does not implement are refused with 400 when set to a non-default value,
never silently ignored. Non-standard fields, as vLLM has them: `top_k`, `stop_token_ids`,
`ignore_eos` (exact output lengths for benchmarks), `return_token_ids` (the token ids of
the prompt and of each choice), `skip_special_tokens`, `return_tokens_as_token_ids` (logprobs
name tokens "token_id:N" instead of their text, which is ambiguous for partial characters).

`n` choices per prompt are n requests in the engine (continuous batching runs them side by
side); with a seed, choice j samples with seed + j, so each is reproducible on its own and
equals offline generate() with that seed. Choices are indexed prompt-major (prompt i,
choice j: index i * n + j), as OpenAI orders them; usage counts each prompt once.

Logprobs (completions `logprobs: k`, chat `logprobs: true` + `top_logprobs: k`, k <= 20) are
the raw model distribution's, before temperature / top-k / top-p, as vLLM reports them.
`echo` with `logprobs` is refused: prompt tokens' logprobs would need every prompt
position's logits, and a step computes only each sequence's last.
"""
from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, ValidationError

from ..engine.params import MAX_LOGPROBS

MAX_N = 64       # choices per prompt (`n`): each is a request of its own in the engine


class APIError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: str
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


def parse(cls: type[_Strict], body) -> _Strict:
    """JSON value -> request model; a type error becomes 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not _is_type_tag(x))
        raise bad(loc or "body", err["msg"]) from None
    _check_common(req)
    return req


def _is_type_tag(x) -> bool:
    # pydantic names the union member tried in `loc` ("str", "list[int]"): not a field name
    return isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x)


def _check_common(r: _Sampling) -> None:
    if r.max_tokens is not None and r.max_tokens < 1:
        raise bad("max_tokens", f"must be >= 1, got {r.max_tokens}")
    if r.temperature is not None and not (math.isfinite(r.temperature) and r.temperature >= 0):
        raise bad("temperature", f"must be a finite number >= 0, got {r.temperature}")
    if r.top_p is not None and not (math.isfinite(r.top_p) and 0 < r.top_p <= 1):
        raise bad("top_p", f"must be in (0, 1], got {r.top_p}")
    if r.top_k is not None and r.top_k < -1:
        raise bad("top_k", f"must be -1 or 0 (off) or a positive count, got {r.top_k}")
    if r.seed is not None and not -2**63 <= r.seed < 2**64:
        raise bad("seed", f"must fit in 64 bits, got {r.seed}")
    if not 1 <= r.n <= MAX_N:
        raise bad("n", f"must be in [1, {MAX_N}], got {r.n}")
    if r.seed is not None and r.seed + r.n - 1 >= 2**64:
        raise bad("seed", f"seed + n - 1 must fit in 64 bits (choice j samples with seed + j), got {r.seed}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(r, name) != 0:
            raise bad(name, "is not supported (must be 0)")
    stops = [r.stop] if isinstance(r.stop, str) else (r.stop or [])
    if any(not s for s in stops):
        raise bad("stop", "stop strings must be non-empty")
    if isinstance(r, CompletionRequest):
        if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {r.logprobs}")
        if r.echo and r.logprobs is not None:
            raise bad("echo", "echo with logprobs is not supported (prompt tokens' logprobs are not "
                              "computed); send echo or logprobs, not both")
        if r.suffix is not None:
            raise bad("suffix", "is not supported")
        if r.best_of not in (None, r.n):
            raise bad("best_of", f"only best_of = n is supported (no extra candidates), got {r.best_of} with n={r.n}")
    if isinstance(r, ChatRequest):
        if r.top_logprobs is not None:
            if not 0 <= r.top_logprobs <= MAX_LOGPROBS:
                raise bad("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {r.top_logprobs}")
            if not r.logprobs:
                raise bad("top_logprobs", "needs logprobs: true")
        if r.max_completion_tokens is not None and r.max_completion_tokens < 1:
            raise bad("max_completion_tokens", f"must be >= 1, got {r.max_completion_tokens}")
        if not r.messages:
            raise bad("messages", "must not be empty")


def num_logprobs(r: _Sampling) -> int | None:
    """The request's alternatives per token, or None for no logprobs."""
    if isinstance(r, ChatRequest):
        return (r.top_logprobs or 0) if r.logprobs else None
    return r.logprobs


def stop_strings(r: _Sampling) -> list[str]:
    return [r.stop] if isinstance(r.stop, str) else list(r.stop or [])


def message_text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    for p in m.content:
        if p.type != "text":
            raise bad("messages.content", f"content part type {p.type!r} is not supported (only 'text')")
    return "".join(p.text for p in m.content)
