"""`kernelgate serve` under abuse (issue 34): loopback only, bounded in clients and time.

Starts `kernelgate serve` (the built-in model unless --model) on 127.0.0.1 at a free port, or
uses --base-url (a loopback one), then:
  1. asks for the greedy answer to a fixed prompt;
  2. starts --clients clients at once (default 200):
       streamers   streaming completions and chats of random lengths; half of them leave
                   after a random number of chunks (0 to 5) or a random delay (a disconnect);
       hogs        (--hogs) a request of --hog-prompts prompts x n 2 (over the per-request bound:
                   400), and one exactly at the bound (protocol.MAX_CHOICES choices, not
                   streaming) that leaves after a second;
       malformed   (--malformed) random bodies: wrong shapes, unknown fields, lone surrogates,
                   invalid UTF-8, truncated JSON;
  3. after the last client: seconds until /metrics shows 0 running and 0 waiting (target <= 5);
  4. the greedy answer again, which must equal (1); a server it started must stop on SIGTERM
     with rc 0 and no traceback in its log.
Prints the statuses by client kind, the drain time and the checks; exits 1 if one fails. Every
client has a deadline (--deadline seconds for the whole run), so it stops by itself.

    python bench/e2e/serve_abuse.py                      # CPU, built-in model, 200 clients
    python bench/e2e/serve_abuse.py --clients 50 --hogs 2 --malformed 5
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PROBE = {"prompt": [9, 8, 7, 6], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", help="a running server on 127.0.0.1 (default: start one)")
    ap.add_argument("--model", help="checkpoint folder for the server it starts (default: the built-in model)")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--hogs", type=int, default=4)
    ap.add_argument("--hog-prompts", type=int, default=1000)
    ap.add_argument("--malformed", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=96, help="longest stream a streamer asks for")
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds for the whole run")
    ap.add_argument("--seed", type=int, default=34)
    return ap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a, log_path: str):
    import httpx
    port = free_port()
    cmd = [sys.executable, "-m", "kernelgate", "serve", "--port", str(port), "--max-num-seqs", "32",
           "--max-model-len", "1024", "--log-level", "warning"] + (["--model", a.model] if a.model else [])
    with open(log_path, "w") as log:      # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            with open(log_path) as f:
                raise SystemExit(f"server exited with rc {proc.returncode}:\n{f.read()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("server not healthy after 300 s")
        time.sleep(0.25)


async def gauges(c, base) -> tuple:
    from prometheus_client.parser import text_string_to_metric_families
    text = (await c.get(f"{base}/metrics")).text
    m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
         if not s.labels.get("finished_reason")}
    return int(m["kernelgate:num_requests_running"]), int(m["kernelgate:num_requests_waiting"])


async def probe(c, base) -> list:
    r = await c.post(f"{base}/v1/completions", json=PROBE)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


async def streamer(c, base, rng: random.Random, leaves: bool, max_tokens: int) -> str:
    chat = rng.random() < 0.3
    n = rng.randint(4, 40)
    body = {"max_tokens": rng.randint(1, max_tokens), "stream": True, "temperature": rng.choice([0, 0.8]),
            "seed": rng.randrange(1 << 30), "n": rng.choice([1, 1, 1, 2])}
    if chat:
        body["messages"] = [{"role": "user", "content": "".join(rng.choice("abc xyz") for _ in range(n))}]
    else:
        body["prompt"] = [rng.randrange(512) for _ in range(n)]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    leave_after = rng.randint(0, 5) if leaves else None
    leave_at = time.monotonic() + rng.uniform(0.0, 3.0) if leaves and rng.random() < 0.5 else None
    async with c.stream("POST", base + path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "200"
            if '"error"' in line[:20]:
                return "error-event"
            chunks += 1
            if (leave_after is not None and chunks > leave_after) or (leave_at and time.monotonic() > leave_at):
                return "left"            # leaving the block closes the connection mid-stream
    return "200-no-done"


async def hog(c, base, a, at_bound: bool) -> str:
    from kernelgate.server.protocol import MAX_CHOICES
    k = MAX_CHOICES // 2 if at_bound else a.hog_prompts
    body = {"prompt": [[i % 500 + 1, 7, 7] for i in range(k)], "n": 2, "max_tokens": 64, "ignore_eos": True}
    try:
        r = await asyncio.wait_for(c.post(f"{base}/v1/completions", json=body), 1.0 if at_bound else 30.0)
    except asyncio.TimeoutError:
        return "left"
    return str(r.status_code)


GARBAGE = [b"", b"{", b"null", b"[1,2]", b"\xff\xfe", b'{"prompt": "a\\ud800"}', b'{"prompt": "\xed\xa0\x80"}',
           b'{"prompt": [1, 2], "logit_bias": {"5": 100}}', b'{"prompt": [1], "n": 100000}', b"[" * 50000,
           b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', b'{"prompt": [1], "zzz": 1}',
           b'{"prompt": [[]], "max_tokens": 1}', b'{"prompt": [1], "temperature": 1e-300}',
           b'{"prompt": [1], "max_tokens": 1e400}', b'{"prompt": [600]}']


async def malformed(c, base, rng: random.Random) -> str:
    raw = rng.choice(GARBAGE)
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    r = await c.post(base + path, content=raw, headers={"content-type": "application/json"})
    return str(r.status_code)


async def abuse(a, base: str) -> dict:
    import httpx
    rng = random.Random(a.seed)
    limits = httpx.Limits(max_connections=a.clients + 50, max_keepalive_connections=0)
    out = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as c:
        before = await probe(c, base)
        n_malformed, n_hogs = a.malformed, a.hogs
        kinds = (["malformed"] * n_malformed + ["hog-over", "hog-at-bound"] * (n_hogs // 2)
                 + ["hog-over"] * (n_hogs % 2))
        kinds += ["stream-leaves", "stream-stays"] * ((a.clients - len(kinds)) // 2)
        kinds += ["stream-stays"] * (a.clients - len(kinds))
        rng.shuffle(kinds)

        async def one(kind: str, r: random.Random):
            try:
                if kind == "malformed":
                    return kind, await malformed(c, base, r)
                if kind.startswith("hog"):
                    return kind, await hog(c, base, a, kind == "hog-at-bound")
                return kind, await streamer(c, base, r, kind == "stream-leaves", a.max_tokens)
            except httpx.HTTPError as e:
                return kind, f"client-error:{type(e).__name__}"
        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(k, random.Random(rng.random()))) for k in kinds]
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, a.deadline - 60))
        for t in pending:
            t.cancel()
        statuses = collections.Counter()
        for t in done:
            kind, status = t.result()
            statuses[(kind, status)] += 1
        if pending:
            statuses[("unfinished", "cancelled at the deadline")] += len(pending)
        last = time.monotonic()
        drain, seen = None, []
        while time.monotonic() - last < 30:
            g = await gauges(c, base)
            seen.append((round(time.monotonic() - last, 2), g))
            if g == (0, 0):
                drain = time.monotonic() - last
                break
            await asyncio.sleep(0.05)
        after = await probe(c, base)
        health = (await c.get(f"{base}/health")).status_code
    out.update(clients_s=round(last - t0, 2), drain_s=None if drain is None else round(drain, 2),
               gauges_after_last_client=seen[:1] + seen[-1:], same_greedy_answer=before == after,
               greedy=before, health_after=health,
               statuses={f"{k} -> {s}": n for (k, s), n in sorted(statuses.items())})
    return out


def main() -> int:
    a = args_parser().parse_args()
    proc = None
    log_path = os.path.join(tempfile.mkdtemp(prefix="kernelgate-abuse-"), "server.log")
    if a.base_url:
        host = urlsplit(a.base_url).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("--base-url must be a loopback server")
        base = a.base_url.rstrip("/")
    else:
        proc, base = start_server(a, log_path)
    try:
        res = asyncio.run(asyncio.wait_for(abuse(a, base), a.deadline))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "killed after 30 s"
    checks = {"no 500 / error event / client error": not any(
                  s.endswith(("-> 500", "-> error-event")) or "client-error" in s or "unfinished" in s
                  for s in res["statuses"]),
              "0 running / 0 waiting within 5 s of the last client": res["drain_s"] is not None and res["drain_s"] <= 5,
              "same greedy answer before and after": res["same_greedy_answer"],
              "health 200 after": res["health_after"] == 200}
    if proc is not None:
        with open(log_path) as f:
            text = f.read()
        res["server_rc"] = rc
        checks["server stopped with rc 0, no traceback in its log"] = rc == 0 and "Traceback" not in text
    print(f"{a.clients} clients against {base}: all answered in {res['clients_s']} s; "
          f"0 running / 0 waiting {res['drain_s']} s after the last one")
    for k, n in res["statuses"].items():
        print(f"  {n:4d}  {k}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'}  {name}")
    print(json.dumps({**res, "checks": checks}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
