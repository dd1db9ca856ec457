"""Does greedy output depend on how requests are batched? (issue 19: served tokens != offline)

Builds the 4-layer real-width Kimi Linear (seeded) and runs the same greedy prompts through one
Engine composed several ways -- each prompt alone, 8 together, 64 together, 8 with the
synchronous engine, 8 arriving one step apart (as HTTP requests do) -- and compares each
prompt's tokens with the prompt run alone. At the first token that differs it prints the gap
between the two most likely tokens (nats, from the run alone): a near-tie (gap below the
dtype's noise) is rounding in a differently shaped batch; a large gap is a bug. The first
token is also checked against a plain forward of the model (no engine, no cache).

    python bench/e2e/greedy_consistency.py --dtype bfloat16
    python bench/e2e/greedy_consistency.py --dtype float32
    python bench/e2e/greedy_consistency.py --tiny --dtype float32 --n 4 --input-len 8 --output-len 8   # CPU
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the repo root


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    a = ap.parse_args()

    import random

    import torch

    from kernelgate.engine import Engine, SamplingParams
    from kernelgate.models import build, real_width, tiny
    from kernelgate.platform import default_device
    dev = default_device()
    dtype = getattr(torch, a.dtype)
    model = build(tiny() if a.tiny else real_width(a.layers), device=dev, dtype=dtype, seed=0)
    V = model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(a.input_len)] for _ in range(a.n)]
    few = min(8, a.n)
    sp = SamplingParams(max_new_tokens=a.output_len, stop_token_ids=(), logprobs=2)

    def run(ps, stagger=False, **kw):
        eng = Engine(model, max_num_seqs=max(len(ps), 1), max_model_len=a.input_len + a.output_len + 8, **kw)
        outs = {i: ([], []) for i in range(len(ps))}
        pending = list(enumerate(ps))
        if not stagger:
            for i, p in pending:
                eng.add_request(str(i), p, sp)
            pending = []
        while pending or eng.has_unfinished():
            if pending:
                i, p = pending.pop(0)
                eng.add_request(str(i), p, sp)
            for o in eng.step():
                ids, lps = outs[int(o.request_id)]
                ids.extend(o.new_token_ids)
                lps.extend(o.logprobs or [])
        eng.close()
        return [outs[i] for i in range(len(ps))]

    alone = [run([p])[0] for p in prompts[:few]]
    # the first token from a plain forward of the prompt (no engine, no cache)
    with torch.no_grad():
        plain = [int(model(torch.tensor([p], device=dev))[0, -1].float().argmax()) for p in prompts[:few]]
    print(f"{'tiny' if a.tiny else f'{a.layers} layers real width'}, {a.dtype}, {dev}; "
          f"{few} prompts of {a.input_len} tokens, {a.output_len} greedy tokens")
    print(f"plain forward first token == engine alone: {sum(p == t[0][0] for p, t in zip(plain, alone))}/{few}")
    ways = {"alone, again": [run([p])[0] for p in prompts[:few]],
            f"{few} together": run(prompts[:few]),
            f"{few} together, sync engine": run(prompts[:few], async_scheduling=False),
            f"{few} arriving a step apart": run(prompts[:few], stagger=True),
            f"{a.n} together": run(prompts)[:few],
            f"{few} together, no graphs": run(prompts[:few], graphs=False)}
    print(f"{'composition':34s} {'same':>6s} {'agreeing prefix (min / mean)':>30s}  first differences (token: top-2 gap nats)")
    for name, got in ways.items():
        same, prefixes, diffs = 0, [], []
        for (ref, lps), (ids, _) in zip(alone, got):
            k = next((j for j, (x, y) in enumerate(zip(ref, ids)) if x != y), len(ref))
            same += k == len(ref)
            prefixes.append(k)
            if k < len(ref):
                top = sorted((v for _, v in lps[k].top), reverse=True)
                diffs.append(f"{k}: {top[0] - top[1]:.3g}")
        print(f"{name:34s} {same:>3d}/{few:<2d} {min(prefixes):>14d} / {sum(prefixes) / len(prefixes):<13.1f}  "
              f"{', '.join(diffs[:6])}")
    g = sorted(max(v for _, v in e.top) - min(v for _, v in e.top) for _, lps in alone for e in lps)
    print(f"top-2 gap over every greedy token alone: min {g[0]:.3g}, 10th pct {g[len(g) // 10]:.3g}, "
          f"median {g[len(g) // 2]:.3g} nats")


if __name__ == "__main__":
    main()
