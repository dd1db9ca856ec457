"""Engine logprobs (SamplingParams.logprobs): each output token's logprob and the top k are
those of log_softmax of the model's raw logits at that position, before temperature / top-k /
top-p (vLLM's default), checked against a full forward over prompt + output."""
import pytest
import torch

from kernelgate.engine.engine import Engine
from kernelgate.engine.params import SamplingParams
from kernelgate.models import build, tiny
from kernelgate.errors import KernelgateError


def _run(engine, prompts, params):
    outs = {f"r{i}": ([], []) for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    while engine.has_unfinished():
        for o in engine.step():
            ids, lps = outs[o.request_id]
            ids.extend(o.new_token_ids)
            if o.logprobs is not None:
                assert len(o.logprobs) == len(o.new_token_ids)
                lps.extend(o.logprobs)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def _reference(model, prompt, out):
    """log_softmax of the logits that predicted each output token [len(out), V]."""
    seq = torch.tensor([prompt + out[:-1]])
    return torch.log_softmax(model(seq)[0, len(prompt) - 1:].float(), dim=-1)


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_match_log_softmax_of_the_model(k):
    model = build(tiny(vocab_size=128), seed=5)
    prompts = [[5, 17, 99, 3], list(range(20, 47)), [1]]
    params = [SamplingParams(max_new_tokens=6, logprobs=k, stop_token_ids=()),
              SamplingParams(max_new_tokens=5, temperature=0.7, top_k=20, top_p=0.9, seed=3, logprobs=k,
                             stop_token_ids=()),
              SamplingParams(max_new_tokens=4, stop_token_ids=())]          # asks for none
    eng = Engine(model, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16)  # chunked prefill
    results = _run(eng, prompts, params)
    assert results[2][1] == []
    for prompt, (out, lps) in zip(prompts[:2], results[:2]):
        ref = _reference(model, prompt, out)
        assert len(lps) == len(out)
        for j, (tok, e) in enumerate(zip(out, lps)):
            # the raw distribution's logprob of the token drawn, also under temperature / top-p
            assert e.logprob == pytest.approx(ref[j, tok].item(), abs=1e-4)
            vals, ids = ref[j].topk(k)
            assert [t for t, _ in e.top] == ids.tolist()
            assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=1e-4)
    # greedy: the token is the most likely one
    assert all(lp.logprob == pytest.approx(ref_max, abs=1e-4) for lp, ref_max in
               zip(results[0][1], _reference(model, prompts[0], results[0][0]).max(-1).values.tolist()))


def test_logprobs_bounds():
    with pytest.raises(KernelgateError, match="logprobs must be <= 20"):
        SamplingParams(logprobs=21)
    with pytest.raises(KernelgateError, match="logprobs must be >= 0"):
        SamplingParams(logprobs=-1)
