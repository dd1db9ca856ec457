"""Does programmatic dependent launch change any result? (ops/common/pdl.py)

Each model, 4 layers at real width with seeded random weights: one decode step through a captured
device graph from the same engine state, with PDL on and off (KERNELGATE_PDL), at batch 1 (the
one-token GEMVs: linear, experts) and 5 (padded to 8); the logits must be bitwise equal (the same
kernels in the same order: only the launch differs), and greedy tokens over `--new` steps equal.
Also the graph step against the same step run eagerly (rel err).

    PYTHONPATH=. python bench/probes/pdl_bitwise.py [--models qwen,kimi,kimi-fp8] [--new 16]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import kimi_e2e  # noqa: E402

from kernelgate import platform  # noqa: E402
from kernelgate.engine import SamplingParams  # noqa: E402
from kernelgate.models.batch import StepBatch  # noqa: E402
from kernelgate.tools.testing import rel_err  # noqa: E402


def build(name, device):
    if name == "qwen":
        import qwen_e2e
        from kernelgate.models import Qwen3NextConfig
        from kernelgate.models.qwen3_next import build as b
        return b(Qwen3NextConfig.from_dict(qwen_e2e.hf_config(4, False).to_dict()), device=device,
                 dtype=torch.bfloat16, seed=0)
    from kernelgate.models.config import real_width
    from kernelgate.models.kimi_linear import build as b
    return b(real_width(4), device=device, dtype=torch.bfloat16, seed=0,
             quantization="fp8" if name == "kimi-fp8" else None)


def pdl(on: bool):
    os.environ["KERNELGATE_PDL"] = "1" if on else "0"
    platform.refresh()


def prefilled(model, batch, prompt):
    """A fresh engine that has prefilled `batch` seeded prompts (one step)."""
    eng = kimi_e2e._engine(model, batch, prompt + 8, async_scheduling=False)
    g = torch.Generator().manual_seed(2)
    for i in range(batch):
        eng.add_request(str(i), torch.randint(0, 1000, (prompt - i,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=4))
    eng.step()
    return eng


def one_step(model, batch, prompt=40):
    """(graph logits, eager logits) of one decode step after a prefill, each from its own engine."""
    eng = prefilled(model, batch, prompt)
    reqs = eng.scheduler.running
    tokens, slots = [r.output[-1] for r in reqs], [r.slot for r in reqs]
    starts, tables = [r.num_computed for r in reqs], [list(r.blocks) for r in reqs]
    graph = eng.runner.graphs.run(tokens, slots, starts, tables).float().clone()
    eng.close()                  # (the graph step wrote its states: the eager step gets the same state anew)
    eng = prefilled(model, batch, prompt)
    eager = model.step(torch.tensor(tokens, device=model.device),
                       StepBatch.build([1] * batch, slots, starts, model.device, tables, 64), eng.runner.cache).float()
    eng.close()
    return graph, eager


def greedy(model, batch, new, prompt=40):
    eng = kimi_e2e._engine(model, batch, prompt + new + 8)
    g = torch.Generator().manual_seed(5)
    toks = {str(i): [] for i in range(batch)}
    for i in range(batch):
        eng.add_request(str(i), torch.randint(0, 1000, (prompt + i,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=new))
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
    eng.close()
    return toks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen,kimi,kimi-fp8")
    ap.add_argument("--batches", default="1,5")
    ap.add_argument("--new", type=int, default=16)
    a = ap.parse_args()
    dev = torch.device("cuda")
    print("| model | B | graph logits PDL on == off | graph vs eager (PDL on) rel err | greedy tokens equal |")
    print("|---|---:|---|---:|---|")
    bad = 0
    for name in a.models.split(","):
        model = build(name, dev)
        for b in (int(x) for x in a.batches.split(",")):
            out = {}
            for on in (False, True):
                pdl(on)
                out[on] = one_step(model, b) + (greedy(model, b, a.new),)
            same = torch.equal(out[True][0], out[False][0])
            toks = out[True][2] == out[False][2]
            err = rel_err(out[True][0], out[True][1])
            bad += (not same) + (not toks)
            print(f"| {name} | {b} | {same} | {err:.1e} | {toks} |", flush=True)
        del model
        torch.cuda.empty_cache()
    pdl(True)
    print("PDL_BITWISE", "FAIL" if bad else "OK")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
