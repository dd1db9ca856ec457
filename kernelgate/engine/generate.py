"""`kernelgate.generate(model, prompts, ...)`: batch generation through the scheduler."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..platform import KernelgateError
from .sampling import SamplingParams
from .scheduler import Request, Scheduler


@dataclass
class Result:
    prompt_ids: list
    token_ids: list
    finish_reason: str
    text: str | None = None


@dataclass
class Timing:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: list = field(default_factory=list)

    def rate(self, kind: str) -> float:
        tok, s = (self.prefill_tokens, self.prefill_s) if kind == "prefill" else (self.decode_tokens, self.decode_s)
        return tok / s if s > 0 else 0.0


def _encode(model, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        if isinstance(p, str):
            if model.tokenizer is None:
                raise KernelgateError("generate: string prompts need a checkpoint with a tokenizer; pass token ids")
            out.append(list(model.tokenizer.encode(p)))
        else:
            out.append([int(t) for t in p])
    return out


def _sync(device) -> None:
    if device.type != "cpu":
        import torch
        torch.accelerator.synchronize()


def generate(model, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, stop_token_ids=None, max_batch: int = 16,
             max_len: int | None = None, progress=None, timing: Timing | None = None) -> list[Result]:
    """Generate for each prompt (token id lists, or strings when the model has a tokenizer).

    stop_token_ids None = the config's EOS ids. Request i samples with seed `seed + i`, so
    its tokens do not depend on the other prompts. `progress(n_done_tokens)` is called after
    every step; `timing` (a Timing) collects prefill / decode token counts and seconds.
    """
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    ids = _encode(model, prompts)
    stops = tuple(model.config.eos_token_ids if stop_token_ids is None else stop_token_ids)
    reqs = [Request(p, SamplingParams(max_new_tokens, temperature, top_k, top_p,
                                      None if seed is None else seed + i, stops)) for i, p in enumerate(ids)]
    need = max(len(p) for p in ids) + max_new_tokens
    sched = Scheduler(model, max_slots=min(max_batch, len(reqs)), max_len=max_len or need)
    for r in reqs:
        sched.add(r)
    done_tokens = 0
    while not sched.idle:
        t0 = time.perf_counter()
        stats = sched.step()
        _sync(model.device)
        dt = time.perf_counter() - t0
        done_tokens += stats.seqs
        if timing is not None:
            timing.steps.append((stats.kind, stats.tokens, dt))
            if stats.kind == "prefill":
                timing.prefill_tokens += stats.tokens
                timing.prefill_s += dt
            else:
                timing.decode_tokens += stats.tokens
                timing.decode_s += dt
        if progress is not None:
            progress(done_tokens)
    tok = model.tokenizer
    return [Result(r.prompt, r.output, r.finish_reason,
                   tok.decode(r.output) if tok is not None else None) for r in reqs]
