"""`kernelgate run`: load a model (default: a built-in small Kimi-Linear-shaped one), show
which implementation each op dispatched to, generate for a few prompts, report tokens/s."""
from __future__ import annotations

import json

from .platform import KernelgateError


def add_arguments(p) -> None:
    p.add_argument("--model", help="checkpoint folder (default: built-in small model with seeded weights)")
    p.add_argument("--prompt", action="append",
                   help="prompt text (needs a tokenizer) or comma-separated token ids; repeatable")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="number of prompts run together (default 4)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="torch device (default: the platform's)")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: checkpoint's; built-in: float32)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _model(args):
    import torch

    from . import load_model
    from .models import build, tiny
    if args.model:
        return load_model(args.model, device=args.device, dtype=args.dtype), args.model
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32
    if not isinstance(dtype, torch.dtype):
        raise KernelgateError(f"run: --dtype {args.dtype!r} is not a torch dtype")
    return build(tiny(), device=args.device, dtype=dtype, seed=0), "built-in tiny Kimi Linear (seeded)"


def _prompts(args, model) -> list:
    import torch
    if args.prompt:
        out = []
        for p in args.prompt:
            if model.tokenizer is not None:
                out.append(p)
            else:
                try:
                    out.append([int(t) for t in p.split(",")])
                except ValueError:
                    raise KernelgateError("run: this model has no tokenizer: --prompt must be "
                                          "comma-separated token ids, e.g. --prompt 1,2,3") from None
        return (out * args.batch)[:max(args.batch, len(out))]
    g = torch.Generator().manual_seed(args.seed)
    V = model.config.vocab_size
    return [torch.randint(0, V, (int(n),), generator=g).tolist()
            for n in torch.randint(4, 24, (args.batch,), generator=g)]


def _progress(total: int, quiet: bool):
    """(callback, close) showing generated tokens; rich when available, else nothing."""
    if quiet:
        return None, lambda: None
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    except ImportError:
        return None, lambda: None
    bar = Progress("[bold]generating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   transient=True, console=Console(stderr=True))
    task = bar.add_task("tokens", total=total)
    bar.start()
    return (lambda n: bar.update(task, completed=n)), bar.stop


def main(args) -> int:
    from . import platform, registry
    from .engine import Timing, generate
    from .engine.graphs import graph_api
    if args.batch < 1 or args.max_new_tokens < 1:
        raise KernelgateError("run: --batch and --max-new-tokens must be >= 1")
    model, source = _model(args)
    prompts = _prompts(args, model)
    kw = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
              max_batch=len(prompts))
    generate(model, prompts[:2], max_new_tokens=2, **kw)         # warm-up: every op dispatches once
    plan = registry.plan()
    impls = {name: {i: registry.get(name).impls[i].provider for i in chosen} for name, chosen in plan.items()}
    timing = Timing()
    update, close = _progress(len(prompts) * args.max_new_tokens, args.json)
    try:
        results = generate(model, prompts, max_new_tokens=args.max_new_tokens, progress=update,
                           timing=timing, **kw)
    finally:
        close()
    plat = platform.current()
    graphs_reason = graph_api(model.device)[1]
    report = {
        "model": source, "platform": plat.name, "real_platform": plat.real, "device": str(model.device),
        "dtype": str(model.dtype).replace("torch.", ""), "plan": impls,
        "decode_graphs": graphs_reason is None, "decode_graphs_reason": graphs_reason,
        "prefill_tokens": timing.prefill_tokens, "prefill_tokens_per_s": round(timing.rate("prefill"), 1),
        "decode_tokens": timing.decode_tokens, "decode_tokens_per_s": round(timing.rate("decode"), 1),
        "results": [{"prompt_ids": r.prompt_ids, "token_ids": r.token_ids, "text": r.text,
                     "finish_reason": r.finish_reason} for r in results],
    }
    if args.json:
        print(json.dumps(report))
        return 0
    sim = f" (simulated; real {plat.real})" if plat.simulated else ""
    print(f"model     {source}")
    print(f"platform  {plat.name}{sim}   device {report['device']}   dtype {report['dtype']}")
    print("decode    " + ("captured device graphs" if graphs_reason is None else f"eager ({graphs_reason})"))
    print("\ndispatch plan (op -> implementation):")
    for name, chosen in impls.items():
        print(f"  {name:<24} -> " + ", ".join(f"{i} ({p})" for i, p in chosen.items()))
    print()
    for i, r in enumerate(results):
        shown = r.text if r.text is not None else " ".join(map(str, r.token_ids))
        print(f"[{i}] {len(r.prompt_ids)} prompt tokens -> {len(r.token_ids)} new ({r.finish_reason}): {shown}")
    print(f"\nprefill {timing.prefill_tokens} tokens at {report['prefill_tokens_per_s']} tokens/s; "
          f"decode {timing.decode_tokens} tokens at {report['decode_tokens_per_s']} tokens/s "
          f"(batch {len(prompts)})")
    return 0
