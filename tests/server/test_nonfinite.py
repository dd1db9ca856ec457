"""Non-finite logits on the real server: a checkpoint of the built-in model whose embedding row
of one token T is NaN, so any sequence that holds T has NaN logits from then on. A prompt
that greedily generates T streams its good tokens (T included: its logits were fine), then
fails: a stream ends with an error event (500, "non-finite logits"), then [DONE], and no
chunk with garbage or an "error" finish reason; a whole response is 500. Requests beside it
are unaffected, its slot and cache are freed and serve the next request correctly, and the
server logs the failure. (vLLM's handling of finish reason "error".)"""
import asyncio
import json

import httpx
import pytest
import torch
from shared_server import ROOT, run_folder, shared_server

import kernelgate
from kernelgate.cli.model import builtin_model
from kernelgate.models.loader import save_checkpoint

N = 6          # max_tokens of every request here


def greedy(model, prompt, n=N):
    return kernelgate.generate(model, [prompt], max_new_tokens=n, stop_token_ids=[])[0].token_ids


@pytest.fixture(scope="module")
def case(model):
    """(P, T, good): a prompt P whose greedy output has T third (and nowhere before, nor in P),
    and a prompt `good` whose output never meets T."""
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        p = torch.randint(0, 256, (5,), generator=g).tolist()
        out = greedy(model, p)
        t = out[2]
        if t not in p and t not in out[:2]:
            break
    else:
        raise AssertionError("no prompt of the built-in model generates a fresh token third")
    good = [q for q in ([1, 2, 3], [40, 41], [100, 7, 9, 11], [9, 9]) if t not in q + greedy(model, q)]
    assert len(good) >= 2, "the poisoned token meets every healthy prompt"
    return p, t, good[:2]


@pytest.fixture(scope="module")
def nan_server(tmp_path_factory, case):
    _, t, _ = case
    m = builtin_model()
    with torch.no_grad():
        m.model.embed_tokens.weight[t] = float("nan")
    ckpt = save_checkpoint(m, tmp_path_factory.mktemp("nan-ckpt"))
    folder = run_folder(tmp_path_factory) / "nonfinite"
    folder.mkdir(exist_ok=True)
    args = ["--model", str(ckpt), "--served-model-name", "nan", "--max-num-seqs", "2", "--max-model-len", "256",
            "--log-level", "warning"]
    with shared_server(folder, args, ROOT) as url:
        yield url, folder / "server.log"


def metric(base, name, reason=None) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in fam.samples:
            if s.name == name and s.labels.get("finished_reason") == reason:
                return s.value
    return 0.0


def body(prompt, **kw):
    return {"model": "nan", "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


async def sse(base, b):
    async with httpx.AsyncClient(timeout=120) as c, c.stream("POST", f"{base}/v1/completions", json=b) as r:
        assert r.status_code == 200
        return [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]


def test_stream_ends_with_error_event_after_the_good_tokens(nan_server, case, model):
    base, log = nan_server
    p, _, _ = case
    before = metric(base, "kernelgate:request_success_total", "error")
    events = asyncio.run(sse(base, body(p, stream=True)))
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and err["type"] == "server_error"
    assert "non-finite logits at position 7" in err["message"] and "Traceback" not in err["message"]
    chunks = [json.loads(e)["choices"][0] for e in events[:-2]]
    assert [x for c in chunks for x in c["token_ids"]] == greedy(model, p)[:3]       # up to T, then nothing
    assert all(c["finish_reason"] is None for c in chunks)
    # >=: another xdist worker may be failing its own request on this shared server right now
    assert metric(base, "kernelgate:request_success_total", "error") >= before + 1
    text = log.read_text()
    assert any("non-finite logits" in ln and "cmpl-" in ln for ln in text.splitlines()), text[-2000:]


def test_whole_response_is_500_and_openai_client_raises(nan_server, case, model):
    openai = pytest.importorskip("openai")
    base, _ = nan_server
    p, _, _ = case
    r = httpx.post(f"{base}/v1/completions", json=body(p), timeout=120)
    assert r.status_code == 500 and "Traceback" not in r.text
    e = r.json()["error"]
    assert e["type"] == "server_error" and "request failed in the engine: non-finite logits" in e["message"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.InternalServerError, match="non-finite logits"):
        client.completions.create(model="nan", prompt=p, max_tokens=N, temperature=0)
    ids, reasons = [], []
    with pytest.raises(openai.APIError, match="non-finite logits"):
        for chunk in client.completions.create(model="nan", prompt=p, max_tokens=N, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
            ids += chunk.choices[0].token_ids          # (a reader that fell behind gets steps merged)
            reasons.append(chunk.choices[0].finish_reason)
    assert ids == greedy(model, p)[:3] and reasons and set(reasons) == {None}


def test_failure_is_the_request_alone_and_frees_its_slot(nan_server, case, model):
    base, _ = nan_server
    _, t, (good, good2) = case

    async def both():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(c.post(f"{base}/v1/completions", json=body([5, t, 6])),
                                        c.post(f"{base}/v1/completions", json=body(good)))
    bad, ok = asyncio.run(both())
    assert bad.status_code == 500 and "non-finite logits at position 2" in bad.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == greedy(model, good)
    # the failed requests' slots and blocks are free and clean: two more fill both slots
    async def two():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(f"{base}/v1/completions", json=body(q)) for q in (good, good2)))
    again = [r.json()["choices"][0]["token_ids"] for r in asyncio.run(two())]
    assert again == [greedy(model, good), greedy(model, good2)]
    assert metric(base, "kernelgate:num_requests_running") == 0
    assert metric(base, "kernelgate:cache_usage_perc") == 0
