"""generate() keeps its engine (issue 33, item 5): the per-call wall time of repeated
`kernelgate.generate(model, prompts)` calls against the same calls on an Engine passed in, and
each call's decode ms / step. 4 layers at real width, bf16, random weights, batch 1.

    PYTHONPATH=. python bench/e2e/generate_reuse.py [--layers 4] [--new 257] [--calls 3]
    PYTHONPATH=. python bench/e2e/generate_reuse.py --tiny --device cpu        # smoke run

Check first: the kept engine's tokens equal the passed-in engine's (greedy).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, default=257)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    import kernelgate
    from kernelgate.models import build, real_width, tiny
    from kernelgate.platform import default_device
    from kernelgate.serving.drive import Timing
    dev = torch.device(a.device) if a.device else default_device()
    cfg = tiny(num_hidden_layers=a.layers) if a.tiny else real_width(a.layers)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    model = build(cfg, device=dev, dtype=dtype, seed=0)
    prompt = torch.randint(0, cfg.vocab_size, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    kw = dict(max_new_tokens=a.new, stop_token_ids=())

    def call(**extra):
        t = Timing()
        t0 = time.perf_counter()
        out = kernelgate.generate(model, [prompt], timing=t, **kw, **extra)
        wall = time.perf_counter() - t0
        dec = [s for k, n, s in t.steps if k == "decode"]
        return out[0].token_ids, wall, statistics.median(dec) * 1e3 if dec else float("nan")

    rows = []
    for i in range(a.calls):                       # the engine generate() keeps on the model
        toks, wall, step = call()
        rows.append((f"generate() call {i + 1} (kept engine)", wall, step))
    kept_toks = toks
    eng = kernelgate.Engine(model, max_num_seqs=1, max_model_len=a.prompt + a.new)
    for i in range(a.calls):
        toks, wall, step = call(engine=eng)
        rows.append((f"generate(engine=...) call {i + 1}", wall, step))
    eng.close()
    assert toks == kept_toks, "kept engine and passed-in engine disagree"
    reused = min(w for name, w, _ in rows if "engine=" in name)
    print(f"\n{a.layers} layers {'tiny' if a.tiny else 'real width'}, {dtype}, batch 1, prompt {a.prompt}, "
          f"{a.new} new tokens, {torch.cuda.get_device_name() if dev.type == 'cuda' else dev}")
    print("| call | wall s | tok/s (wall) | decode ms/step | wall vs reused engine |")
    print("|---|---:|---:|---:|---:|")
    for name, wall, step in rows:
        print(f"| {name} | {wall:.3f} | {a.new / wall:.0f} | {step:.3f} | {reused / wall:.2f}x |")


if __name__ == "__main__":
    main()
