"""`kernelgate serve` under load vs offline, on one GPU (issue 19's numbers).

Builds the 4-layer real-width Kimi Linear (seeded, bf16), then
  1. offline: 64 prompts of --input-len token ids, --output-len tokens each, through one
     `Engine` at max_num_seqs 64 -> output tokens/s and the mean decode step;
  2. serves the same model in-process (uvicorn in a thread, the real app and AsyncEngine)
     and checks that 8 greedy requests return the offline tokens exactly;
  3. `kernelgate bench serve` against it at concurrency 64 and 1 (ignore_eos: exact lengths).
Prints a table with the issue's targets: c64 output tok/s >= 0.85 x offline; c1 TTFT p50
<= 30 ms (128-token prompt); c1 ITL p50 <= 1.3 x the offline decode step.

    python bench/serve_e2e.py                      # cuda, 4 layers, bf16
    python bench/serve_e2e.py --platform xpu       # the XPU dispatch choices, simulated on this GPU
    python bench/serve_e2e.py --tiny --dtype float32 --concurrency 4 --input-len 8 --output-len 8   # CPU smoke
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--platform", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="the built-in small config (a CPU smoke run)")
    a = ap.parse_args()
    if a.platform:
        os.environ["KERNELGATE_PLATFORM"] = a.platform
    import random

    import torch
    import uvicorn

    from kernelgate import registry
    from kernelgate.cli import bench_serve
    from kernelgate.engine.async_engine import AsyncEngine
    from kernelgate.engine.engine import Engine
    from kernelgate.engine.sampling import SamplingParams
    from kernelgate.models import build, real_width, tiny
    from kernelgate.platform import default_device
    from kernelgate.server.app import create_app
    from kernelgate.server.jobs import ModelInfo
    from kernelgate.server.metrics import Metrics
    registry.refresh()
    dev = default_device()
    model = build(tiny() if a.tiny else real_width(a.layers), device=dev, dtype=getattr(torch, a.dtype), seed=0)
    V, N = model.config.vocab_size, a.concurrency
    max_len = a.input_len + a.output_len + 16
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(a.input_len)] for _ in range(N)]
    engine = Engine(model, max_num_seqs=N, max_model_len=max_len)

    def offline(ps, n):
        for i, p in enumerate(ps):
            engine.add_request(f"o{i}", p, SamplingParams(max_new_tokens=n))
        toks = {f"o{i}": [] for i in range(len(ps))}
        steps = []
        while engine.has_unfinished():
            torch.accelerator.synchronize() if dev.type != "cpu" else None
            t0 = time.perf_counter()
            outs = engine.step()
            torch.accelerator.synchronize() if dev.type != "cpu" else None
            steps.append(time.perf_counter() - t0)
            for o in outs:
                toks[o.request_id] += o.new_token_ids
        return [toks[f"o{i}"] for i in range(len(ps))], steps
    offline(prompts[:4], 4)                                  # warm-up: dispatch, graphs
    t0 = time.perf_counter()
    ref, steps = offline(prompts, a.output_len)
    off_s = time.perf_counter() - t0
    off_tps = sum(len(r) for r in ref) / off_s
    step_b64 = sorted(steps[1:])[len(steps[1:]) // 2]
    _, steps1 = offline(prompts[:1], a.output_len)
    step_b1 = sorted(steps1[1:])[len(steps1[1:]) // 2]

    metrics = Metrics("bench")
    aengine = AsyncEngine(engine, observer=metrics).start()
    info = ModelInfo("bench", None, max_len, V, [])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(aengine, info, metrics), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"

    import httpx
    async def check():
        async with httpx.AsyncClient(timeout=600) as c:
            rs = await asyncio.gather(*(c.post(f"{base}/v1/completions", json={
                "prompt": p, "max_tokens": a.output_len, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}) for p in prompts[:8]))
        return [r.json()["choices"][0]["token_ids"] for r in rs]
    got = asyncio.run(check())
    same = sum(g == r for g, r in zip(got, ref[:8]))

    def bench(conc, num):
        args = bench_serve.parser(argparse.ArgumentParser).parse_args([
            "--base-url", base, "--num-prompts", str(num), "--max-concurrency", str(conc),
            "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--seed", "0"])
        return asyncio.run(bench_serve._bench(args))
    bench(min(8, N), min(8, N))                               # warm-up of the HTTP path
    r64 = bench(N, 2 * N)
    r1 = bench(1, 16)
    server.should_exit = True
    th.join(30)

    print(f"\nkernelgate serve vs offline — {torch.cuda.get_device_name() if dev.type == 'cuda' else dev}, "
          f"{a.layers} layers real width, {a.dtype}, platform {os.environ.get('KERNELGATE_PLATFORM') or 'native'}, "
          f"prompts {a.input_len} -> {a.output_len} tokens")
    print(f"greedy server == offline tokens: {same}/8")
    print(bench_serve.table(r64))
    rows = [
        (f"c{N} output tok/s", r64["output_throughput"], f">= 0.85 x offline {off_tps:.0f}",
         r64["output_throughput"] / off_tps >= 0.85),
        ("c1 TTFT p50 (ms)", r1["median_ttft_ms"], "<= 30", r1["median_ttft_ms"] <= 30),
        ("c1 ITL p50 (ms)", r1["median_itl_ms"], f"<= 1.3 x offline b1 step {step_b1 * 1e3:.2f}",
         r1["median_itl_ms"] <= 1.3 * step_b1 * 1e3),
        (f"c{N} ITL p50 (ms)", r64["median_itl_ms"], f"offline b{N} step {step_b64 * 1e3:.2f}", None),
        (f"c{N} TTFT p50 / p99 (ms)", r64["median_ttft_ms"], f"p99 {r64['p99_ttft_ms']:.1f}", None),
    ]
    print("\n| metric | server | target | ok |\n|---|---:|---|---|")
    for name, v, target, ok in rows:
        print(f"| {name} | {v:.2f} | {target} | {'' if ok is None else ('yes' if ok else 'NO')} |")


if __name__ == "__main__":
    main()
