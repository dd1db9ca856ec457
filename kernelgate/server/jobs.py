"""A validated request -> engine jobs: prompt token ids, sampling parameters, stop strings.

Everything that can be checked before the engine sees the request is checked here, so a
bad request answers 400 naming its field (token ids outside the vocabulary, a prompt that
does not fit `max_model_len`, a text prompt for a model without a tokenizer).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..engine.params import SamplingParams
from ..errors import KernelgateError
from .protocol import MAX_CHOICES, ChatRequest, CompletionRequest, bad, message_text, num_logprobs, stop_strings


@dataclass
class ModelInfo:
    name: str
    tokenizer: object           # HF-like (encode / decode / apply_chat_template) or None
    max_model_len: int
    vocab_size: int
    eos_token_ids: list


@dataclass
class Job:
    prompt_ids: list
    params: SamplingParams
    stop: list
    prompt_text: str | None = None     # what `echo` returns
    counts_prompt: bool = True         # False for choices 2..n of a prompt (usage counts it once)


def _choices(job: Job, n: int) -> list[Job]:
    """`n` choices of one prompt: choice j samples with seed + j (when seeded)."""
    seed = job.params.seed
    return [job] + [replace(job, params=replace(job.params, seed=None if seed is None else seed + j),
                            counts_prompt=False) for j in range(1, n)]


def _check_ids(info: ModelInfo, ids: list, param: str) -> None:
    if not ids:
        raise bad(param, "must not be empty")
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        raise bad(param, f"token ids must be in [0, {info.vocab_size}), got {min(ids)}..{max(ids)}")


def _params(info: ModelInfo, r, prompt_len: int, max_tokens: int | None, prompt_param: str) -> SamplingParams:
    L = info.max_model_len
    if prompt_len >= L:
        raise bad(prompt_param, f"the prompt has {prompt_len} tokens; this model's maximum context "
                                f"length is {L} tokens (prompt + output)")
    if max_tokens is None:
        max_tokens = L - prompt_len
    if prompt_len + max_tokens > L:
        raise bad("max_tokens", f"{prompt_len} prompt tokens + max_tokens {max_tokens} exceed this "
                                f"model's maximum context length of {L} tokens")
    stops = [] if r.ignore_eos else list(info.eos_token_ids)
    if r.stop_token_ids:
        _check_ids(info, r.stop_token_ids, "stop_token_ids")
        stops += [t for t in r.stop_token_ids if t not in stops]
    try:
        return SamplingParams(max_new_tokens=max_tokens,
                              temperature=1.0 if r.temperature is None else r.temperature,
                              top_k=max(r.top_k or 0, 0), top_p=1.0 if r.top_p is None else r.top_p,
                              seed=r.seed, stop_token_ids=tuple(stops), logprobs=num_logprobs(r))
    except KernelgateError as e:
        raise bad("body", str(e)) from None


def _check_model(info: ModelInfo, r) -> None:
    if r.model is not None and r.model != info.name:
        raise bad("model", f"unknown model {r.model!r}; this server serves {info.name!r}")


def check_choices(prompts: int, n: int, limit: int = MAX_CHOICES) -> None:
    """A request's engine jobs (prompts x n), bounded before any prompt is tokenized."""
    if prompts * n > limit:
        raise bad("prompt" if prompts > 1 else "n", f"{prompts} prompt(s) x n {n} = {prompts * n} choices; this "
                                                    f"server takes at most {limit} per request")


def completion_jobs(info: ModelInfo, r: CompletionRequest, limit: int = MAX_CHOICES) -> list[Job]:
    """limit: most choices (prompts x n) of one request."""
    _check_model(info, r)
    p = r.prompt
    prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not prompts:
        raise bad("prompt", "must not be empty")
    check_choices(len(prompts), r.n, limit)
    tok = info.tokenizer
    jobs = []
    for i, one in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if isinstance(one, str):
            if tok is None:
                raise bad(param, "this model has no tokenizer: send token ids (a list of ints)")
            ids, text = list(tok.encode(one, add_special_tokens=True)), one
        else:
            ids = list(one)
            text = tok.decode(ids, skip_special_tokens=r.skip_special_tokens) if tok is not None and r.echo else None
        _check_ids(info, ids, param)
        mt = 16 if r.max_tokens is None else r.max_tokens          # OpenAI's default for completions
        jobs += _choices(Job(ids, _params(info, r, len(ids), mt, param), stop_strings(r), text), r.n)
    return jobs


def chat_jobs(info: ModelInfo, r: ChatRequest, limit: int = MAX_CHOICES) -> list[Job]:
    _check_model(info, r)
    check_choices(1, r.n, limit)
    tok = info.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad("messages", "this model's tokenizer has no chat template; use /v1/completions")
    messages = [{"role": m.role, "content": message_text(m)} for m in r.messages]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=r.add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem (roles, order)
        raise bad("messages", f"chat template failed: {type(e).__name__}: {e}") from None
    ids = list(tok.encode(text, add_special_tokens=False))
    _check_ids(info, ids, "messages")
    mt = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    return _choices(Job(ids, _params(info, r, len(ids), mt, "messages"), stop_strings(r)), r.n)
