"""Why a decode step at long context costs more than at 1k: the engine (4 layers real width, bf16,
decode graphs) decodes B sequences of a given context; 20 steps are timed wall-clock, then 10
are profiled, and the device kernels are listed per step, side by side for the contexts (the
kernels whose time grows with context are the answer). Issue 15's end-to-end target: the step
at 128k <= 1.25 x the step at 1k.

    PYTHONPATH=. python bench/e2e/decode_context.py [--contexts 1024,131072] [--batches 1,8] [--tiny]
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile


def run(model, ctx: int, B: int, dev, steps: int = 20, prof_steps: int = 10, cprofile: bool = False):
    """-> (wall ms per step, {kernel: device us per step}, device busy us per step)."""
    from kernelgate.engine import Engine, SamplingParams
    vocab = model.config.vocab_size
    # the prompts prefill one after another (a chunk a step) and each sequence decodes from its own
    # prefill on: it must outlast the others' prefills plus the measured steps, or "B8" at a long
    # context would time the few sequences left
    budget = 8192
    new = 6 + steps * (2 if cprofile else 1) + prof_steps + 8 + (B - 1) * (-(-ctx // (budget - B)) + 1)
    eng = Engine(model, max_num_seqs=B, max_model_len=ctx + new + 16, max_num_batched_tokens=budget, block_size=64,
                 num_cache_blocks=B * -(-(ctx + new + 16) // 64))
    g = torch.Generator().manual_seed(ctx + B)
    for i in range(B):
        prompt = torch.randint(1, vocab, (ctx,), generator=g).tolist()
        eng.add_request(str(i), prompt, SamplingParams(max_new_tokens=new, stop_token_ids=()))
    for _ in range(10_000):                    # prefill, then a few decode steps (graph capture)
        eng.step()
        if all(len(r.output) >= 6 for r in eng.requests.values()):
            break
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    graphs = getattr(eng.runner.graphs, "graphs", None) or {}
    keys = [k for k in graphs if k[0] == 1 << max(0, B - 1).bit_length()]
    if keys and dev.type == "cuda":            # the captured step alone, replayed back to back
        g = graphs[max(keys, key=lambda k: k[1])].graph
        g.replay()
        sync()
        t1 = time.perf_counter()
        for _ in range(steps):
            g.replay()
        sync()
        run.replay_ms = (time.perf_counter() - t1) * 1e3 / steps
    else:
        run.replay_ms = float("nan")
    if cprofile:                               # the host's Python per step, by own time
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            eng.step()
        sync()
        pr.disable()
        print(f"\n#### host functions, ctx {ctx:,} B{B}, {steps} steps (cProfile)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(prof_steps):
            eng.step()
        sync()
    per, calls = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            per[e.key[:70]] += e.self_device_time_total / prof_steps
            calls[e.key[:70]] += e.count / prof_steps
    eng.close()
    run.calls = calls
    return wall, per, sum(per.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--cprofile", action="store_true", help="also cProfile the timed steps (host functions)")
    ap.add_argument("--list", action="store_true",
                    help="also list every kernel of the first context's step (time, launches per step)")
    ap.add_argument("--tiny", action="store_true", help="the built-in tiny model on the CPU (smoke run)")
    a = ap.parse_args()
    from kernelgate.models import build, real_width, tiny
    dev = torch.device("cpu" if a.tiny else "cuda")
    model = build(tiny() if a.tiny else real_width(a.layers), dev, torch.bfloat16)
    ctxs = [int(c) for c in a.contexts.split(",")]
    for B in (int(b) for b in a.batches.split(",")):
        res, calls = {}, {}
        for c in ctxs:
            res[c] = run(model, c, B, dev, cprofile=a.cprofile)
            calls[c] = run.calls
            print(f"ctx {c:,} B{B}: engine step {res[c][0]:.3f} ms, its decode graph replayed alone "
                  f"{run.replay_ms:.3f} ms", flush=True)
        print(f"\n### B={B}: " + ", ".join(f"ctx {c:,}: wall {w:.3f} ms/step, device busy {d:.0f} us/step"
                                          for c, (w, _, d) in res.items())
              + f"; ratio {res[ctxs[-1]][0] / res[ctxs[0]][0]:.2f}x")
        last = res[ctxs[-1]][1]
        names = sorted(set().union(*(r[1] for r in res.values())), key=lambda k: -(last[k] - res[ctxs[0]][1][k]))
        print("| kernel (by growth with context) | " + " | ".join(f"{c:,} us/step" for c in ctxs) + " |")
        print("|---|" + "---:|" * len(ctxs))
        for k in names[:a.top]:
            print(f"| {k} | " + " | ".join(f"{res[c][1][k]:.1f}" for c in ctxs) + " |")
        if a.list:
            first, c0 = res[ctxs[0]][1], ctxs[0]
            print(f"\n#### every kernel of a step, ctx {c0:,} B{B}: {sum(calls[c0].values()):.0f} launches, "
                  f"{sum(first.values()):.0f} us\n| kernel | us/step | launches/step |\n|---|---:|---:|")
            for k in sorted(first, key=lambda k: -first[k]):
                print(f"| {k} | {first[k]:.1f} | {calls[c0][k]:.0f} |")


if __name__ == "__main__":
    main()
