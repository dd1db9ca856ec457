"""`kernelgate run`: load a model (default: the built-in one), generate for a few prompts
through the engine, and show which implementation each op dispatched to and the tokens/s.

Prompts: `--prompt TEXT` (through the tokenizer; `--chat` wraps it as a user message with
the chat template) and `--prompt-ids 5,17,300` (token ids as given) are distinct; with
neither, random token-id prompts. Decoded text skips special tokens and ends before the
first `--stop` string.
"""
from __future__ import annotations

import dataclasses
import json
import time

from ..errors import KernelgateError
from . import args as flags


def add_parser(sub, common) -> None:
    p = sub.add_parser("run", help="load a model (default: a built-in small Kimi-Linear-shaped one) and generate")
    common(p)
    flags.add_model_args(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids, e.g. 5,17,300 (repeatable)")
    p.add_argument("--chat", action="store_true", help="render each --prompt as a user message with the "
                                                       "tokenizer's chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--max-new-tokens", type=flags.int_at_least(1), default=16)
    p.add_argument("--batch", type=flags.int_at_least(1), help="number of prompts run together (default: the "
                   "prompts given, each once; with none, 4 random ones)")
    p.add_argument("--temperature", type=flags.float_in(0.0, float("inf")), default=0.0)
    p.add_argument("--top-p", type=flags.float_in(0.0, 1.0, lo_open=True), default=1.0)
    p.add_argument("--top-k", type=flags.int_at_least(0), default=0)
    p.add_argument("--seed", type=flags.int_at_least(0), default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    flags.add_engine_args(p)
    p.set_defaults(fn=main)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise KernelgateError(f"run: --prompt-ids {text!r} must be comma-separated integers, e.g. 5,17,300") from None
    return ids


def _prompts(args, model) -> list[list[int]]:
    import torch
    tok = model.tokenizer
    out = []
    if args.prompt and tok is None:
        raise KernelgateError("run: this checkpoint has no tokenizer: give token ids with --prompt-ids 5,17,300")
    if args.chat and not getattr(tok, "chat_template", None):
        raise KernelgateError("run: --chat needs a tokenizer with a chat template")
    for p in args.prompt:
        if args.chat:
            text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            out.append(list(tok.encode(text, add_special_tokens=False)))
        else:
            out.append(list(tok.encode(p)))
    out += [_ids(p) for p in args.prompt_ids]
    V = model.config.vocab_size
    for ids in out:
        if not ids or min(ids) < 0 or max(ids) >= V:
            raise KernelgateError(f"run: prompt {ids[:8]}{'...' if len(ids) > 8 else ''} must be non-empty "
                                  f"token ids in [0, {V})")
    if out:
        return (out * (args.batch or 1))[:max(args.batch or 1, len(out))]
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randint(0, V, (int(n),), generator=g).tolist()
            for n in torch.randint(4, 24, (args.batch or 4,), generator=g)]


def _generate(engine, prompts, params, tokenizer, stops, progress=None):
    """Run prompts to the end through the shared drive loop -> (results, Timing). A request whose
    text reaches a --stop string is aborted there (its text ends before it)."""
    from ..serving.drive import Timing, drive
    from ..text.detokenizer import Detokenizer
    ids = [f"r{i}" for i in range(len(prompts))]
    detok = {rid: Detokenizer(tokenizer, stops) for rid in ids}
    stopped = set()

    def on_output(o):
        d = detok[o.request_id]
        d.update(o.new_token_ids)
        if d.stopped is not None and not o.finished:
            engine.abort(o.request_id)
            stopped.add(o.request_id)
    timing = Timing()
    got = drive(engine, list(zip(ids, prompts, params)), on_output=on_output, timing=timing, progress=progress)
    results = []
    for rid, prompt in zip(ids, prompts):
        r = got[rid]
        if r.finish_reason == "error":
            raise KernelgateError(f"run: request {rid} failed in the engine: {r.error}")
        d = detok[rid]
        d.finish()
        results.append({"prompt_ids": prompt, "token_ids": r.token_ids,
                        "finish_reason": "stop" if rid in stopped else r.finish_reason,
                        "text": d.text if tokenizer is not None else None})
    return results, timing


def _weights(model) -> str:
    """How the projections are stored: the model dtype, or FP8 with its scale layout."""
    from ..models.quant import block_of
    block = block_of(getattr(model, "shard", model))
    if block is False:
        return str(model.dtype).replace("torch.", "")
    return "fp8 e4m3 " + ("per channel" if block is None else f"block {block[0]}x{block[1]}")


def main(args) -> int:
    from .. import platform, registry
    from ..engine.engine import Engine
    from ..engine.params import SamplingParams
    from ..executor.graphs import graph_api
    from ..serving.warmup import warm_up
    from .model import load
    from .progress import Progress
    max_len = flags.engine_config(args).max_model_len
    if args.max_new_tokens >= max_len:
        raise KernelgateError(f"run: --max-new-tokens {args.max_new_tokens} leaves no room for a prompt in "
                              f"--max-model-len {max_len}")
    say = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    t0 = time.perf_counter()
    say(f"loading {args.model or 'the built-in model'}...")
    model, source = load(args)
    say(f"loaded in {time.perf_counter() - t0:.1f} s")
    prompts = _prompts(args, model)
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > max_len:
        raise KernelgateError(f"run: the longest prompt ({longest} tokens) + --max-new-tokens {args.max_new_tokens} "
                              f"exceeds --max-model-len {max_len}")
    config = flags.engine_config(args, max_num_seqs=len(prompts))
    t0 = time.perf_counter()
    engine = Engine(model, config)
    say(f"engine ready in {time.perf_counter() - t0:.1f} s; {engine.capacity.report()}")
    stops = tuple(model.config.eos_token_ids)

    def params(i, n):
        return SamplingParams(max_new_tokens=n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed + i, stop_token_ids=stops)
    warm_up(engine, log=say)
    plan = registry.plan()
    impls = {name: {i: registry.get(name).impls[i].provider for i in chosen} for name, chosen in plan.items()}
    with Progress("generating", len(prompts) * args.max_new_tokens, quiet=args.json) as bar:
        results, timing = _generate(engine, prompts, [params(i, args.max_new_tokens) for i in range(len(prompts))],
                                    model.tokenizer, args.stop, bar.update)
    plat = platform.current()
    graphs_reason = graph_api(model.device)[1]
    rate = {k: round(timing.rate(k), 1) for k in ("prefill", "decode")}
    report = {
        "model": source, "platform": plat.name, "real_platform": plat.real, "device": str(model.device),
        "dtype": str(model.dtype).replace("torch.", ""), "weights": _weights(model), "plan": impls,
        "engine": dataclasses.asdict(config),
        "decode_graphs": graphs_reason is None, "decode_graphs_reason": graphs_reason,
        "prefill_tokens": timing.prefill_tokens, "prefill_tokens_per_s": rate["prefill"],
        "decode_tokens": timing.decode_tokens, "decode_tokens_per_s": rate["decode"],
        "results": results,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    sim = f" (simulated; real {plat.real})" if plat.simulated else ""
    print(f"model     {source}")
    print(f"platform  {plat.name}{sim}   device {report['device']}   dtype {report['dtype']}   "
          f"weights {report['weights']}")
    print("decode    " + ("captured device graphs" if graphs_reason is None else f"eager ({graphs_reason})"))
    print("\ndispatch plan (op -> implementation):")
    for name, chosen in impls.items():
        print(f"  {name:<24} -> " + ", ".join(f"{i} ({p})" for i, p in chosen.items()))
    print()
    for i, r in enumerate(results):
        shown = repr(r["text"]) if r["text"] is not None else " ".join(map(str, r["token_ids"]))
        print(f"[{i}] {len(r['prompt_ids'])} prompt tokens -> {len(r['token_ids'])} new ({r['finish_reason']}): {shown}")
    print(f"\nprefill {timing.prefill_tokens} tokens at {rate['prefill']} tokens/s; "
          f"decode {timing.decode_tokens} tokens at {rate['decode']} tokens/s (batch {len(prompts)})")
    return 0
