"""`kernelgate.generate(model, prompts, ...)`: batch generation through one `Engine` loop."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..platform import KernelgateError
from .checks import is_int, require_int
from .engine import Engine
from .sampling import SamplingParams


@dataclass
class Result:
    prompt_ids: list
    token_ids: list
    finish_reason: str             # "stop" | "length" | "error"
    text: str | None = None
    error: str | None = None


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


def _encode(model, prompts) -> list:
    out = []
    for p in prompts:
        if isinstance(p, str):
            if model.tokenizer is None:
                raise KernelgateError("generate: string prompts need a checkpoint with a tokenizer; pass token ids")
            out.append(list(model.tokenizer.encode(p)))
        else:
            out.append(p)             # token ids: checked by Engine.add_request (types, range)
    return out


def generate(model, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, stop_token_ids=None, max_batch: int | None = None,
             max_len: int | None = None, progress=None, timing: Timing | None = None, *,
             max_num_seqs: int | None = None, max_model_len: int | None = None,
             max_num_batched_tokens: int = 8192, gpu_memory_utilization: float = 0.9, block_size: int = 64,
             num_cache_blocks: int | None = None, graphs: bool = True, engine: Engine | None = None,
             tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
             async_scheduling: bool = True) -> list[Result]:
    """Generate for each prompt (token id lists, or strings when the model has a tokenizer).

    stop_token_ids None = the config's EOS ids. Request i samples with seed `seed + i`, so
    its tokens do not depend on the other prompts. `progress(n_done_tokens)` is called after
    every step; `timing` (a Timing) collects prefill / decode token counts and seconds (a
    step with prefill chunks counts as prefill; `steps` lists (kind, tokens, seconds) per call,
    kind "launch" for a call that only queued a step). The engine knobs (vLLM's names; `max_batch`
    and `max_len` are the older names of max_num_seqs and max_model_len) size an `Engine`
    for this call: max_num_seqs defaults to min(16, prompts), max_model_len to the longest
    prompt + max_new_tokens. `engine`: run on an existing Engine instead (knobs ignored).
    tensor_parallel_size / enable_expert_parallel: run sharded over that many processes (see
    Engine); the worker processes stay up for the next call with the same model.
    """
    if isinstance(prompts, (str, bytes)) or (isinstance(prompts, (list, tuple)) and prompts and is_int(prompts[0])):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise KernelgateError(f"generate: prompts must be a non-empty list of prompts, got {prompts!r:.80}")
    ids = _encode(model, prompts)
    stops = model.config.eos_token_ids if stop_token_ids is None else stop_token_ids
    params = [SamplingParams(max_new_tokens, temperature, top_k, top_p,
                             None if seed is None else seed + i, stops) for i in range(len(ids))]
    if seed is not None:
        require_int("generate", "seed", seed + len(ids) - 1, lo=0, hi=2**64 - 1)
    own = engine is None
    if own:
        if max_batch is not None and max_num_seqs is not None and max_batch != max_num_seqs:
            raise KernelgateError(f"generate: max_batch {max_batch} and max_num_seqs {max_num_seqs} disagree "
                                  "(max_batch is the old name)")
        seqs = max_num_seqs if max_num_seqs is not None else max_batch
        if seqs is not None:
            require_int("generate", "max_num_seqs" if max_num_seqs is not None else "max_batch", seqs, lo=1)
        else:
            seqs = 16
        length = max_model_len if max_model_len is not None else max_len
        if length is None:
            length = max(len(p) if hasattr(p, "__len__") else 0 for p in ids) + max_new_tokens
        engine = Engine(model, max_num_seqs=min(seqs, len(ids)), max_model_len=length,
                        max_num_batched_tokens=max_num_batched_tokens,
                        gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
                        num_cache_blocks=num_cache_blocks, graphs=graphs,
                        tensor_parallel_size=tensor_parallel_size, enable_expert_parallel=enable_expert_parallel,
                        async_scheduling=async_scheduling)
    try:
        return _drive(engine, model, ids, params, progress, timing)
    finally:
        if own:
            engine.close()


def _drive(engine, model, ids, params, progress, timing) -> list[Result]:
    base = f"gen{id(ids)}-"
    try:
        for i, (p, sp) in enumerate(zip(ids, params)):
            engine.add_request(f"{base}{i}", p, sp)
    except Exception:
        for j in range(len(ids)):          # a shared engine keeps nothing of a rejected call
            engine.abort(f"{base}{j}")
        raise
    results: dict = {}
    tokens: dict = {i: [] for i in range(len(ids))}
    done_tokens = 0
    while len(results) < len(ids):
        t0 = time.perf_counter()
        outs = engine.step()              # waits for the step it reads (see Engine.step)
        dt = time.perf_counter() - t0
        for o in outs:
            if not o.request_id.startswith(base):
                continue                   # another caller's request on a shared engine
            i = int(o.request_id[len(base):])
            tokens[i].extend(o.new_token_ids)
            done_tokens += len(o.new_token_ids)
            if o.finished:
                results[i] = o
        stats = engine.read_step            # this call's time is the wait for that step
        if timing is not None and stats is None:
            timing.steps.append(("launch", 0, dt))   # a call that read nothing (queued the first step)
        elif timing is not None:
            timing.steps.append((stats.kind, stats.tokens, dt))
            if stats.prefill_tokens:
                timing.prefill_tokens += stats.prefill_tokens
                timing.prefill_s += dt
            else:
                timing.decode_tokens += stats.tokens
                timing.decode_s += dt
        if progress is not None:
            progress(done_tokens)
    tok = model.tokenizer
    out = []
    for i, p in enumerate(ids):
        r = results[i]
        prompt = p if isinstance(p, list) else list(p) if not hasattr(p, "tolist") else p.tolist()
        out.append(Result(prompt, tokens[i], r.finish_reason, tok.decode(tokens[i]) if tok is not None else None,
                          r.error))
    return out
