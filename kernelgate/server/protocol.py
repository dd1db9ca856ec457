"""OpenAI request bodies (pydantic, strict types: "5" is not an int) and the error body.

A body holds only the fields the models below declare: every other field is refused with
400 naming it, never silently ignored. `NOT_IMPLEMENTED` (the one list of them) names the
OpenAI and vLLM fields kernelgate knows but does not implement, with the values that ask
for nothing (null, or the default behaviour, e.g. `logit_bias: {}`): those are accepted, any
other value is 400 naming the field; a field in neither place is 400 as unknown. Text must
be valid Unicode (a lone surrogate such as "\\ud800" is 400 naming where it is), and one
request may ask for at most `MAX_CHOICES` choices (prompts x n). `user` (the end user's id)
is accepted and changes nothing. Non-standard fields, as vLLM has them: `top_k`, `stop_token_ids`,
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

import json
import math

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ..engine.params import MAX_LOGPROBS

MAX_N = 64            # choices per prompt (`n`): each is a request of its own in the engine
MAX_CHOICES = 256     # prompts x n of one request (each a queued engine request); --max-queued-requests caps it too
MIN_TEMPERATURE = 0.01   # above 0 (greedy), as vLLM's floor
MAX_STOPS = 64        # stop strings per request (each is matched against every new piece of text)

# field -> the values that ask for nothing (accepted); any other value is refused, naming the field
_COMMON = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
    "service_tier": ("auto", "default"),
    # vLLM's sampling extras, at their defaults
    "min_tokens": (0,), "repetition_penalty": (1, 1.0), "min_p": (0, 0.0), "use_beam_search": (False,),
    "length_penalty": (1, 1.0), "include_stop_str_in_output": (False,), "prompt_logprobs": (),
    "truncate_prompt_tokens": (), "spaces_between_special_tokens": (True,), "allowed_token_ids": (),
    "bad_words": ([],), "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "priority": (0,), "logits_processors": (),
}
NOT_IMPLEMENTED = {
    "completions": {**_COMMON, "suffix": ()},
    "chat": {**_COMMON, "tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False),
             "functions": ([],), "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
             "store": (False,), "metadata": ({},), "modalities": (["text"],), "audio": (), "prediction": (),
             "reasoning_effort": (), "verbosity": (), "web_search_options": (), "prompt_cache_key": (),
             "safety_identifier": (), "chat_template": (), "chat_template_kwargs": ({},),
             "continue_final_message": (False,), "echo": (False,), "documents": ()},
}


class APIError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


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
    ignore_eos: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: str
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, v):
        if isinstance(v, dict) and v.get("type") != "text":
            raise ValueError(f"content part type {json.dumps(v.get('type'))[:40]} is not supported (only 'text')")
        return v


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
    """JSON value -> request model; a type error, an unknown or unimplemented field or text that
    is not Unicode becomes 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    check_text(body)
    endpoint = "chat" if cls is ChatRequest else "completions"
    body = dict(body)
    for name, off in NOT_IMPLEMENTED[endpoint].items():
        if name in body:
            v = body.pop(name)
            if v is not None and _canon(v) not in {_canon(x) for x in off}:
                asks = " or ".join(json.dumps(x) for x in off)
                raise bad(name, "is not supported by kernelgate (send null" + (f" or {asks}" if off else "")
                          + f"), got {json.dumps(v)[:80]}")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        # the deepest error: in a union (`prompt`, `content`), the member the value came closest to
        err = max(e.errors(), key=lambda x: (len([p for p in x["loc"] if not _is_type_tag(p)]),
                                             x["type"] == "extra_forbidden"))
        loc = ".".join(str(x) for x in err["loc"] if not _is_type_tag(x))
        msg = ("unknown field (not one kernelgate implements for /v1/" + ("chat/" if endpoint == "chat" else "")
               + "completions)") if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise bad(loc or "body", msg) from None
    _check_common(req)
    return req


def _is_type_tag(x) -> bool:
    # pydantic names the union member tried in `loc` ("str", "list[int]"): not a field name
    return isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x)


def _canon(v) -> str:
    """Type-exact identity of a JSON value (0, 0.0 and false differ)."""
    return json.dumps(v, sort_keys=True)


def check_text(body) -> None:
    """Every string of a JSON value (keys too) is valid Unicode: 400 naming the first that is not
    (a lone surrogate such as "\\ud800" parses as JSON but is no character)."""
    try:                      # one pass in C (a prompt of 32k token ids: ~1 ms); the walk finds the culprit
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    stack = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            _unicode(path or "body", v)
        elif isinstance(v, dict):
            for k, x in v.items():
                _unicode(path or "body", k)          # (a key: named by where it is)
                stack.append((f"{path}.{k}" if path else str(k), x))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v)
                         if isinstance(x, (str, dict, list)))     # (a prompt of token ids: no path per number)


def _unicode(param: str, s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(param, f"is not valid Unicode text: {s[e.start]!r} at index {e.start} is a lone surrogate "
                         "(a UTF-16 half of a character)") from None


def _check_common(r: _Sampling) -> None:
    if r.max_tokens is not None and r.max_tokens < 1:
        raise bad("max_tokens", f"must be >= 1, got {r.max_tokens}")
    if r.temperature is not None and not (math.isfinite(r.temperature) and r.temperature >= 0):
        raise bad("temperature", f"must be a finite number >= 0, got {r.temperature}")
    if r.temperature is not None and 0 < r.temperature < MIN_TEMPERATURE:
        # logits / a tinier temperature overflow fp32 to inf, and softmax of inf is NaN
        raise bad("temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {r.temperature}")
    if r.top_p is not None and not (math.isfinite(r.top_p) and 0 < r.top_p <= 1):
        raise bad("top_p", f"must be in (0, 1], got {r.top_p}")
    if r.top_k is not None and r.top_k < -1:
        raise bad("top_k", f"must be -1 or 0 (off) or a positive count, got {r.top_k}")
    if r.seed is not None and not 0 <= r.seed < 2**64:
        raise bad("seed", f"must be in [0, 2**64), got {r.seed}")
    if not 1 <= r.n <= MAX_N:
        raise bad("n", f"must be in [1, {MAX_N}], got {r.n}")
    if r.seed is not None and r.seed + r.n - 1 >= 2**64:
        raise bad("seed", f"seed + n - 1 must fit in 64 bits (choice j samples with seed + j), got {r.seed}")
    stops = [r.stop] if isinstance(r.stop, str) else (r.stop or [])
    if any(not s for s in stops):
        raise bad("stop", "stop strings must be non-empty")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    if r.stop_token_ids is not None and len(r.stop_token_ids) > 1024:
        raise bad("stop_token_ids", f"at most 1024 ids, got {len(r.stop_token_ids)}")
    if isinstance(r, CompletionRequest):
        if r.logprobs is not None and not 0 <= r.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {r.logprobs}")
        if r.echo and r.logprobs is not None:
            raise bad("echo", "echo with logprobs is not supported (prompt tokens' logprobs are not "
                              "computed); send echo or logprobs, not both")
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
    return "".join(p.text for p in m.content)
