"""The shared real server (built-in model) against hostile and careless clients: fields it does
not implement (protocol.NOT_IMPLEMENTED, field by field) and unknown ones are 400 naming the
field; text that is not Unicode is 400; random JSON of right and wrong shapes never gets a 500
and leaves the server answering as before; one request's prompts x n choices are bounded,
admitted together, counted in the waiting gauge, and all aborted when its client leaves.
(The server's log holding no traceback is checked when it stops: shared_server.py.)"""
import json
import random
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from shared_server import MAX_SEQS

import kernelgate
from kernelgate.cli.model import BUILTIN
from kernelgate.server.protocol import MAX_CHOICES, NOT_IMPLEMENTED

ENDPOINT = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BASE = {"completions": {"prompt": [5, 6, 7], "max_tokens": 2},
        "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
REALISTIC = {"logit_bias": {"5": 100}, "response_format": {"type": "json_object"},
             "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
             "tool_choice": "required", "presence_penalty": 0.5, "frequency_penalty": -1, "store": True,
             "suffix": "tail", "echo": True, "min_tokens": 3, "repetition_penalty": 1.2}


def _err(r, status, param):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["param"] == param and e["code"] == status and e["message"].startswith(param), e
    return e["message"]


@pytest.mark.parametrize("endpoint,field", [(e, f) for e, fields in NOT_IMPLEMENTED.items() for f in fields],
                         ids=lambda v: v)
def test_not_implemented_field_is_400_naming_it(server, endpoint, field):
    value = REALISTIC.get(field, {"not": "nothing"})
    r = httpx.post(server + ENDPOINT[endpoint], json={**BASE[endpoint], field: value}, timeout=30)
    assert "is not supported by kernelgate" in _err(r, 400, field)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_fields_that_ask_for_nothing_are_accepted(server, endpoint):
    """null for every listed field, then each one's first do-nothing value, in one request each."""
    nulls = {f: None for f in NOT_IMPLEMENTED[endpoint]}
    offs = {f: v[0] for f, v in NOT_IMPLEMENTED[endpoint].items() if v}
    for extra in (nulls, offs):
        r = httpx.post(server + ENDPOINT[endpoint], json={**BASE[endpoint], **extra, "user": "u1"}, timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("endpoint,body,param,text", [
    ("completions", {"best_of_n": 2}, "best_of_n", "unknown field"),
    ("completions", {"stream_options": {"include_usage": True, "chunk": 1}}, "stream_options.chunk", "unknown field"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages.0.name", "unknown field"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
     "messages.0.content.0.x", "unknown field"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0", "content part type \"image_url\" is not supported (only 'text')"),
], ids=["top-level", "stream-options", "message-name", "text-part-extra", "image-part"])
def test_unknown_field_is_400_naming_it(server, endpoint, body, param, text):
    r = httpx.post(server + ENDPOINT[endpoint], json={**BASE[endpoint], **body}, timeout=30)
    assert text in _err(r, 400, param)


@pytest.mark.parametrize("raw,param,text", [
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt", "lone surrogate"),
    (b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1", "lone surrogate"),
    (b'{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', "stop.0", "lone surrogate"),
    (b'{"prompt": "hi", "\\ud800": 1}', "body", "lone surrogate"),
    (b'{"prompt": "a\xed\xa0\x80b"}', "prompt", "lone surrogate"),              # a surrogate encoded as UTF-8
    (b'{"prompt": "a\xffb"}', None, "not valid UTF-8"),
    (b'{"prompt": "a\xc3"}', None, "not valid UTF-8"),
    (b'[' * 100_000 + b']' * 100_000, None, "nested too deeply"),
], ids=["surrogate", "surrogate-in-list", "surrogate-stop", "surrogate-key", "utf8-surrogate", "bad-byte",
        "cut-character", "deep"])
def test_text_that_is_not_unicode_is_400(server, raw, param, text):
    r = httpx.post(f"{server}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and text in e["message"]


def test_chat_surrogate_is_400(server):
    raw = b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    r = httpx.post(f"{server}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert "lone surrogate" in _err(r, 400, "messages.0.content")


def test_body_over_the_limit_is_413_before_it_is_read(server):
    u = urlsplit(server)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000000000\r\n\r\n{")
        got = b""
        while b"}}" not in got:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    assert got.startswith(b"HTTP/1.1 413") and b"over the server's" in got


def test_choices_per_request_are_bounded(server):
    n_prompts = MAX_CHOICES // 2 + 1
    r = httpx.post(f"{server}/v1/completions", json={"prompt": [[1, 2]] * n_prompts, "n": 2, "max_tokens": 1})
    assert f"{n_prompts} prompt(s) x n 2 = {2 * n_prompts} choices; this server takes at most {MAX_CHOICES}" \
        in _err(r, 400, "prompt")
    r = httpx.post(f"{server}/v1/completions", json={"prompt": ["x"] * (MAX_CHOICES + 1), "max_tokens": 1})
    _err(r, 400, "prompt")


def _gauges(base) -> tuple:
    from prometheus_client.parser import text_string_to_metric_families
    m = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text) for s in f.samples
         if not s.labels.get("finished_reason")}
    return m["kernelgate:num_requests_running"], m["kernelgate:num_requests_waiting"]


def _until(cond, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _raw_post(base: str, path: str, body: dict) -> socket.socket:
    """A POST sent on a socket of its own, left open: closing it is the client disconnecting."""
    u = urlsplit(base)
    raw = json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              f"content-length: {len(raw)}\r\n\r\n".encode() + raw)
    return s


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_disconnect_aborts_every_choice(server, stream):
    """64 prompts x n 2 = 128 long jobs: admitted together (the waiting gauge shows them), all
    gone from the engine within seconds of the client closing its connection."""
    body = {"prompt": [[i + 1, 7] for i in range(64)], "n": 2, "max_tokens": 500, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    s = _raw_post(server, "/v1/completions", body)
    seen = []

    def admitted():
        seen.append(_gauges(server)[1])
        return seen[-1] >= 128 - 2 * MAX_SEQS
    try:
        _until(admitted, 30, "the 128 jobs never showed as waiting")
    finally:
        s.close()
    # all at once: the gauge goes from the other clients' few (another xdist worker's) to all 128
    assert all(w <= 2 * MAX_SEQS or w >= 128 - 2 * MAX_SEQS for w in seen), seen
    _until(lambda: _gauges(server) == (0, 0), 10, "the request's jobs still run after its client left")


TEXTS = ["", "a", "\ud800", "b\udc00x", "<|im_end|>", "héllo 🌍", "x" * 300]
NUMBERS = [0, 1, -1, 7, 2**63, -2**70, 10**30, 0.5, -0.0, 1e-320, 1e-30, 1e308]


def _fuzz_value(rng: random.Random, depth: int = 0, kind: str = ""):
    """A random JSON value; kind "text" / "number": mostly one of those (hostile ones included)."""
    if kind and rng.random() < 0.6:
        return rng.choice(TEXTS if kind == "text" else NUMBERS)
    pool = [None, True, False, *NUMBERS[:4], *TEXTS[:4]]
    if depth < 3:
        pool += ["list", "dict", "list", "ids"]
    v = rng.choice(pool)
    if v == "list":
        return [_fuzz_value(rng, depth + 1, kind) for _ in range(rng.randint(1, 3))]
    if v == "dict":
        return {rng.choice(["role", "content", "type", "text", "x"]): _fuzz_value(rng, depth + 1, kind)
                for _ in range(rng.randint(1, 3))}
    if v == "ids":
        return [rng.randint(-2, 520) for _ in range(rng.randint(0, 4))]
    return v


def _fuzz_body(rng: random.Random, endpoint: str):
    """A valid body with one to three fields replaced or added (known ones, listed ones, made-up
    ones), or now and then no object at all; generation stays short (max_tokens, n bounded)."""
    r = rng.random()
    if r < 0.05:
        return rng.choice([b"", b"{", b"null", b"[1,2]", b'"text"', b"3", b"\xff\xfe", b'{"prompt": }'])
    if r < 0.1:
        return json.dumps(_fuzz_value(rng)).encode()
    body = json.loads(json.dumps(BASE[endpoint]))
    fields = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
              "stream", "stream_options", "n", "ignore_eos", "return_token_ids", "skip_special_tokens",
              "return_tokens_as_token_ids", "logprobs", "echo", "best_of", "messages", "top_logprobs",
              "max_completion_tokens", "add_generation_prompt", "user", "listed", "listed", "zzz",
              *["prompt" if endpoint == "completions" else "messages", "stop", "temperature", "seed"] * 4]
    for _ in range(rng.choice([1, 1, 2, 3])):
        f = rng.choice(fields)
        if f == "listed":
            f = rng.choice(list(NOT_IMPLEMENTED[endpoint]))
        kind = "text" if f in ("prompt", "stop", "model", "user") else \
            "number" if f in ("temperature", "top_p", "top_k", "seed", "max_tokens", "n", "logprobs") else ""
        if f == "messages" and rng.random() < 0.7:
            body[f] = [{"role": rng.choice(["user", "system", "assistant", "", 5]),
                        "content": _fuzz_value(rng, kind="text")} for _ in range(rng.randint(0, 2))]
        else:
            body[f] = _fuzz_value(rng, kind=kind)
    for f, hi in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):   # bounded work when valid
        if isinstance(body.get(f), int) and not isinstance(body[f], bool) and 0 < body[f]:
            body[f] = min(body[f], hi)
    if endpoint == "chat" and not isinstance(body.get("max_tokens"), int):
        body["max_completion_tokens"] = 3
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 3:
        body["prompt"] = body["prompt"][:3]
    return json.dumps(body).encode()


def test_fuzz_never_500_and_the_server_answers_as_before(server, model):
    rng = random.Random(34)
    want = kernelgate.generate(model, [[9, 8, 7]], max_new_tokens=6, stop_token_ids=[])[0].token_ids
    probe = {"model": BUILTIN, "prompt": [9, 8, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True}
    statuses = {}
    with httpx.Client(timeout=60) as c:
        assert c.post(f"{server}/v1/completions", json=probe).json()["choices"][0]["token_ids"] == want
        for i in range(200):
            endpoint = "chat" if i % 2 else "completions"
            raw = _fuzz_body(rng, endpoint)
            r = c.post(server + ENDPOINT[endpoint], content=raw, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400, 413, 422, 429), (raw[:300], r.status_code, r.text[:300])
            if r.status_code != 200:
                e = r.json()["error"]
                assert set(e) == {"message", "type", "param", "code"} and "\n" not in e["message"], e
        assert statuses.get(200, 0) >= 5 and statuses.get(400, 0) >= 100, statuses
        assert c.post(f"{server}/v1/completions", json=probe).json()["choices"][0]["token_ids"] == want
        assert c.get(f"{server}/health").json() == {"status": "ok"}
