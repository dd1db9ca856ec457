"""`kernelgate serve` under load vs offline `generate()`, on one GPU (issue 19's numbers).

For each platform (`--platform native,xpu`: each in its own process, since the dispatch
platform is fixed at import), builds the 4-layer real-width Kimi Linear (seeded, bf16), then
  1. offline: `kernelgate.generate()` of 64 prompts of --input-len token ids, --output-len
     tokens each, on one Engine at max_num_seqs 64 -> output tokens/s; the same for one
     prompt -> the median decode step at batch 1 (and at 64);
  2. serves the same Engine in-process (the real app and AsyncEngine; uvicorn in a thread),
     checks that 8 greedy requests return the offline tokens, and runs `kernelgate bench
     serve` at concurrency 64 and 1 (ignore_eos: exact lengths);
  3. long prompts under load, on a fresh Engine sized for them: --short-streams clients keep
     streaming short requests (128-token prompts) while --long-prompts streaming requests of
     --long-len tokens arrive at once; all long ones must complete; reports the short
     streams' inter-token latency before and during the long prefills, the long requests'
     TTFT, errors (non-finite logits end a request with finish reason "error"), and whether
     one long request's greedy tokens equal offline generate()'s.
Prints one table with the issue's targets: c64 output tok/s >= 0.85 x offline; c1 TTFT p50
<= 30 ms (128-token prompt); c1 ITL p50 <= 1.3 x the offline decode step at batch 1.

    python bench/e2e/serve_e2e.py                            # cuda, native dispatch
    python bench/e2e/serve_e2e.py --platform native,xpu      # + the XPU choices simulated on this GPU
    python bench/e2e/serve_e2e.py --model DIR --long-prompts 0   # a checkpoint of any family (qwen_e2e.py writes one)
    python bench/e2e/serve_e2e.py --tiny --dtype float32 --concurrency 4 --input-len 8 --output-len 8 \\
        --long-prompts 2 --long-len 200 --short-streams 2    # CPU smoke

Needs (beyond torch): starlette, uvicorn, pydantic, prometheus_client, httpx -- no FastAPI,
no OpenTelemetry, no openai client. The H200 image has prometheus_client, httpx (+ anyio,
h11, httpcore), click and uvloop; carry the rest as wheels in .whl/ (starlette, uvicorn,
pydantic, pydantic_core cp312, annotated_types, typing_inspection, typing_extensions >= 4.14:
pydantic_core imports typing_extensions.Sentinel). gpu_suite.sh installs .whl/ first:
    bash bench/gpu_suite.sh 'py:bench/e2e/serve_e2e.py --platform native,xpu@590'    (carry .whl)
(one device command runs at most 600 s: if both platforms do not fit, one call each.)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the repo root


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default="native", help="comma-separated: native (this device's own), xpu, ...")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="the built-in small config (a CPU smoke run)")
    ap.add_argument("--model", help="a checkpoint folder (any family load_model reads) instead of the built Kimi Linear")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--long-prompts", type=int, default=32, help="0: skip the long-prompt phase")
    ap.add_argument("--long-len", type=int, default=32768)
    ap.add_argument("--long-output-len", type=int, default=32)
    ap.add_argument("--short-streams", type=int, default=8, help="clients streaming short requests meanwhile")
    ap.add_argument("--short-output-len", type=int, default=4096,
                    help="long enough to stream through the whole long-prompt window")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--json-out", help="write this platform's figures here (used by --platform a,b)")
    return ap


def _prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pct(values: list, p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(len(s) * p / 100) - 1))]


class Served:
    """The real app over `engine` on 127.0.0.1:<free port>; uvicorn in a thread."""

    def __init__(self, engine, max_len: int):
        import uvicorn

        from kernelgate.serving.async_engine import AsyncEngine
        from kernelgate.server.app import create_app
        from kernelgate.server.jobs import ModelInfo
        from kernelgate.server.metrics import Metrics
        self.metrics = Metrics("bench")
        self.aengine = AsyncEngine(engine, observer=self.metrics).start()
        info = ModelInfo("bench", None, max_len, engine.model.config.vocab_size, [])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app = create_app(self.aengine, info, self.metrics, shutdown_timeout=5.0)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{port}"

    def errors(self) -> float:
        for fam in self.metrics.registry.collect():
            for s in fam.samples:
                if s.name == "kernelgate:request_success_total" and s.labels.get("finished_reason") == "error":
                    return s.value
        return 0.0

    def close(self) -> None:
        self.server.should_exit = True       # the app's lifespan then shuts the AsyncEngine down
        self.thread.join(60)


async def stream(client, base: str, body: dict, out: dict | None = None) -> dict:
    """One streaming completion -> {"times": [chunk arrival], "ids": [...], "finish", "error"},
    filled in as chunks arrive (into `out` when given: what a cancelled stream got stays)."""
    out = out if out is not None else {}
    out.update(t0=time.perf_counter(), times=[], ids=[], finish=None, error=None)
    async with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                out["error"] = obj["error"]["message"]
                break
            c = obj["choices"][0]
            out["times"].append(time.perf_counter())
            out["ids"] += c.get("token_ids") or []
            out["finish"] = c["finish_reason"] or out["finish"]
    return out


async def long_load(base: str, a, long_prompts: list, short_prompt: list) -> dict:
    """Short-prompt streams (long outputs) run throughout; after a baseline second the long
    requests arrive together; the short streams are cut when the last long one ends."""
    import httpx
    shorts: list = []                     # every short request's stream record
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        async def short_client():
            while True:
                shorts.append({})
                await stream(client, base, {"prompt": short_prompt, "max_tokens": a.short_output_len,
                                            "temperature": 0, "ignore_eos": True}, shorts[-1])
                if shorts[-1]["error"]:
                    return
        tasks = [asyncio.create_task(short_client()) for _ in range(a.short_streams)]
        await asyncio.sleep(1.0)
        w0 = time.perf_counter()
        longs = await asyncio.gather(*(stream(client, base, {
            "prompt": p, "max_tokens": a.long_output_len, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}) for p in long_prompts))
        w2 = time.perf_counter()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ttfts = [r["times"][0] - r["t0"] for r in longs if r["times"]]
    w1 = max((r["times"][0] for r in longs if r["times"]), default=w2)   # every long prompt prefilled
    gaps = [(t1, (t1 - t0) * 1e3) for r in shorts for t0, t1 in zip(r.get("times", []), r.get("times", [])[1:])]
    before = [g for t, g in gaps if t < w0]
    during = [g for t, g in gaps if w0 <= t <= w1]
    done = [r for r in longs if r["finish"] == "length" and len(r["ids"]) == a.long_output_len and not r["error"]]
    return {"long_completed": f"{len(done)}/{len(longs)}",
            "long_errors": [r["error"] for r in longs if r["error"]][:3],
            "long_ttft_p50_s": pct(ttfts, 50), "long_ttft_max_s": max(ttfts, default=float("nan")),
            "long_window_s": w2 - w0,
            "short_itl_before_p50_ms": pct(before, 50), "short_itl_during_p50_ms": pct(during, 50),
            "short_itl_during_p99_ms": pct(during, 99), "short_itl_during_max_ms": max(during, default=float("nan")),
            "short_tokens_during": len(during), "short_requests": len(shorts),
            "short_errors": [r["error"] for r in shorts if r.get("error")][:3],
            "long0_ids": longs[0]["ids"]}


def measure(a) -> dict:
    if a.platform == "native":
        os.environ.pop("KERNELGATE_PLATFORM", None)
    else:
        os.environ["KERNELGATE_PLATFORM"] = a.platform
    import random

    import torch

    import kernelgate
    from kernelgate import registry
    from kernelgate.cli import bench_serve
    from kernelgate.engine import Engine
    from kernelgate.models import build, real_width, tiny
    from kernelgate.platform import default_device
    from kernelgate.serving.drive import Timing
    registry.refresh()
    dev = default_device()
    if a.model:
        model = kernelgate.load_model(a.model, device=dev, dtype=getattr(torch, a.dtype))
    else:
        model = build(tiny() if a.tiny else real_width(a.layers), device=dev, dtype=getattr(torch, a.dtype), seed=0)
    V, N = model.config.vocab_size, a.concurrency
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(a.input_len)] for _ in range(N)]
    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else str(dev),
                 "platform": a.platform,
                 "config": f"{a.model or ('tiny' if a.tiny else f'{a.layers} layers real width')}, {a.dtype}"}

    t_start = time.perf_counter()

    def say(what):
        print(f"[{a.platform} {time.perf_counter() - t_start:6.1f} s] {what}", flush=True)
    say("model built")

    # 1. offline
    max_len = a.input_len + a.output_len + 16
    engine = Engine(model, max_num_seqs=N, max_model_len=max_len, max_num_batched_tokens=a.max_num_batched_tokens)

    def offline(ps, n):
        t = Timing()
        t0 = time.perf_counter()
        out = kernelgate.generate(model, ps, max_new_tokens=n, stop_token_ids=[], engine=engine, timing=t)
        wall = time.perf_counter() - t0
        steps = [dt for kind, _, dt in t.steps if kind == "decode"]
        return [r.token_ids for r in out], wall, statistics.median(steps[1:] or steps)
    for n in sorted({1, 2, 4, 8, 16, 32, N}):                  # warm-up: dispatch, every graph bucket
        if n <= N:
            offline(prompts[:n], min(a.output_len, 8))
    say("warm-up done (every graph bucket)")
    offline(prompts, a.output_len)
    offline(prompts[:1], a.output_len)
    ref, wall, res["offline_step_bN_ms"] = offline(prompts, a.output_len)
    res["offline_tok_s"] = sum(map(len, ref)) / wall
    _, _, res["offline_step_b1_ms"] = offline(prompts[:1], a.output_len)
    res["offline_step_bN_ms"] *= 1e3
    res["offline_step_b1_ms"] *= 1e3

    say(f"offline: {res['offline_tok_s']:,.0f} tok/s at b{N}, step b1 {res['offline_step_b1_ms']:.2f} ms")

    # 2. served
    srv = Served(engine, max_len)
    try:
        import httpx

        async def check():
            async with httpx.AsyncClient(timeout=600) as c:
                rs = await asyncio.gather(*(c.post(f"{srv.base}/v1/completions", json={
                    "prompt": p, "max_tokens": a.output_len, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}) for p in prompts[:8]))
            return [r.json()["choices"][0]["token_ids"] for r in rs]
        got = asyncio.run(check())
        res["greedy_same"] = f"{sum(g == r for g, r in zip(got, ref[:8]))}/{min(8, N)}"
        # bf16 with random weights: near-tied logits, and a batch composed differently (requests
        # arriving apart) takes other kernels (GEMV vs grouped experts): report how far they agree
        res["greedy_prefix"] = f"{min(_prefix(g, r) for g, r in zip(got, ref[:8]))}/{a.output_len}"

        def bench(conc, num):
            args = bench_serve.parser(argparse.ArgumentParser).parse_args([
                "--base-url", srv.base, "--num-prompts", str(num), "--max-concurrency", str(conc),
                "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--seed", "0"])
            return bench_serve._bench(args)
        say(f"server up, greedy check {res['greedy_same']}")
        bench(min(8, N), min(8, N))                              # warm-up of the HTTP path
        rN, r1 = bench(N, 2 * N), bench(1, 16)
        print(bench_serve.table(rN), flush=True)
        res.update(cN_tok_s=rN["output_throughput"], cN_ttft_p50_ms=rN["median_ttft_ms"],
                   cN_ttft_p99_ms=rN["p99_ttft_ms"], cN_itl_p50_ms=rN["median_itl_ms"],
                   c1_ttft_p50_ms=r1["median_ttft_ms"], c1_itl_p50_ms=r1["median_itl_ms"],
                   bench_failed=rN["failed"] + r1["failed"], errors_finished=srv.errors())
    finally:
        srv.close()
        engine.close()

    # 3. long prompts under load
    if a.long_prompts:
        long_prompts = [[rng.randrange(V) for _ in range(a.long_len)] for _ in range(a.long_prompts)]
        max_len = max(a.long_len + a.long_output_len, a.input_len + a.short_output_len) + 16
        engine = Engine(model, max_num_seqs=max(64, a.long_prompts + a.short_streams), max_model_len=max_len,
                        max_num_batched_tokens=a.max_num_batched_tokens)
        res["long_cache"] = engine.capacity.report()
        t0 = time.perf_counter()
        want = kernelgate.generate(model, long_prompts[:1], max_new_tokens=a.long_output_len, stop_token_ids=[],
                                   engine=engine)[0].token_ids
        res["long_offline_one_s"] = time.perf_counter() - t0
        say(f"long phase: {res['long_cache']}; one long request offline {res['long_offline_one_s']:.1f} s")
        srv = Served(engine, max_len)
        try:
            r = asyncio.run(long_load(srv.base, a, long_prompts, prompts[0]))
            ids = r.pop("long0_ids")
            r["long0_same"] = ids == want
            r["long0_prefix"] = f"{_prefix(ids, want)}/{len(want)}"
            r["long_errors_finished"] = srv.errors()
            res.update(r)
        finally:
            srv.close()
            engine.close()
    return res


ROWS = [  # (key, label, target, ok(res) or None)
    ("offline_tok_s", "offline generate() b{N} output tok/s", "", None),
    ("cN_tok_s", "c{N} output tok/s", ">= 0.85 x offline", lambda r: r["cN_tok_s"] >= 0.85 * r["offline_tok_s"]),
    ("c1_ttft_p50_ms", "c1 TTFT p50 (ms), {I}-token prompt", "<= 30", lambda r: r["c1_ttft_p50_ms"] <= 30),
    ("offline_step_b1_ms", "offline decode step b1 (ms)", "", None),
    ("c1_itl_p50_ms", "c1 ITL p50 (ms)", "<= 1.3 x offline step b1",
     lambda r: r["c1_itl_p50_ms"] <= 1.3 * r["offline_step_b1_ms"]),
    ("offline_step_bN_ms", "offline decode step b{N} (ms)", "", None),
    ("cN_itl_p50_ms", "c{N} ITL p50 (ms)", "", None),
    ("cN_ttft_p50_ms", "c{N} TTFT p50 (ms)", "", None),
    ("cN_ttft_p99_ms", "c{N} TTFT p99 (ms)", "", None),
    ("greedy_same", "greedy server == offline tokens", "all",
     lambda r: len(set(r["greedy_same"].split("/"))) == 1),
    ("greedy_prefix", "greedy: tokens equal to offline before the first difference (min)", "", None),
    ("long_completed", "long: requests completed ({L}-token prompts)", "all",
     lambda r: len(set(r["long_completed"].split("/"))) == 1),
    ("long_ttft_p50_s", "long: TTFT p50 (s)", "", None),
    ("long_ttft_max_s", "long: TTFT max = prefill window (s)", "", None),
    ("long_window_s", "long: all done after (s)", "", None),
    ("short_itl_before_p50_ms", "short streams: ITL p50 before (ms)", "", None),
    ("short_itl_during_p50_ms", "short streams: ITL p50 during long prefills (ms)", "", None),
    ("short_itl_during_p99_ms", "short streams: ITL p99 during (ms)", "", None),
    ("short_itl_during_max_ms", "short streams: ITL max during (ms)", "", None),
    ("short_tokens_during", "short streams: tokens during long prefills", "> 0", lambda r: r["short_tokens_during"] > 0),
    ("long_errors_finished", "long phase: requests ended 'error' (non-finite)", "0",
     lambda r: r["long_errors_finished"] == 0),
    ("long0_same", "long: greedy tokens == offline (request 0)", "True", lambda r: r["long0_same"]),
    ("long0_prefix", "long: tokens equal to offline before the first difference", "", None),
]


def print_table(results: list, a) -> None:
    r0 = results[0]
    print(f"\nkernelgate serve vs offline -- {r0['device']}, {r0['config']}, prompts {a.input_len} -> "
          f"{a.output_len} tokens, concurrency {a.concurrency}")
    if "long_cache" in r0:
        print(f"long phase: {a.long_prompts} x {a.long_len}-token prompts -> {a.long_output_len} tokens, "
              f"{a.short_streams} short streams; {r0['long_cache']}")
    plats = [r["platform"] for r in results]
    print("\n| metric | " + " | ".join(plats) + " | target |\n|---|" + "---:|" * len(plats) + "---|")
    for key, label, target, ok in ROWS:
        if key not in r0:
            continue
        cells = []
        for r in results:
            v = r.get(key)
            s = f"{v:.2f}" if isinstance(v, float) else str(v)
            if ok is not None and key in r:
                try:
                    s += "" if ok(r) else " (NO)"
                except (KeyError, TypeError):
                    pass
            cells.append(s)
        name = label.format(N=a.concurrency, I=a.input_len, L=a.long_len)
        print(f"| {name} | " + " | ".join(cells) + f" | {target} |")
    for r in results:
        for key in ("long_errors", "short_errors"):
            if r.get(key):
                print(f"{r['platform']}: {key.replace('_', ' ')}: {r[key]}")


def main() -> None:
    a = args_parser().parse_args()
    plats = [p.strip() for p in a.platform.split(",") if p.strip()]
    if len(plats) == 1:
        a.platform = plats[0]
        res = measure(a)
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(res, f)
        print_table([res], a)
        return
    results = []
    argv = [x for i, x in enumerate(sys.argv[1:]) if x != "--platform" and sys.argv[i] != "--platform"
            and not x.startswith("--platform=")]
    with tempfile.TemporaryDirectory() as tmp:
        for p in plats:
            out = os.path.join(tmp, f"{p}.json")
            print(f"=== platform {p}", flush=True)
            rc = subprocess.call([sys.executable, os.path.abspath(__file__), *argv, "--platform", p,
                                  "--json-out", out])
            if rc != 0 or not os.path.exists(out):
                print(f"platform {p}: failed (rc {rc})", flush=True)
                continue
            with open(out) as f:
                results.append(json.load(f))
    if results:
        print_table(results, a)


if __name__ == "__main__":
    main()
