"""The engine's host work per decode step, alone: the real Engine, scheduler, block manager,
decode-graph bookkeeping and sampling, over a stand-in model whose step returns fixed logits
and a stand-in graph whose replay does nothing (so it runs on a CPU and measures only Python
and the host side of torch calls). On a GPU the same loop bounds the step from below: a
decode step whose graph replays faster than this is host-bound.

    PYTHONPATH=. python bench/e2e/host_step.py [--batches 1,8,64] [--context 1024] [--steps 300] [--profile]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time

import torch


class _Graph:
    def replay(self):
        pass


@contextlib.contextmanager
def _capture(graph, pool=None):
    yield


def engine_for(B: int, ctx: int, device: str):
    from kernelgate.engine import Engine, SamplingParams
    from kernelgate.executor import graphs as G
    from kernelgate.executor import model_runner as MR
    from kernelgate.models import build, tiny
    model = build(tiny(), device, torch.float32)
    fake = lambda dev: ((_Graph, _capture, lambda: None), None)  # noqa: E731
    G.graph_api, MR.graph_api = fake, fake
    eng = Engine(model, max_num_seqs=B, max_model_len=ctx + 4096, max_num_batched_tokens=8192,
                 num_cache_blocks=B * (-(-(ctx + 4096) // 64)) + 8)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    for i in range(B):
        eng.add_request(str(i), torch.randint(3, V, (ctx,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=4000, stop_token_ids=()))
    while any(len(r.output) < 2 for r in eng.requests.values()):
        eng.step()                                      # the real model prefills
    logits = torch.randn(max(B, 1) * 2, V, device=device)

    def step(tokens, batch, cache):                    # the stand-in decode: fixed logits
        return logits[:batch.num_seqs]
    model.step = step
    return eng


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="cProfile the steps of the first batch size")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    print("| batch | host us per decode step |\n|---:|---:|")
    for k, B in enumerate(int(b) for b in a.batches.split(",")):
        eng = engine_for(B, a.context, a.device)
        for _ in range(20):
            eng.step()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        us = (time.perf_counter() - t0) * 1e6 / a.steps
        print(f"| {B} | {us:.0f} |", flush=True)
        if a.profile and k == 0:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.steps):
                eng.step()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
