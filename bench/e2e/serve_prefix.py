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
import re
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
    """-> (server process, base URL, log path)."""
    port = free_port()
    log = open(f"/tmp/kernelgate-serve-prefix-{port}.log", "w")
    argv = [sys.executable, "-m", "kernelgate", "serve", "--port", str(port), *(["--model", model] if model else []),
            *flags]
    srv = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    base, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2)
            return srv, base, log.name
        except OSError:
            if srv.poll() is not None or time.perf_counter() - t0 > 600:
                srv.kill()
                raise SystemExit("server did not start:\n" + open(log.name).read()[-3000:])
            time.sleep(0.5)


STEP = re.compile(r"kernelgate step: t=([\d.]+) adds=(\d+) kind=(\w+) tokens=(\d+) seqs=(\d+) dt=([\d.]+)")
ADD = re.compile(r"kernelgate add: t=([\d.]+) id=(\S+) prompt=(\d+)")


def timeline(log_path: str, start: int) -> tuple:
    """The server's debug log from byte `start`: (a summary line of its engine steps, the step lines)."""
    with open(log_path) as f:
        f.seek(start)
        text = f.read()
    steps = [(float(m[1]), int(m[2]), m[3], int(m[4]), int(m[5]), float(m[6])) for m in STEP.finditer(text)]
    adds = [float(m[1]) for m in ADD.finditer(text)]
    if not steps:
        return "no steps logged", []
    span = steps[-1][0] + steps[-1][5] - min([steps[0][0], *adds])
    by = {}
    for _, _, kind, tok, _, dt in steps:
        n, t, d = by.get(kind, (0, 0, 0.0))
        by[kind] = (n + 1, t + tok, d + dt)
    busy = sum(s[5] for s in steps)
    line = (f"engine busy {busy:.2f} s of {span:.2f} s ({busy / span:.0%}); " + ", ".join(
        f"{k}: {n} steps, {t} tokens, {d * 1e3 / n:.1f} ms/step" for k, (n, t, d) in sorted(by.items())))
    return line, [m.group(0) for m in re.finditer(r"kernelgate (?:step|add): .*", text)]


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
    ap.add_argument("--trace", metavar="DIR", help="the servers at log level debug: per run, a summary of the "
                                                  "engine's steps, and every step / arrival line in DIR")
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
        srv, base, log = serve(None if small else a.model, flags + ([] if on else ["--no-enable-prefix-caching"])
                               + (["--log-level", "debug"] if a.trace else []))
        try:
            bench(base, ["--num-prompts", "8", "--input-len", "16", "--output-len", "4"])     # HTTP path warm
            for part in parts:
                mark = os.path.getsize(log)
                res[(part, on)] = r = bench(base, work[part] + ["--seed", "1"])
                if a.trace:
                    line, lines = timeline(log, mark)
                    print(f"  [{part}, cache {'on' if on else 'off'}] {line}", flush=True)
                    Path(a.trace).mkdir(parents=True, exist_ok=True)
                    Path(a.trace, f"{part}-{'on' if on else 'off'}.log").write_text("\n".join(lines))
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
