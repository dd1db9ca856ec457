"""Where a resumed prompt's step goes (issue 36: a question after a cached 32k-token document
took a step as long as an 8,192-token chunk): a document + question through
`kernelgate.generate` on one engine, then another question over the same document under the
torch profiler -- the step's wall time, and the kernels and host calls that take it.

    PYTHONPATH=. python bench/probes/resumed_step.py [--layers 4] [--doc 32768] [--question 64]
    PYTHONPATH=. python bench/probes/resumed_step.py --tiny --device cpu --doc 600      # smoke run
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--doc", type=int, default=32768)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    import kernelgate
    from kernelgate.models import build, real_width, tiny
    from kernelgate.platform import default_device
    from kernelgate.serving.warmup import warm_up
    dev = torch.device(a.device) if a.device else default_device()
    cfg = tiny(num_hidden_layers=a.layers) if a.tiny else real_width(a.layers)
    model = build(cfg, device=dev, dtype=torch.float32 if a.tiny else torch.bfloat16, seed=0)
    eng = kernelgate.Engine(model, max_num_seqs=4, max_model_len=a.doc + 4 * a.question)
    warm_up(eng, log=lambda m: print(m, flush=True))
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(0, cfg.vocab_size, (a.doc,), generator=g).tolist()
    qs = [torch.randint(0, cfg.vocab_size, (a.question,), generator=g).tolist() for _ in range(4)]

    def ask(i):
        t0 = time.perf_counter()
        r = kernelgate.generate(model, [doc + qs[i]], max_new_tokens=1, stop_token_ids=(), engine=eng)[0]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, r.num_cached_tokens
    for i in range(3):
        dt, cached = ask(i)
        print(f"question {i}: {dt * 1e3:.1f} ms, {cached} tokens cached", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        dt, cached = ask(3)
    print(f"question 3 (profiled): {dt * 1e3:.1f} ms, {cached} tokens cached")
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=a.top, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=a.top, max_name_column_width=60))
    eng.close()


if __name__ == "__main__":
    main()
