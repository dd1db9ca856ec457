"""Logprobs on the real server (built-in model), through the openai client and raw SSE, checked
against a hand computation: log_softmax of the offline model's logits for prompt + output
(`model(ids)` in this process, the same seeded weights). They are the raw distribution's,
before temperature / top-p, as vLLM reports them."""
import asyncio
import json

import httpx
import pytest
import torch

import kernelgate
from kernelgate.cli.model import BUILTIN

TOL = 1e-4      # fp32: the engine's chunked prefill + decode steps vs one full forward


def reference(model, prompt: list, out: list) -> torch.Tensor:
    """[len(out), V]: log_softmax of the logits that predicted each output token."""
    logits = model(torch.tensor([prompt + out[:-1]]))[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


def top(ref_row: torch.Tensor, k: int) -> list:
    vals, ids = ref_row.topk(k)
    return list(zip(ids.tolist(), vals.tolist()))


def decode(model, t: int) -> str:
    return model.tokenizer.decode([t], skip_special_tokens=False)


def offsets(tokens: list, start: int = 0) -> list:
    out = []
    for s in tokens:
        out.append(start)
        start += len(s)
    return out


def test_completion_logprobs_greedy(client, model):
    prompt = list(b"Hello, w")
    r = client.completions.create(model=BUILTIN, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                                              "ignore_eos": True})
    c = r.choices[0]
    out = c.token_ids
    assert out == kernelgate.generate(model, [prompt], max_new_tokens=5, stop_token_ids=[])[0].token_ids
    ref = reference(model, prompt, out)
    lp = c.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in out]
    assert lp.token_logprobs == pytest.approx([ref[j, t].item() for j, t in enumerate(out)], abs=TOL)
    assert lp.text_offset == offsets(lp.tokens)
    for j, t in enumerate(out):
        want = {f"token_id:{i}": v for i, v in top(ref[j], 3)}
        got = lp.top_logprobs[j]
        assert next(iter(got)) == f"token_id:{t}"             # the sampled token first, then the top 3
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=TOL)


def test_completion_logprobs_are_raw_under_temperature(client, model):
    """The sampled token's logprob is the model's, not the temperature-scaled / top-p-cut one;
    logprobs=0 gives the sampled token alone; token text is the token decoded alone."""
    prompt = list(b"The sky is")
    kw = dict(model=BUILTIN, prompt=prompt, max_tokens=4, temperature=1.7, top_p=0.95, seed=11,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    a = client.completions.create(logprobs=0, **kw).choices[0]
    b = client.completions.create(**kw).choices[0]
    assert a.token_ids == b.token_ids and a.text == b.text and b.logprobs is None    # logprobs change nothing
    out = a.token_ids
    ref = reference(model, prompt, out)
    assert a.logprobs.tokens == [decode(model, t) for t in out]
    assert a.logprobs.token_logprobs == pytest.approx([ref[j, t].item() for j, t in enumerate(out)], abs=TOL)
    assert [list(d) for d in a.logprobs.top_logprobs] == [[decode(model, t)] for t in out]
    scaled = torch.log_softmax(ref / 1.7, dim=-1)          # what temperature sampling drew from
    assert any(abs(scaled[j, t] - ref[j, t]) > 1e-2 for j, t in enumerate(out))


async def _sse(base, path, body) -> list:
    events = []
    async with httpx.AsyncClient(timeout=120) as c, c.stream("POST", f"{base}{path}", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_completion_logprobs_stream_equals_whole(server):
    prompts = [list(b"abc"), list(b"0123456789")]
    body = {"model": BUILTIN, "prompt": prompts, "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "ignore_eos": True, "return_token_ids": True}
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=120).json()["choices"]
    events = asyncio.run(_sse(server, "/v1/completions", {**body, "stream": True}))
    for i, w in enumerate(whole):
        chunks = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        lps = [c["logprobs"] for c in chunks if c["token_ids"]]
        assert all(c["logprobs"] is None for c in chunks if not c["token_ids"])
        assert all(len(lp["tokens"]) == len(c["token_ids"]) for lp, c in
                   zip(lps, [c for c in chunks if c["token_ids"]]))
        joined = {k: [x for lp in lps for x in lp[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                "text_offset")}
        # text_offset runs on over the chunks. Values to 1e-5: another test's requests in the same
        # server batch change fp32 rounding (batch composition), not the tokens
        assert {k: joined[k] for k in ("tokens", "text_offset")} == \
               {k: w["logprobs"][k] for k in ("tokens", "text_offset")}
        assert joined["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-5)
        assert [list(d) for d in joined["top_logprobs"]] == [list(d) for d in w["logprobs"]["top_logprobs"]]
        for got, want in zip(joined["top_logprobs"], w["logprobs"]["top_logprobs"]):
            assert got == pytest.approx(want, abs=1e-5)
        assert w["logprobs"]["text_offset"] == offsets(w["logprobs"]["tokens"])
        assert [t for c in chunks for t in c["token_ids"]] == w["token_ids"]


def _chat_ids(model, messages):
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_chat_logprobs_and_stream(client, model):
    messages = [{"role": "user", "content": "Hi"}]
    kw = dict(model=BUILTIN, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    out = c.model_extra["token_ids"]
    ref = reference(model, _chat_ids(model, messages), out)
    content = c.logprobs.content
    assert len(content) == len(out) == 4
    for j, (t, e) in enumerate(zip(out, content)):
        assert e.token == decode(model, t) and e.bytes == list(e.token.encode())
        assert e.logprob == pytest.approx(ref[j, t].item(), abs=TOL)
        want = top(ref[j], 2)
        assert [x.token for x in e.top_logprobs] == [decode(model, i) for i, _ in want]
        assert [x.logprob for x in e.top_logprobs] == pytest.approx([v for _, v in want], abs=TOL)
        assert all(x.bytes == list(x.token.encode()) for x in e.top_logprobs)

    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
    streamed = [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    # (the same prompt again: it may resume from the prefix cache, equal within fp32 rounding)
    assert [(e.token, [x.token for x in e.top_logprobs]) for e in streamed] == \
        [(e.token, [x.token for x in e.top_logprobs]) for e in content]
    assert [v for e in streamed for v in [e.logprob, *(x.logprob for x in e.top_logprobs)]] == pytest.approx(
        [v for e in content for v in [e.logprob, *(x.logprob for x in e.top_logprobs)]], rel=1e-5, abs=1e-6)

    # logprobs: true alone -> the sampled token's entry with no alternatives
    r0 = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert [(e.token, e.top_logprobs) for e in r0.choices[0].logprobs.content] == [(e.token, []) for e in content]
    assert client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None
