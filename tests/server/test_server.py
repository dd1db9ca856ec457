"""The real server process (`python -m kernelgate serve`, built-in model) on 127.0.0.1,
driven by the official openai client and raw HTTP. Its outputs are checked against offline
`kernelgate.generate()` on the same seeded built-in model, built here.

Sizes (CI: 2 cores, the whole module well under a minute): the server runs
--max-num-seqs 8 --max-model-len 1024 (conftest.py); the concurrency test sends 64 greedy
streaming requests at once (8 tokens each), so they queue, join the running batch as others
finish and share prefill and decode steps.
"""
import asyncio
import json
import random
import time

import httpx
import pytest
from shared_server import MAX_LEN

import kernelgate
from kernelgate.cli.model import BUILTIN

N_CONCURRENT, N_TOKENS = 64, 8


def offline(model, prompt_ids, n=N_TOKENS, **kw):
    [r] = kernelgate.generate(model, [prompt_ids], max_new_tokens=n, **kw)
    return r.token_ids


def text_of(model, ids):
    return model.tokenizer.decode(ids, skip_special_tokens=True)


def metrics(base) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in fam.samples:
            label = s.labels.get("finished_reason", s.labels.get("kind"))
            key = s.name + (f"[{label}]" if label is not None else "")
            out[key] = s.value
    return out


def test_models_and_health(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    data = httpx.get(f"{server}/v1/models").json()
    assert data["object"] == "list"
    [card] = data["data"]
    assert card["id"] == BUILTIN and card["object"] == "model" and card["max_model_len"] == MAX_LEN
    assert card["vocab_size"] == 512


def test_completion_text_matches_offline(client, model):
    r = client.completions.create(model=BUILTIN, prompt="The capital of France is", max_tokens=N_TOKENS,
                                  temperature=0, extra_body={"return_token_ids": True})
    ids = model.tokenizer.encode("The capital of France is")
    want = offline(model, ids, temperature=0.0)
    [c] = r.choices
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == BUILTIN
    assert c.index == 0 and c.token_ids == want and c.prompt_token_ids == ids
    assert c.text == text_of(model, want)
    assert c.finish_reason == ("length" if len(want) == N_TOKENS else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids), len(want), len(ids) + len(want))


def test_completion_token_id_prompts_list_and_echo(client, model):
    prompts = [[5, 17, 300], [40, 41, 42, 43, 44]]
    r = client.completions.create(model=BUILTIN, prompt=prompts, max_tokens=4, temperature=0, echo=True,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    for p, c in zip(prompts, r.choices):
        want = offline(model, p, 4, temperature=0.0)
        assert c.token_ids == want and c.text == text_of(model, p) + text_of(model, want)
    assert r.usage.prompt_tokens == 8 and r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)


