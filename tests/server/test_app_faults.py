"""Server faults that need a special engine, in process (httpx over ASGI, a stand-in engine):
API key, full queue -> 429 (a request's choices counted together), an engine error -> 500 or an error finish in a stream, with
OpenAI error bodies and the server still answering afterwards."""
import asyncio
import json

import httpx
from helpers.fake_engine import FakeEngine

from kernelgate.serving.async_engine import AsyncEngine
from kernelgate.server.app import create_app
from kernelgate.server.jobs import ModelInfo
from kernelgate.server.metrics import Metrics
from kernelgate.text.byte_tokenizer import ByteTokenizer


def serve(fake, api_key=None, max_queued=64):
    engine = AsyncEngine(fake, max_queued=max_queued, observer=Metrics("m")).start()
    info = ModelInfo("m", ByteTokenizer(), 256, 512, [256])
    app = create_app(engine, info, engine.observer, api_key=api_key)
    return engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def run(fn, fake, **kw):
    async def main():
        engine, client = serve(fake, **kw)
        try:
            return await asyncio.wait_for(fn(client), 20)
        finally:
            await client.aclose()
            await engine.shutdown(0.5)
    return asyncio.run(main())


def err(r, status, param=None, text=""):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == status and e["param"] == param
    assert text in e["message"] and "Traceback" not in r.text
    return e


def test_api_key():
    async def go(c):
        body = {"prompt": [1, 2], "max_tokens": 2}
        err(await c.post("/v1/completions", json=body), 401, text="missing API key")
        err(await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401,
            text="wrong API key")
        err(await c.get("/v1/models", headers={"Authorization": "secret"}), 401)
        ok = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "\x03\x04"
        assert (await c.get("/health")).status_code == 200       # not behind the key
    run(go, FakeEngine(), api_key="secret")


def test_full_queue_answers_429_then_recovers():
    fake = FakeEngine(slots=1)
    fake.gate.clear()

    async def go(c):
        body = {"prompt": [1], "max_tokens": 1}
        first = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
        await asyncio.sleep(0.2)
        r = await c.post("/v1/completions", json=body)
        e = err(r, 429, text="2 requests are already waiting for a slot and this one brings 1 (at most 2 wait)")
        assert e["type"] == "rate_limit_exceeded" and r.headers["retry-after"] == "1"
        fake.gate.set()
        assert [(await t).status_code for t in first] == [200, 200]
        assert (await c.post("/v1/completions", json=body)).status_code == 200
    run(go, fake, max_queued=2)


def test_engine_error_is_500_and_error_event_in_stream():
    async def go(c):
        e = err(await c.post("/v1/completions", json={"prompt": [99], "max_tokens": 3}), 500,
                text="engine step failed: RuntimeError: poisoned batch")
        assert e["type"] == "server_error"
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "c"}], "stream": True, "max_tokens": 3})
        assert r.status_code == 200
        events = [ln[6:] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == 500 and "poisoned batch" in last["error"]["message"]
        # as vLLM: the error event stands in for the last chunk; no chunk says finish_reason "error"
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
        # the server goes on
        ok = await c.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    # 'c' (99) is in the chat prompt too, so both requests hit the poisoned step
    run(go, FakeEngine(poison=99))


def test_unknown_route_and_method():
    async def go(c):
        err(await c.get("/v1/nothing"), 404)
        err(await c.get("/v1/completions"), 405)
    run(go, FakeEngine())


def test_disconnect_while_sending_the_body_is_a_quiet_abort(caplog):
    """Half a body, then the client goes: no error logged, nothing reaches the engine, the server goes on."""
    fake, prompts, sent = FakeEngine(), [], []
    add = fake.add_request
    fake.add_request = lambda rid, prompt, params: (prompts.append(list(prompt)), add(rid, prompt, params))[1]
    messages = [{"type": "http.request", "body": b'{"prompt": [1, 2], "max_', "more_body": True},
                {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0) if messages else await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    async def main():
        engine, client = serve(fake)
        try:
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                     "client": ("t", 1), "server": ("t", 80)}
            await asyncio.wait_for(client._transport.app(scope, receive, send), 5)
            assert (await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})).status_code == 200
        finally:
            await client.aclose()
            await engine.shutdown(0.5)

    with caplog.at_level("DEBUG", logger="kernelgate.server"):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= 30], [r.getMessage() for r in caplog.records]
    assert any("disconnected while sending the body of /v1/completions" in r.getMessage() for r in caplog.records)
    assert sent[0]["status"] == 499 and prompts == [[5]], (sent, prompts)
