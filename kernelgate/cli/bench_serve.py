"""`kernelgate bench serve`: a load generator against a running OpenAI-compatible server.

Random token-id prompts (`--input-len` +- `--range-ratio`), exact output lengths (`ignore_eos`,
as vLLM's benchmark does), arrivals at `--request-rate` per second (Poisson; inf = all at
once) with at most `--max-concurrency` in flight; every request streams. Reports the numbers
vLLM's `bench serve` reports, under its names: request / output / total token throughput,
TTFT, TPOT (time per output token after the first), ITL (gap between chunks) and E2EL
(end-to-end latency), each as mean / median / std / p90 / p99, in milliseconds.

`--dataset` picks the workload:
  random         independent prompts (above)
  multi-turn     --num-conversations conversations of --turns turns, run concurrently: each turn
                 sends the whole conversation so far (a --system-len system prompt shared by all,
                 then every earlier user turn and answer, as token ids) plus a new --input-len
                 user turn, and waits for its --output-len answer before the next
  shared-prefix  one --prefix-len document and --num-prompts questions of --input-len tokens
                 about it, asked one after another (at most --max-concurrency at once)
The prefix-cache workloads also report the first turns' and the later turns' TTFT apart and the
hit rate: prompt tokens served from the cache (`usage.prompt_tokens_details.cached_tokens`) over
prompt tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from . import args as flags

PERCENTILES = (50, 90, 99)


def parser(cls) -> argparse.ArgumentParser:
    p = cls(prog="kernelgate bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=flags.int_at_least(1), default=100)
    p.add_argument("--request-rate", type=_rate,
                   default=math.inf, help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=flags.int_at_least(1), help="requests in flight at most")
    p.add_argument("--input-len", type=flags.int_at_least(1), default=128)
    p.add_argument("--output-len", type=flags.int_at_least(1), default=128)
    p.add_argument("--range-ratio", type=flags.float_in(0.0, 1.0), default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: exact)")
    p.add_argument("--dataset", choices=("random", "multi-turn", "shared-prefix"), default="random",
                   help="random: independent prompts; multi-turn: conversations that re-send their history each "
                        "turn; shared-prefix: questions about one document, one after another")
    p.add_argument("--num-conversations", type=flags.int_at_least(1), default=32, help="multi-turn: conversations")
    p.add_argument("--turns", type=flags.int_at_least(1), default=8, help="multi-turn: turns per conversation")
    p.add_argument("--system-len", type=flags.int_at_least(0), default=2048,
                   help="multi-turn: tokens of the system prompt every conversation starts with")
    p.add_argument("--prefix-len", type=flags.int_at_least(1), default=32768, help="shared-prefix: document tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=flags.float_in(0.0, 1e6, lo_open=True), default=600.0,
                   help="seconds per request")
    p.add_argument("--client-processes", type=flags.int_at_least(1),
                   help="client processes sharing the load (default: one per 16 streams, at most half the cores)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    p.add_argument("--result-file", help="also write the JSON result here")
    p.set_defaults(fn=main)
    return p


def _rate(s: str) -> float:
    v = float(s) if s.lower() not in ("inf", "infinity") else math.inf
    if math.isnan(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {s}")
    return v


@dataclass
class Outcome:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    turn: int = 0                  # its place in its conversation (0: the first request)
    cached: int = 0                # prompt tokens the server found in its prefix cache
    token_ids: list = field(default_factory=list)


async def _one(client, url: str, body: dict, headers: dict) -> Outcome:
    import httpx
    out = Outcome(prompt_len=len(body["prompt"]))
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out.error = obj["error"].get("message", "error")
                    return out
                now = time.perf_counter()
                if obj.get("choices"):
                    if out.ttft == 0.0:
                        out.ttft = now - t0
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.token_ids += obj["choices"][0].get("token_ids") or []
                if obj.get("usage"):
                    out.output_len = obj["usage"]["completion_tokens"]
                    out.cached = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.latency = time.perf_counter() - t0
        out.ok = out.ttft > 0
    except (httpx.HTTPError, OSError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def _stats(name: str, values: list, into: dict) -> None:
    ms = [v * 1e3 for v in values] or [0.0]
    into[f"mean_{name}_ms"] = statistics.fmean(ms)
    into[f"median_{name}_ms"] = statistics.median(ms)
    into[f"std_{name}_ms"] = statistics.pstdev(ms)
    s = sorted(ms)
    for p in PERCENTILES:
        into[f"p{p}_{name}_ms"] = s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


async def _prepare(args) -> tuple:
    """(model name, request bodies, arrival offsets in s) from the server's model card."""
    import httpx
    headers = _headers(args)
    base = args.base_url.rstrip("/")
    rng = random.Random(f"{args.seed}:{args.dataset}")     # (datasets share no tokens: one server may run them all)
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        try:
            r = await client.get(f"{base}/v1/models", headers=headers)
        except httpx.HTTPError as e:
            raise RuntimeError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"GET {base}/v1/models answered {r.status_code}: {r.text[:200]}")
    card = r.json()["data"][0]
    model = args.model or card["id"]
    vocab = int(card.get("vocab_size") or 256)

    def length(n):
        lo, hi = max(1, int(n * (1 - args.range_ratio))), max(1, int(n * (1 + args.range_ratio)))
        return rng.randint(lo, hi)
    def ids(n):
        return [rng.randrange(vocab) for _ in range(n)]

    def turn(prompt, history):
        return {"model": model, "prompt": prompt, "max_tokens": length(args.output_len), "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True, "history": history}
    if args.dataset == "multi-turn":
        system = ids(args.system_len)
        convs = [[turn((system if t == 0 else []) + ids(length(args.input_len)), True) for t in range(args.turns)]
                 for _ in range(args.num_conversations)]
    elif args.dataset == "shared-prefix":
        doc = ids(args.prefix_len)
        convs = [[turn(doc + ids(length(args.input_len)), False)] for _ in range(args.num_prompts)]
    else:
        convs = [[turn(ids(length(args.input_len)), False)] for _ in range(args.num_prompts)]
    at, arrivals = 0.0, []
    for _ in convs:
        at += 0.0 if math.isinf(args.request_rate) or args.dataset != "random" else rng.expovariate(args.request_rate)
        arrivals.append(at)
    return model, convs, arrivals


def _headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _conversation(client, url: str, turns: list, headers: dict) -> list:
    """Send a conversation's turns one after another; a turn with `history` sends everything so far
    (earlier prompts and answers, as token ids) before its own tokens -> one Outcome per turn."""
    outs, sofar = [], []
    for k, body in enumerate(turns):
        body = dict(body)
        prompt = (sofar if body.pop("history") else []) + body["prompt"]
        body["prompt"] = prompt
        o = await _one(client, url, body, headers)
        o.turn = k
        outs.append(o)
        if not o.ok:
            break
        sofar = prompt + o.token_ids
    return outs


async def _drive(url: str, bodies: list, arrivals: list, concurrency: int | None, headers: dict,
                 timeout: float, ready=None) -> tuple:
    """Send `bodies` (conversations: lists of turns) at their arrival offsets, at most
    `concurrency` conversations in flight; -> (outcomes, start, end) on the monotonic clock
    (one clock for every process).
    Before the clock starts, as many connections as will be in flight are opened (a GET of
    /health each) and `await ready()` waits for the other client processes: the load
    generator's own start-up (imports, TCP connects) is not the server's time."""
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    inflight = min(concurrency or len(bodies), len(bodies))
    sem = asyncio.Semaphore(inflight)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        health = url.rsplit("/v1/", 1)[0] + "/health"
        await asyncio.gather(*(client.get(health, headers=headers) for _ in range(inflight)),
                             return_exceptions=True)   # an unreachable server fails in the run, per request
        # (this process imported torch with kernelgate: a collection of its oldest generation would
        # stall every stream it reads for ~0.1 s; freeze what is alive now out of its sight, until the end)
        gc.collect()
        gc.freeze()
        if ready is not None:
            await ready()

        async def limited(conv):
            async with sem:
                return await _conversation(client, url, conv, headers)
        t0 = time.monotonic()
        tasks = []
        for body, at in zip(bodies, arrivals):
            wait = t0 + at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(limited(body)))
        outcomes = [o for conv in await asyncio.gather(*tasks) for o in conv]
    t1 = time.monotonic()
    gc.unfreeze()          # (run in-process, e.g. `cli.main([...])`, the caller's heap is its own again)
    return outcomes, t0, t1


