"""Prefix caching as a user of `kernelgate serve` sees it (issue 36): the same server with the
cache on and off (`--no-enable-prefix-caching`), each measured by `kernelgate bench serve`:

  multi-turn     32 conversations x 8 turns at once, a 2,048-token system prompt shared by all,
                 256-token user turns, 128-token answers: TTFT p50 of turns 2-8, throughput,
                 hit rate (targets: TTFT <= 0.2 x cache-off, throughput >= 1.5 x)
  shared-prefix  one 32,768-token document, 16 questions of 64 tokens one after another: TTFT of
                 questions 2-16 against the first's (target <= 0.1 x)
  random         c64, 128 in / 128 out, nothing to hit: throughput (target >= 0.97 x cache-off)

    PYTHONPATH=. python bench/e2e/serve_prefix.py --model /tmp/kernelgate-ckpt/kimi-4l   # (written if missing)
    PYTHONPATH=. python bench/e2e/serve_prefix.py --tiny          # the built-in model, small sizes: a dry run
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoint(folder: Path, layers: int) -> None:
    import torch

    from kernelgate.models import build, real_width
    from kernelgate.models.loader import save_checkpoint
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    save_checkpoint(build(real_width(layers), device=dev, dtype=torch.bfloat16, seed=0), folder)


def serve(model: str | None, flags: list) -> tuple:
    port = free_port()
    log = open(f"/tmp/kernelgate-serve-prefix-{port}.log", "w")
    argv = [sys.executable, "-m", "kernelgate", "serve", "--port", str(port), *(["--model", model] if model else []),
            *flags]
    srv = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    base, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2)
            return srv, base
        except OSError:
            if srv.poll() is not None or time.perf_counter() - t0 > 600:
                srv.kill()
                raise SystemExit("server did not start:\n" + open(log.name).read()[-3000:])
            time.sleep(0.5)


def bench(base: str, args: list) -> dict:
    out = subprocess.run([sys.executable, "-m", "kernelgate", "bench", "serve", "--base-url", base, "--json", *args],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench serve {args} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (written with --layers real-width layers if missing)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="the built-in model and small workloads")
    ap.add_argument("--parts", default="multi-turn,shared-prefix,random")
    a = ap.parse_args()
    if a.model and not (Path(a.model) / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(Path(a.model), a.layers)
        print(f"wrote {a.layers}-layer checkpoint in {time.perf_counter() - t0:.0f} s", flush=True)
    small = a.tiny
    work = {
        "multi-turn": ["--dataset", "multi-turn", "--num-conversations", "4" if small else "32", "--turns",
                       "3" if small else "8", "--system-len", "200" if small else "2048", "--input-len",
                       "32" if small else "256", "--output-len", "8" if small else "128"],
        "shared-prefix": ["--dataset", "shared-prefix", "--prefix-len", "600" if small else "32768", "--num-prompts",
                          "4" if small else "16", "--input-len", "16" if small else "64", "--output-len",
                          "4" if small else "16"],
        "random": ["--num-prompts", "16" if small else "128", "--max-concurrency", "8" if small else "64",
                   "--input-len", "32" if small else "128", "--output-len", "8" if small else "128"],
    }
    parts = a.parts.split(",")
    flags = ["--max-num-seqs", "8" if small else "64", "--max-model-len", "2048" if small else "40960"]
    res = {}
    for on in (True, False):
        srv, base = serve(None if small else a.model, flags + ([] if on else ["--no-enable-prefix-caching"]))
        try:
            bench(base, ["--num-prompts", "8", "--input-len", "16", "--output-len", "4"])     # HTTP path warm
            for part in parts:
                res[(part, on)] = r = bench(base, work[part] + ["--seed", "1" if on else "1"])
                print(f"{part:14} cache {'on ' if on else 'off'}: {r['output_throughput']:.0f} out tok/s, TTFT p50 "
                      f"{r['median_ttft_ms']:.1f} ms" + (f", later turns p50 {r['median_ttft_later_ms']:.1f} ms, "
                                                         f"first {r['median_ttft_first_ms']:.1f} ms, hit rate "
                                                         f"{r['prefix_cache_hit_rate']:.2f}" if part != "random" else ""),
                      flush=True)
        finally:
            srv.terminate()
            srv.wait(60)
    print("\n| workload | figure | cache on | cache off | ratio | target |\n|---|---|---:|---:|---:|---|")
    if "multi-turn" in parts:
        on, off = res[("multi-turn", True)], res[("multi-turn", False)]
        print(f"| multi-turn | TTFT p50, turns 2+ (ms) | {on['median_ttft_later_ms']:.1f} | {off['median_ttft_later_ms']:.1f} | "
              f"{on['median_ttft_later_ms'] / off['median_ttft_later_ms']:.2f} | <= 0.2 |")
        print(f"| multi-turn | output tok/s | {on['output_throughput']:.0f} | {off['output_throughput']:.0f} | "
              f"{on['output_throughput'] / off['output_throughput']:.2f} | >= 1.5 |")
        print(f"| multi-turn | hit rate | {on['prefix_cache_hit_rate']:.2f} | {off['prefix_cache_hit_rate']:.2f} | | |")
    if "shared-prefix" in parts:
        on = res[("shared-prefix", True)]
        print(f"| shared-prefix | TTFT p50 of questions 2+ / the first's (ms) | {on['median_ttft_later_ms']:.1f} / "
              f"{on['median_ttft_first_ms']:.1f} | {res[('shared-prefix', False)]['median_ttft_later_ms']:.1f} | "
              f"{on['median_ttft_later_ms'] / on['median_ttft_first_ms']:.3f} | <= 0.1 |")
    if "random" in parts:
        on, off = res[("random", True)], res[("random", False)]
        print(f"| random c64 | output tok/s | {on['output_throughput']:.0f} | {off['output_throughput']:.0f} | "
              f"{on['output_throughput'] / off['output_throughput']:.3f} | >= 0.97 |")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
