"""Prefix caching through the real server and the official openai client: a conversation's next
turn and a shared system prompt are served from the cache -- `usage.prompt_tokens_details.
cached_tokens` says how much, streaming with include_usage too, and /metrics counts prefix-cache
queries and hits in tokens -- with the tokens of an offline engine that has no prefix cache."""
import random

import kernelgate
from kernelgate.cli.model import BUILTIN

N = 8


def _offline_uncached(model, prompt, n=N):
    eng = kernelgate.Engine(model, max_num_seqs=1, max_model_len=1024, enable_prefix_caching=False)
    [r] = kernelgate.generate(model, [prompt], max_new_tokens=n, temperature=0.0, engine=eng)
    eng.close()
    return r.token_ids


def _counters(server) -> tuple:
    from test_server import metrics
    m = metrics(server)
    return m["kernelgate:prefix_cache_queries_total"], m["kernelgate:prefix_cache_hits_total"]


def test_next_turn_resumes_where_the_last_ended(client, model, server):
    rng = random.Random(7)
    turn1 = [rng.randrange(0, 256) for _ in range(300)]
    q0, h0 = _counters(server)
    r1 = client.completions.create(model=BUILTIN, prompt=turn1, max_tokens=N, temperature=0,
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
    turn2 = turn1 + r1.choices[0].token_ids + [rng.randrange(0, 256) for _ in range(20)]
    r2 = client.completions.create(model=BUILTIN, prompt=turn2, max_tokens=N, temperature=0,
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r1.choices[0].token_ids == _offline_uncached(model, turn1)
    assert r2.choices[0].token_ids == _offline_uncached(model, turn2)
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(turn1)
    q1, h1 = _counters(server)
    assert q1 - q0 >= len(turn1) + len(turn2) and h1 - h0 >= len(turn1)


def test_shared_system_prompt_streamed_with_usage(client, model):
    rng = random.Random(9)
    system = "".join(rng.choice("abcdefghij klmnop") for _ in range(400))
    answers = []
    for question in ("What is it?", "Why so?", "And then?"):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        chunks = list(client.chat.completions.create(model=BUILTIN, messages=msgs, max_tokens=N, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        answers.append(("".join(c.choices[0].delta.content or "" for c in chunks[:-1] if c.choices),
                        usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))
    # the first may find the system prompt cached by an earlier test; the later ones do
    assert all(cached >= 256 for _, cached, _ in answers[1:]), answers
    tok = model.tokenizer
    for (text, _, _), question in zip(answers, ("What is it?", "Why so?", "And then?")):
        ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                  {"role": "user", "content": question}],
                                                 tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        assert text == tok.decode(_offline_uncached(model, ids), skip_special_tokens=True)
