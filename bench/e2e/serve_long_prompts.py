"""Long prompts beside running decodes, served (issue 35): 64 short streams decode while 8
prompts of 32,768 tokens arrive at once, on one `kernelgate serve`. Reports the long prompts'
TTFT (p50 / p99) against the offline time to prefill all of them (`kernelgate.generate` on the
same checkpoint, wall time of the call), and the short streams' inter-token latency while
the long prompts prefill (p50 / p99) against their ITL alone. Target: TTFT p99 <= 1.15 x offline.

    PYTHONPATH=. python bench/e2e/serve_long_prompts.py --model /tmp/kernelgate-ckpt/kimi-4l
    PYTHONPATH=. python bench/e2e/serve_long_prompts.py --tiny                     # dry run on any machine
    ... --repeat 3                      # three bursts beside the same streams, three offline runs: medians
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_prefix import serve, timeline, write_checkpoint  # noqa: E402


def bench_args(base, n, conc, inp, out, seed):
    return [sys.executable, "-m", "kernelgate", "bench", "serve", "--base-url", base, "--json", "--num-prompts",
            str(n), "--max-concurrency", str(conc), "--input-len", str(inp), "--output-len", str(out), "--seed",
            str(seed)]


def main() -> None:
    import json
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder, written there (random weights, --layers) when it has no "
                                     "config.json (default /tmp/kernelgate-ckpt/kimi-<layers>l)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--num-long", type=int, default=8)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--short-output", type=int, default=1024,
                    help="tokens each short stream decodes: enough to outlast the long prompts' prefill (the 256 "
                         "of Sessions 16-17 ended before the long prompts arrived once the steps were fast)")
    ap.add_argument("--trace", metavar="DIR", help="the server at log level debug: a summary of the engine's "
                                                  "steps while the long prompts run, and every step line in DIR")
    ap.add_argument("--repeat", type=int, default=1,
                    help="bursts of long prompts, one after another beside the same short streams (fresh prompts "
                         "each), and as many offline runs: each burst's p99 against the offline median, and "
                         "their median (one burst's p99 is the slowest of 8 prompts: runs differ by ~0.1x)")
    ap.add_argument("--decodes-in-budget", action="store_true",
                    help="serve with --decode-tokens-in-budget: the long prompts' chunks take what the 64 streams' "
                         "decodes leave of the budget (vLLM's policy) instead of the whole budget with the decodes "
                         "on top (SGLang's mixed chunks, the default since Session 23)")
    a = ap.parse_args()
    if a.tiny:
        a.long, a.short, a.num_long = 512, 8, 4
    elif not a.model:
        a.model = f"/tmp/kernelgate-ckpt/kimi-{a.layers}l"
    if a.model and not (Path(a.model) / "config.json").exists():
        write_checkpoint(Path(a.model), a.layers)
    srv, base, log = serve(None if a.tiny else a.model, ["--max-num-seqs", str(a.short + a.num_long),
                                                       "--max-model-len", str(a.long + 64)]
                           + (["--log-level", "debug"] if a.trace else [])
                           + (["--decode-tokens-in-budget"] if a.decodes_in_budget else []))
    bursts = []
    try:
        subprocess.run(bench_args(base, 8, 8, 16, 4, 0), capture_output=True, check=True)
        alone = json.loads(subprocess.run(bench_args(base, a.short, a.short, 128, 64, 1), capture_output=True,
                                          text=True, check=True).stdout.strip().splitlines()[-1])
        # the short streams long enough to outlast every burst's prefill; the long ones join after 1 s
        out_len = min((a.short_output if not a.tiny else 48) * a.repeat, a.long + 64 - 128)
        shorts = subprocess.Popen(bench_args(base, a.short, a.short, 128, out_len, 2), stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        for r in range(a.repeat):
            mark = os.path.getsize(log)
            bursts.append(json.loads(subprocess.run(bench_args(base, a.num_long, a.num_long, a.long, 16, 3 + r),
                                                    capture_output=True, text=True, check=True
                                                    ).stdout.strip().splitlines()[-1]))
            if a.trace:
                line, lines = timeline(log, mark)
                print(f"  [long prompts beside decodes, burst {r + 1}] {line}", flush=True)
                Path(a.trace).mkdir(parents=True, exist_ok=True)
                Path(a.trace, f"long-prompts{'' if r == 0 else f'-{r + 1}'}.log").write_text("\n".join(lines))
        short = json.loads(shorts.communicate()[0].strip().splitlines()[-1])
        late = [ln.strip() for ln in open(log) if "built during serving" in ln]   # (serving/late_compiles.py)
        print(f"kernels the server built after its warm-up: {len(late)}", *late[:20], sep="\n  ", flush=True)
    finally:
        srv.terminate()
        srv.wait(60)
    # offline: the same long prompts' prefill rate through generate() on the checkpoint
    import statistics

    import torch

    import kernelgate
    from kernelgate.cli.model import builtin_model
    from kernelgate.serving.drive import Timing
    model = builtin_model() if a.tiny else kernelgate.load_model(a.model)
    g = torch.Generator().manual_seed(3)

    def prompts():
        return [torch.randint(0, model.config.vocab_size, (a.long,), generator=g).tolist() for _ in range(a.num_long)]
    # warm: the same call on other prompts, so the timed ones reuse generate()'s kept engine (an
    # engine built inside the timed call -- its cache, graphs and warm-up -- would inflate the
    # baseline) and find nothing of their prompts in the prefix cache, which is on as in the server
    kernelgate.generate(model, prompts(), max_new_tokens=1, max_model_len=a.long + 64)
    offline = []
    for r in range(a.repeat):
        t, t0 = Timing(), time.perf_counter()
        got = kernelgate.generate(model, prompts(), max_new_tokens=1, max_model_len=a.long + 64, timing=t)
        offline.append(time.perf_counter() - t0)
        assert not any(r.num_cached_tokens for r in got), "the timed prompts hit the prefix cache"
        # the offline steps one by one: a step far above its neighbours is a first-use cost or a bad shape
        print(f"offline run {r + 1} steps (kind tokens ms): "
              + ", ".join(f"{k[0]}{n}:{s * 1e3:.0f}" for k, n, s in t.steps), flush=True)
    base_s = statistics.median(offline)
    ratios = [b["p99_ttft_ms"] / 1e3 / base_s for b in bursts]
    print("\n| figure | value | against |\n|---|---:|---|")
    print(f"| offline prefill of {a.num_long} x {a.long} tokens | {base_s:.2f} s ({a.num_long * a.long / base_s:,.0f} "
          f"tok/s){' median of ' + ', '.join(f'{x:.2f}' for x in offline) if a.repeat > 1 else ''} | |")
    for r, b in enumerate(bursts):
        name = "long prompts' TTFT p50 / p99" + (f", burst {r + 1}" if a.repeat > 1 else "")
        print(f"| {name} | {b['median_ttft_ms'] / 1e3:.2f} / {b['p99_ttft_ms'] / 1e3:.2f} s | "
              f"p99 = {ratios[r]:.2f} x offline (target <= 1.15) |")
    if a.repeat > 1:
        print(f"| p99 / offline, median of {a.repeat} bursts | {statistics.median(ratios):.2f} x | target <= 1.15 |")
    print(f"| short streams' ITL p50 / p99 with the long prompts | {short['median_itl_ms']:.1f} / "
          f"{short['p99_itl_ms']:.1f} ms | alone: {alone['median_itl_ms']:.1f} / {alone['p99_itl_ms']:.1f} ms |")


if __name__ == "__main__":
    main()
