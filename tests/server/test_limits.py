"""The server's bounds on work, on a real HTTP server of its own on 127.0.0.1 (the app and
AsyncEngine over a real Engine of the built-in model, uvicorn on a thread: a queue of 4 and one
slot, which the shared server's other users could not share): a request's n choices count
together against --max-queued-requests (past it: 429 with Retry-After, through the official
openai client), a request with more choices than the queue holds is 400, a queued stream that
never got a chunk is aborted the moment its client leaves, and the freed queue serves again."""
import json
import socket
import threading
import time

import httpx
import pytest

import kernelgate
from kernelgate.cli.model import BUILTIN, builtin_model
from kernelgate.engine.engine import Engine
from kernelgate.server.app import create_app
from kernelgate.server.jobs import ModelInfo
from kernelgate.server.metrics import Metrics
from kernelgate.serving.async_engine import AsyncEngine

QUEUE, LEN = 4, 512


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    uvicorn = pytest.importorskip("uvicorn")
    model = builtin_model()
    engine = Engine(model, max_num_seqs=1, max_model_len=LEN, max_num_batched_tokens=64)
    metrics = Metrics(BUILTIN)
    aengine = AsyncEngine(engine, max_queued=QUEUE, observer=metrics).start()
    info = ModelInfo(BUILTIN, model.tokenizer, LEN, model.config.vocab_size, list(model.config.eos_token_ids))
    app = create_app(aengine, info, metrics, shutdown_timeout=1.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", model
    server.should_exit = True
    thread.join(30)
    sock.close()


def gauges(base) -> tuple:
    from prometheus_client.parser import text_string_to_metric_families
    m = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text) for s in f.samples
         if not s.labels.get("finished_reason")}
    return m["kernelgate:num_requests_running"], m["kernelgate:num_requests_waiting"]


def until(cond, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def raw_stream(base: str, body: dict) -> socket.socket:
    """A streaming POST on a socket of its own; closing it is the client leaving."""
    port = int(base.rsplit(":", 1)[1])
    raw = json.dumps({**body, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(raw) + raw)
    return s


def test_queue_bound_counts_every_choice(small):
    openai = pytest.importorskip("openai")
    base, model = small
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    long = {"prompt": [1, 2, 3], "max_tokens": LEN - 8, "ignore_eos": True, "temperature": 0}
    a = raw_stream(base, {**long, "n": QUEUE})                    # 4 choices: the slot and 3 waiting
    try:
        until(lambda: gauges(base) == (1, QUEUE - 1), 30, "the 4 choices never ran / waited")
        with pytest.raises(openai.RateLimitError) as e:               # 3 waiting + 2 > 4
            client.completions.create(model=BUILTIN, prompt=[4, 5], n=2, max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert "3 requests are already waiting for a slot and this one brings 2 (at most 4 wait)" in str(e.value)
        with pytest.raises(openai.BadRequestError, match=r"1 prompt\(s\) x n 5 = 5 choices; this server takes at most 4"):
            client.completions.create(model=BUILTIN, prompt=[4, 5], n=QUEUE + 1, max_tokens=2)
        d = raw_stream(base, {"prompt": [6, 7], "max_tokens": 8})    # fits (3 + 1): waits, no chunk due
        until(lambda: gauges(base) == (1, QUEUE), 10, "the fourth waiting request never showed")
        d.close()
        until(lambda: gauges(base) == (1, QUEUE - 1), 2, "a waiting stream outlived its client")
    finally:
        a.close()
    until(lambda: gauges(base) == (0, 0), 2, "the 4 choices outlived their client")
    r = client.completions.create(model=BUILTIN, prompt=[4, 5], n=2, max_tokens=4, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    want = kernelgate.generate(model, [[4, 5]], max_new_tokens=4, stop_token_ids=[])[0].token_ids
    assert [c.token_ids for c in r.choices] == [want, want]