def _part(queue, barrier, *drive_args) -> None:
    """One client process: connect, wait for the others, drive its share, send back what it saw."""
    async def ready():
        await asyncio.to_thread(barrier.wait)
    queue.put(asyncio.run(_drive(*drive_args, ready=ready)))


def client_processes(args) -> int:
    """--client-processes, or about one process per 16 streams (one Python process parses
    ~10k SSE chunks/s), at most half the cores."""
    if args.client_processes:
        return args.client_processes
    n = args.num_conversations if args.dataset == "multi-turn" else args.num_prompts
    streams = args.max_concurrency or n
    return max(1, min((os.cpu_count() or 2) // 2, math.ceil(streams / 16), n))


def _run(args, bodies: list, arrivals: list) -> tuple:
    """-> (outcomes, duration s), from one process or several (`client_processes`)."""
    url = f"{args.base_url.rstrip('/')}/v1/completions"
    P = client_processes(args)
    if P == 1:
        outcomes, t0, t1 = asyncio.run(_drive(url, bodies, arrivals, args.max_concurrency, _headers(args),
                                              args.timeout))
        return outcomes, t1 - t0
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(P + 1)
    c = args.max_concurrency
    procs = [ctx.Process(target=_part, daemon=True,
                         args=(queue, barrier, url, bodies[i::P], arrivals[i::P],
                               None if c is None else max(1, c // P + (i < c % P)), _headers(args), args.timeout))
             for i in range(P)]
    for p in procs:
        p.start()
    barrier.wait(timeout=120)
    parts = [queue.get(timeout=args.timeout * len(bodies)) for _ in procs]
    for p in procs:
        p.join(5)
    return [o for part in parts for o in part[0]], max(p[2] for p in parts) - min(p[1] for p in parts)


def _bench(args) -> dict:
    base = args.base_url.rstrip("/")
    if args.dataset == "shared-prefix" and args.max_concurrency is None:
        args.max_concurrency = 1                     # one question after another
    model, bodies, arrivals = asyncio.run(_prepare(args))
    outcomes, duration = _run(args, bodies, arrivals)
    ok = [o for o in outcomes if o.ok]
    res = {"backend": "openai", "base_url": base, "model_id": model, "dataset": args.dataset,
           "num_prompts": len(outcomes),
           "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
           "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
           "range_ratio": args.range_ratio, "seed": args.seed, "date": time.strftime("%Y%m%d-%H%M%S"),
           "client_processes": client_processes(args),
           "duration": duration, "completed": len(ok), "failed": len(outcomes) - len(ok),
           "total_input_tokens": sum(o.prompt_len for o in ok),
           "total_output_tokens": sum(o.output_len for o in ok)}
    res["request_throughput"] = len(ok) / duration
    res["output_throughput"] = res["total_output_tokens"] / duration
    res["total_token_throughput"] = (res["total_input_tokens"] + res["total_output_tokens"]) / duration
    _stats("ttft", [o.ttft for o in ok], res)
    _stats("tpot", [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1], res)
    _stats("itl", [x for o in ok for x in o.itl], res)
    _stats("e2el", [o.latency for o in ok], res)
    if args.dataset != "random":
        first = [o for o in ok if o.turn == 0] if args.dataset == "multi-turn" else ok[:1]
        later = [o for o in ok if o.turn > 0] if args.dataset == "multi-turn" else ok[1:]
        _stats("ttft_first", [o.ttft for o in first], res)
        _stats("ttft_later", [o.ttft for o in later], res)
        res["cached_tokens"] = sum(o.cached for o in ok)
        res["prefix_cache_hit_rate"] = res["cached_tokens"] / max(1, res["total_input_tokens"])
    res["errors"] = [o.error for o in outcomes if not o.ok][:20]
    return res


def table(res: dict) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label, value):
        lines.append(f"{label:<45}{value:>15.2f}" if isinstance(value, float) else f"{label:<45}{value!s:>15}")
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    row("Maximum request concurrency:", res["max_concurrency"])
    row("Benchmark duration (s):", res["duration"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        row(f"Mean {key.upper()} (ms):", res[f"mean_{key}_ms"])
        row(f"Median {key.upper()} (ms):", res[f"median_{key}_ms"])
        for p in PERCENTILES[1:]:
            row(f"P{p} {key.upper()} (ms):", res[f"p{p}_{key}_ms"])
    if "prefix_cache_hit_rate" in res:
        lines.append("{s:{c}^60}".format(s=" Prefix cache ", c="-"))
        row("Median TTFT, first turns / first prompt (ms):", res["median_ttft_first_ms"])
        row("Median TTFT, later turns / prompts (ms):", res["median_ttft_later_ms"])
        row("Cached prompt tokens:", res["cached_tokens"])
        row("Hit rate (cached / prompt tokens):", res["prefix_cache_hit_rate"])
    lines.append("=" * 60)
    return "\n".join(lines)


def main(args) -> int:
    from ..errors import KernelgateError
    try:
        res = _bench(args)
    except RuntimeError as e:
        raise KernelgateError(f"bench serve: {e}") from None
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res) if args.json else table(res))
    if res["errors"]:
        print(f"bench serve: {res['failed']} requests failed; first: {res['errors'][0]}", flush=True)
    return 0 if res["completed"] else 1
