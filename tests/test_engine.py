"""Engine: batch independence under continuous batching, stop / max tokens, sampling
(seeded, top-k, top-p against hand-computed cases), state pool and scheduler errors.
Reference for token streams: the same model run one request at a time (greedy) and a
plain full-sequence forward re-run per token (no cache)."""
import pytest
import torch

import kernelgate
from kernelgate import KernelgateError
from kernelgate.engine import SamplingParams, Scheduler, StatePool
from kernelgate.engine.sampling import filter_logits
from kernelgate.models import build, tiny


@pytest.fixture(scope="module")
def model():
    return build(tiny(vocab_size=128), seed=7)


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 1, 13, 8, 3)]


def test_greedy_equals_uncached_forward(model):
    prompt = _prompts()[2]
    got = kernelgate.generate(model, [prompt], max_new_tokens=5, stop_token_ids=())[0].token_ids
    seq = list(prompt)
    for _ in range(5):   # recompute the whole sequence each token: no state pool reuse
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[len(prompt):]


def test_batch_independence(model):
    prompts = _prompts()
    alone = [kernelgate.generate(model, [p], max_new_tokens=6, stop_token_ids=())[0].token_ids for p in prompts]
    # 2 slots for 5 requests: requests join as others leave, prefill and decode steps interleave
    mixed = kernelgate.generate(model, prompts, max_new_tokens=6, stop_token_ids=(), max_batch=2)
    assert [r.token_ids for r in mixed] == alone
    together = kernelgate.generate(model, prompts[::-1], max_new_tokens=6, stop_token_ids=(), max_batch=5)
    assert [r.token_ids for r in together] == alone[::-1]


def test_requests_join_between_steps(model):
    p = _prompts()
    sched = Scheduler(model, max_slots=3, max_len=64)
    a = sched.add(kernelgate.engine.Request(p[0], SamplingParams(max_new_tokens=6)))
    kinds = [sched.step().kind, sched.step().kind]                       # prefill a, decode a
    b = sched.add(kernelgate.engine.Request(p[2], SamplingParams(max_new_tokens=3)))
    while not sched.idle:
        kinds.append(sched.step().kind)
    assert kinds[:3] == ["prefill", "decode", "prefill"] and kinds.count("prefill") == 2
    ref = kernelgate.generate(model, [p[0], p[2]], max_new_tokens=6, stop_token_ids=())
    assert a.output == ref[0].token_ids and b.output == ref[1].token_ids[:3]
    assert sched.pool.free_slots == 3


def test_stop_tokens_and_max_tokens(model):
    prompt = _prompts()[0]
    full = kernelgate.generate(model, [prompt], max_new_tokens=8, stop_token_ids=())[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 8
    stop = full.token_ids[3]
    first = full.token_ids.index(stop)
    r = kernelgate.generate(model, [prompt], max_new_tokens=8, stop_token_ids=[stop])[0]
    assert r.finish_reason == "stop" and r.token_ids == full.token_ids[:first + 1]


def test_seeded_sampling(model):
    prompts = _prompts()[:3]
    kw = dict(max_new_tokens=6, temperature=1.5, top_p=0.95, seed=11, stop_token_ids=())
    a = kernelgate.generate(model, prompts, **kw)
    b = kernelgate.generate(model, prompts, max_batch=1, **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]           # seed per request, not per batch
    c = kernelgate.generate(model, prompts, **{**kw, "seed": 12})
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    greedy = kernelgate.generate(model, prompts, max_new_tokens=6, stop_token_ids=())
    topk1 = kernelgate.generate(model, prompts, **{**kw, "top_k": 1})
    assert [r.token_ids for r in topk1] == [r.token_ids for r in greedy]


def test_filter_logits_hand_computed():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    inf = float("-inf")
    # top-p 0.7: 0.5 < 0.7 keeps the 2nd; 0.5 + 0.2 = 0.7 >= 0.7 drops the rest
    assert torch.isinf(filter_logits(logits, 1.0, 0, 0.7)).tolist() == [False, False, True, True, True]
    assert torch.isinf(filter_logits(logits, 1.0, 0, 0.71)).tolist() == [False, False, False, True, True]
    assert torch.isinf(filter_logits(logits, 1.0, 3, 1.0)).tolist() == [False, False, False, True, True]
    assert filter_logits(logits, 1.0, 0, 0.1).tolist()[1:] == [inf] * 4     # the top token always stays
    torch.testing.assert_close(filter_logits(logits, 2.0, 0, 1.0), logits / 2)


def test_sampling_distribution_follows_probs():
    from kernelgate.engine.sampling import make_generator, sample
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]]))
    g = make_generator(0, "cpu")
    p = SamplingParams(temperature=1.0)
    draws = torch.tensor([sample(logits, [p], [g])[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=4).float() / 3000
    assert torch.allclose(freq[:3], torch.tensor([0.6, 0.3, 0.1]), atol=0.04) and freq[3] == 0


def test_errors(model):
    with pytest.raises(KernelgateError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(KernelgateError, match="max_new_tokens must be >= 1"):
        kernelgate.generate(model, [[1, 2]], max_new_tokens=0)
    with pytest.raises(KernelgateError, match="exceeds max_len 10"):
        kernelgate.generate(model, [[1] * 8], max_new_tokens=4, max_len=10)
    with pytest.raises(KernelgateError, match=r"token ids outside \[0, 128\)"):
        kernelgate.generate(model, [[1, 500]], max_new_tokens=2)
    with pytest.raises(KernelgateError, match="string prompts need a checkpoint with a tokenizer"):
        kernelgate.generate(model, ["hello"], max_new_tokens=2)
    pool = StatePool(model.config, 1, 8, "cpu", torch.float32)
    slot = pool.alloc()
    with pytest.raises(KernelgateError, match="all 1 slots are in use"):
        pool.alloc()
    pool.free(slot)
    with pytest.raises(KernelgateError, match="slot 0 is not in use"):
        pool.free(slot)


def test_slot_reuse_starts_from_zero_state(model):
    pool = StatePool(model.config, 1, 8, "cpu", torch.float32)
    s = pool.alloc()
    for t in pool.kda_state.values():
        t.fill_(3.0)
    pool.free(s)
    assert pool.alloc() == s and all(float(t.abs().sum()) == 0 for t in pool.kda_state.values())