def _chat_ids(model, messages):
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_chat_and_chat_stream(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = offline(model, _chat_ids(model, messages), temperature=0.0)
    r = client.chat.completions.create(model=BUILTIN, messages=messages, max_tokens=N_TOKENS, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text_of(model, want)
    assert r.usage.prompt_tokens == len(_chat_ids(model, messages)) and r.usage.completion_tokens == len(want)

    chunks = list(client.chat.completions.create(model=BUILTIN, messages=messages, max_tokens=N_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == text_of(model, want)
    assert [c.choices[0].finish_reason for c in body][-1] == r.choices[0].finish_reason
    assert all(c.usage is None for c in body)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)


async def _stream(client, base, body):
    """Raw SSE: (events as dicts, [DONE] seen)."""
    events, done = [], False
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    done = True
                else:
                    events.append(json.loads(line[6:]))
    return events, done


def test_concurrent_streams_match_offline(server, model):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(N_CONCURRENT)]

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            bodies = [{"model": BUILTIN, "prompt": p, "max_tokens": N_TOKENS, "temperature": 0, "stream": True,
                       "return_token_ids": True, "stream_options": {"include_usage": True}} for p in prompts]
            return await asyncio.gather(*(_stream(c, server, b) for b in bodies))
    results = asyncio.run(main())
    want = kernelgate.generate(model, prompts, max_new_tokens=N_TOKENS, temperature=0.0)
    finishes = set()
    for p, w, (events, done) in zip(prompts, want, results):
        assert done
        *chunks, usage = events
        assert {e["id"] for e in events} == {events[0]["id"]} and all(e["object"] == "text_completion" for e in events)
        assert all(set(e) == {"id", "object", "created", "model", "choices", "usage"} for e in events)
        ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
        assert ids == w.token_ids, f"prompt {p}"
        assert "".join(e["choices"][0]["text"] for e in chunks) == text_of(model, w.token_ids)
        assert [e["choices"][0]["finish_reason"] for e in chunks[:-1]] == [None] * (len(chunks) - 1)
        finishes.add(chunks[-1]["choices"][0]["finish_reason"])
        assert chunks[-1]["choices"][0]["finish_reason"] == w.finish_reason
        u = dict(usage["usage"])
        cached = u.pop("prompt_tokens_details")["cached_tokens"]
        assert usage["choices"] == [] and u == {
            "prompt_tokens": len(p), "completion_tokens": len(w.token_ids), "total_tokens": len(p) + len(w.token_ids)}
        assert 0 <= cached < len(p)
    assert "length" in finishes


def test_seeded_sampling_is_reproducible_and_matches_offline(client, model):
    kw = dict(model=BUILTIN, prompt=[7, 8, 9], max_tokens=N_TOKENS, temperature=0.9, top_p=0.95,
              extra_body={"top_k": 50, "return_token_ids": True})
    a = client.completions.create(seed=1234, **kw).choices[0].token_ids
    b = client.completions.create(seed=1234, **kw).choices[0].token_ids
    c = client.completions.create(seed=99, **kw).choices[0].token_ids
    assert a == b == offline(model, [7, 8, 9], temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    assert a != c


def test_n_choices_match_offline_per_seed(client, model):
    """n choices of each prompt: choice j equals offline generate() with seed + j; greedy choices
    are all the greedy output; indexes are prompt-major; usage counts each prompt once; a stream
    carries every choice's tokens under its index."""
    prompts = [[7, 8, 9], [40, 41]]
    kw = dict(model=BUILTIN, max_tokens=N_TOKENS, temperature=0.9, top_p=0.95, extra_body={"return_token_ids": True})
    r = client.completions.create(prompt=prompts, n=3, seed=500, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    for i, p in enumerate(prompts):
        want = [offline(model, p, temperature=0.9, top_p=0.95, seed=500 + j) for j in range(3)]
        assert [c.token_ids for c in r.choices[3 * i:3 * i + 3]] == want
    assert len({tuple(c.token_ids) for c in r.choices[:3]}) > 1            # the choices differ
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)

    g = client.chat.completions.create(model=BUILTIN, messages=[{"role": "user", "content": "Hi"}], n=2,
                                       max_tokens=N_TOKENS, temperature=0)
    want = text_of(model, offline(model, _chat_ids(model, [{"role": "user", "content": "Hi"}]), temperature=0.0))
    assert [c.index for c in g.choices] == [0, 1] and [c.message.content for c in g.choices] == [want, want]

    chunks = list(client.completions.create(prompt=prompts[0], n=2, seed=500, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    got = {0: [], 1: []}
    for c in chunks[:-1]:
        got[c.choices[0].index] += c.choices[0].token_ids
    assert got == {j: offline(model, prompts[0], temperature=0.9, top_p=0.95, seed=500 + j) for j in (0, 1)}
    assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == len(got[0]) + len(got[1])


def test_stop_string_cuts_exactly(client, model):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    full = text_of(model, offline(model, ids, 32, temperature=0.0, stop_token_ids=[]))
    assert len(full) >= 4, full
    stop = full[2:4]
    r = client.completions.create(model=BUILTIN, prompt=ids, max_tokens=32, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"


def test_client_disconnect_frees_slot_and_cache(server):
    before = metrics(server).get("kernelgate:request_success_total[abort]", 0)
    body = {"model": BUILTIN, "prompt": [1, 2, 3], "max_tokens": MAX_LEN - 3, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server}/v1/completions", json=body) as r:
            lines = r.iter_lines()       # keep it: closing this generator closes the response
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            m = metrics(server)
            # >= 1: another xdist worker's request may share this server
            assert m["kernelgate:num_requests_running"] >= 1 and m["kernelgate:cache_usage_perc"] > 0
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server)
        if m["kernelgate:num_requests_running"] == 0 and m["kernelgate:cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["kernelgate:num_requests_waiting"] == 0
    assert m["kernelgate:request_success_total[abort]"] == before + 1
    # the freed slot serves again
    r = httpx.post(f"{server}/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


BAD = [
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, "max_tokens", "must be >= 1"),
    ("top_p above 1", {"prompt": "hi", "top_p": 1.5}, "top_p", "(0, 1]"),
    ("negative temperature", {"prompt": "hi", "temperature": -0.5}, "temperature", ">= 0"),
    ("unknown model", {"prompt": "hi", "model": "gpt-9"}, "model", "unknown model 'gpt-9'"),
    ("prompt too long", {"prompt": [1] * MAX_LEN}, "prompt", f"maximum context length is {MAX_LEN}"),
    ("prompt + max_tokens too long", {"prompt": [1] * 1000, "max_tokens": 100}, "max_tokens", "exceed"),
    ("string max_tokens", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ("float max_tokens", {"prompt": "hi", "max_tokens": 5.0}, "max_tokens", "valid integer"),
    ("int prompt", {"prompt": 5}, "prompt", ""),
    ("missing prompt", {"max_tokens": 3}, "prompt", "Field required"),
    ("string stream", {"prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
    ("token id outside vocab", {"prompt": [1, 512]}, "prompt", "[0, 512)"),
    ("empty prompt", {"prompt": ""}, "prompt", "must not be empty"),
    ("n=0", {"prompt": "hi", "n": 0}, "n", "must be in [1, 64], got 0"),
    ("n above 64", {"prompt": "hi", "n": 65}, "n", "must be in [1, 64], got 65"),
    ("seed + n past 64 bits", {"prompt": "hi", "n": 2, "seed": 2**64 - 1}, "seed", "seed + n - 1 must fit"),
    ("best_of above n", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of", "only best_of = n"),
    ("logprobs above 20", {"prompt": "hi", "logprobs": 21}, "logprobs", "must be in [0, 20], got 21"),
    ("echo with logprobs", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo", "echo with logprobs is not"),
    ("empty stop", {"prompt": "hi", "stop": [""]}, "stop", "non-empty"),
    ("stop_token_ids outside vocab", {"prompt": "hi", "stop_token_ids": [9999]}, "stop_token_ids", "[0, 512)"),
]
BAD_CHAT = [
    ("no messages", {"messages": []}, "messages", "must not be empty"),
    ("messages not a list", {"messages": "hi"}, "messages", "valid list"),
    ("message without role", {"messages": [{"content": "hi"}]}, "messages.0.role", "Field required"),
    ("chat top_p", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p", "(0, 1]"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", "needs logprobs: true"),
    ("top_logprobs above 20", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                               "top_logprobs": 21}, "top_logprobs", "must be in [0, 20]"),
    ("logprobs not a bool", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs",
     "valid boolean"),
]


@pytest.mark.parametrize("what,body,param,text", BAD + BAD_CHAT, ids=[b[0].replace(" ", "-") for b in BAD + BAD_CHAT])
def test_invalid_request_is_400_naming_the_field(server, what, body, param, text):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(f"{server}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["message"].startswith(param) and text in err["message"]


@pytest.mark.parametrize("raw,text", [
    (b'{"prompt": "hi",', "not valid JSON"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature: must be a finite number"),
    (b'[1, 2]', "must be a JSON object"),
    (b'\xff\xfe', "not valid JSON"),
], ids=["truncated", "nan-temperature", "list-body", "not-utf8"])
def test_bad_json_bodies(server, raw, text):
    r = httpx.post(f"{server}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and text in r.json()["error"]["message"] and "Traceback" not in r.text


def test_metrics_parse(server):
    from prometheus_client.parser import text_string_to_metric_families
    httpx.post(f"{server}/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True}, timeout=60)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server}/metrics").text)}
    for name, kind in [("kernelgate:num_requests_running", "gauge"), ("kernelgate:num_requests_waiting", "gauge"),
                       ("kernelgate:cache_usage_perc", "gauge"),
                       ("kernelgate:time_to_first_token_seconds", "histogram"),
                       ("kernelgate:inter_token_latency_seconds", "histogram"),
                       ("kernelgate:e2e_request_latency_seconds", "histogram"),
                       ("kernelgate:prompt_tokens", "counter"), ("kernelgate:generation_tokens", "counter"),
                       ("kernelgate:engine_step_seconds", "histogram"), ("kernelgate:engine_step_tokens", "counter")]:
        assert fams[name].type == kind, name
    m = metrics(server)
    # the request's prompt went through at least one prefill step, its tokens through decode steps
    assert m["kernelgate:engine_step_seconds_count[prefill]"] >= 1 and m["kernelgate:engine_step_tokens_total[prefill]"] >= 2
    assert m["kernelgate:engine_step_seconds_count[decode]"] >= 1
    assert m["kernelgate:engine_step_seconds_sum[decode]"] > 0
    assert m["kernelgate:generation_tokens_total"] >= 3 and m["kernelgate:prompt_tokens_total"] >= 2
    assert m["kernelgate:time_to_first_token_seconds_count"] >= 1
    assert m["kernelgate:inter_token_latency_seconds_count"] >= 2


def test_bench_serve_smoke(server, tmp_path):
    from kernelgate import cli
    out = tmp_path / "result.json"
    assert cli.main(["bench", "serve", "--base-url", server, "--num-prompts", "4", "--input-len", "8",
                     "--output-len", "4", "--max-concurrency", "2", "--seed", "1", "--json",
                     "--result-file", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 4 and res["failed"] == 0 and res["errors"] == []
    assert res["total_input_tokens"] == 32 and res["total_output_tokens"] == 16   # ignore_eos: exact lengths
    assert res["model_id"] == BUILTIN and res["max_concurrency"] == 2
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration"):
        assert res[key] > 0, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in res
        assert res[f"mean_{metric}_ms"] > 0
    assert res["p99_e2el_ms"] >= res["median_e2el_ms"] >= res["median_ttft_ms"]


def test_bench_serve_prefix_workloads(server, tmp_path):
    """The multi-turn and shared-prefix workloads: turn k re-sends the conversation (its prompt is
    every earlier prompt and answer plus a new user turn), later turns and questions hit the prefix
    cache, and the hit rate is what the usage blocks said."""
    from kernelgate import cli
    out = tmp_path / "mt.json"
    assert cli.main(["bench", "serve", "--base-url", server, "--dataset", "multi-turn", "--num-conversations", "2",
                     "--turns", "3", "--system-len", "300", "--input-len", "20", "--output-len", "4", "--json",
                     "--result-file", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["failed"] == 0
    # prompts: turn k = 300 (system, first turn only... then the history) + 20 per turn + 4 per answer
    assert res["total_input_tokens"] == 2 * ((300 + 20) + (300 + 20 + 4 + 20) + (300 + 2 * 24 + 20))
    assert res["cached_tokens"] >= 2 * (300 + 300 + 24) and 0 < res["prefix_cache_hit_rate"] < 1
    out = tmp_path / "sp.json"
    assert cli.main(["bench", "serve", "--base-url", server, "--dataset", "shared-prefix", "--prefix-len", "300",
                     "--num-prompts", "3", "--input-len", "8", "--output-len", "2", "--json",
                     "--result-file", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 3 and res["max_concurrency"] == 1 and res["cached_tokens"] >= 2 * 256
    assert {"median_ttft_first_ms", "median_ttft_later_ms"} <= set(res)
