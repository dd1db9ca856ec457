"""Fed: RESULTS.md, 'Session 5 (2026-11-30) ... Tensor parallel, 4 layers, bf16' -- the follow-up to its
"TP decodes eagerly (collectives not captured yet)" (this probe's own results were not recorded there).

Tensor parallel decode through captured graphs: a smoke check on two GPUs (a minute).

    PYTHONPATH=. python bench/probes/tp_graphs.py [--tp 2] [--layers 0]

The built-in tiny model (--layers 0; or N layers at Kimi-Linear widths) in fp32: greedy tokens
at TP=N (expert parallel on, then off) must equal the single-process model's, every rank must
report captured decode graphs (NCCL all-reduces inside; `graphs_off` says why not), and the
captured TP step's logits must match the eager TP step's. Prints one JSON line per check.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0)
    args = ap.parse_args()
    import torch

    import kernelgate
    from kernelgate.executor.parallel import parallelize
    from kernelgate.models import build, real_width, tiny
    cfg = tiny() if args.layers == 0 else real_width(args.layers)
    dtype = torch.float32 if args.layers == 0 else torch.bfloat16
    model = build(cfg, device="cuda", dtype=dtype, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist() for n in (1, 5, 17, 40, 3)]
    kw = dict(max_new_tokens=24, stop_token_ids=[], max_model_len=96)
    want = [r.token_ids for r in kernelgate.generate(model, prompts, **kw)]
    for ep in (True, False):
        t0 = time.time()
        pm = parallelize(model, args.tp, ep)
        got = [r.token_ids for r in kernelgate.generate(pm, prompts, **kw)]
        stats = pm.rank_stats()                   # the graphs of the engine just run
        eager = [r.token_ids for r in kernelgate.generate(pm, prompts, graphs=False, **kw)]
        same = sum(a == b for a, b in zip(got, want))
        print(json.dumps({"tp": args.tp, "ep": ep, "greedy_equal_single": f"{same}/{len(want)}",
                          "graphs_equal_eager": got == eager,
                          "graphs": [s["graphs"] for s in stats], "graphs_off": [s["graphs_off"] for s in stats],
                          "peak_gib": [round((s["peak_bytes"] or 0) / 2**30, 2) for s in stats],
                          "s": round(time.time() - t0, 1)}), flush=True)
        pm.close()


if __name__ == "__main__":
    main()
