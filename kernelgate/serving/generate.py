"""`kernelgate.generate(model, prompts, ...)`: batch generation on an engine the model keeps.

The first call on a model builds an `Engine` sized for what it needs (max_num_seqs = the
prompts, up to 16; max_model_len = the longest prompt + max_new_tokens; cache blocks for
exactly that many sequences of that length, not a share of the device) and keeps it on the
model; later calls reuse it -- its captured graphs, compiled kernels and cache -- and rebuild
it only when a call needs more sequences or a longer context than it has, or asks for other
engine settings. Make an `Engine` yourself (and pass `engine=`) to serve many calls from
several threads, to hold a large cache (gpu_memory_utilization), or to control when its
memory is freed (`engine.close()`); `kernelgate.release(model)` frees the kept one.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import is_int, require_int
from ..config import EngineConfig, names
from ..engine.engine import Engine
from ..engine.params import SamplingParams
from ..errors import KernelgateError
from .drive import Timing, drive

KEPT = "_kernelgate_engine"        # the model attribute holding generate()'s engine
DEFAULT_SEQS = 16


@dataclass
class Result:
    prompt_ids: list
    token_ids: list
    finish_reason: str             # "stop" | "length" | "error"
    text: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache


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


def _length(p) -> int:
    return len(p) if hasattr(p, "__len__") else 0


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def engine_for(model, seqs: int, length: int, settings: dict) -> Engine:
    """The model's kept engine if it fits (seqs sequences of `length` tokens, the same settings),
    else a new one (grown from the old one's size), kept in its place. Sizes the caller chose
    (max_num_seqs / max_model_len in `settings`) must match exactly; others may be larger."""
    kept = getattr(model, KEPT, None)
    exact = "max_model_len" in settings
    if kept is not None and kept.runner is not None and not kept.runner.alive:
        release(model)             # its tensor-parallel ranks are gone: a new engine, new ranks
        kept = None
    if kept is not None and kept.runner is not None:
        cfg = kept.config
        same = all(getattr(cfg, k) == v for k, v in settings.items()) \
            and not ("gpu_memory_utilization" in settings and getattr(kept, "sized_by_need", False))
        if same and cfg.max_num_seqs >= seqs and cfg.max_model_len >= length:
            return kept
        if same:   # grow, so that calls alternating between sizes do not rebuild each time
            seqs, length = max(seqs, cfg.max_num_seqs), max(length, cfg.max_model_len)
        kept.close()
        setattr(model, KEPT, None)
    settings = {k: v for k, v in settings.items() if k not in ("max_num_seqs", "max_model_len")}
    block = settings.get("block_size", EngineConfig.block_size)
    if not exact:
        length = _round_up(length, block)
    by_need = "gpu_memory_utilization" not in settings and "num_cache_blocks" not in settings
    if by_need:
        settings = {**settings, "num_cache_blocks": seqs * -(-length // block)}   # what the calls need
    engine = Engine(model, EngineConfig.of(None, **settings, max_num_seqs=seqs, max_model_len=length))
    engine.sized_by_need = by_need
    try:
        setattr(model, KEPT, engine)
    except AttributeError:         # a model object that takes no attributes: the engine lives for this call
        pass
    return engine


def release(model) -> None:
    """Close the engine generate() keeps on `model` (its cache and graphs go back to the device)."""
    kept = getattr(model, KEPT, None)
    if kept is not None:
        kept.close()
        setattr(model, KEPT, None)


def generate(model, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, stop_token_ids=None, progress=None,
             timing: Timing | None = None, *, engine: Engine | None = None, config: EngineConfig | None = None,
             **settings) -> list[Result]:
    """Generate for each prompt (token id lists, or strings when the model has a tokenizer).

    stop_token_ids None = the config's EOS ids. Request i samples with seed `seed + i`, so its
    tokens do not depend on the other prompts. `progress(n_done_tokens)` is called after every
    step; `timing` (a Timing) collects prefill / decode token counts and seconds (drive.py).
    Engine settings (EngineConfig's fields: max_num_seqs, max_model_len, gpu_memory_utilization,
    tensor_parallel_size, ...) as keywords or `config`; they size the engine the model keeps
    (module docstring). `engine`: run on that Engine instead (settings must not be given).
    """
    unknown = sorted(set(settings) - set(names()))
    if unknown:
        raise KernelgateError(f"generate: unknown argument(s) {', '.join(unknown)} (engine settings: "
                              f"{', '.join(names())})")
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
    if engine is not None:
        if settings or config is not None:
            raise KernelgateError(f"generate: engine settings ({', '.join(sorted(settings)) or 'config'}) "
                                  "cannot apply to an engine passed in")
    else:
        chosen = {k: v for k, v in settings.items() if v is not None}
        if config is not None:
            chosen = {**{k: getattr(config, k) for k in names() if getattr(config, k) != getattr(EngineConfig, k)},
                      **chosen}
        EngineConfig.of(None, **chosen)      # checks every setting before anything is built
        seqs = chosen.get("max_num_seqs")
        seqs = seqs if seqs is not None else min(DEFAULT_SEQS, len(ids))
        length = chosen.get("max_model_len")
        if length is None:
            length = max(_length(p) for p in ids) + max_new_tokens
        engine = engine_for(model, seqs, length, chosen)
    base = f"gen{id(ids)}-"
    got = drive(engine, [(f"{base}{i}", p, sp) for i, (p, sp) in enumerate(zip(ids, params))],
                timing=timing, progress=progress)
    tok = model.tokenizer
    out = []
    for i, p in enumerate(ids):
        r = got[f"{base}{i}"]
        prompt = p if isinstance(p, list) else p.tolist() if hasattr(p, "tolist") else list(p)
        out.append(Result(prompt, r.token_ids, r.finish_reason, tok.decode(r.token_ids) if tok is not None else None,
                          r.error, r.num_cached_tokens))
    return out
