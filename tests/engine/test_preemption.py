"""Admission and preemption over a paged cache too small for the offered load: every request
completes, through preemption and recompute, with the tokens of an unconstrained run (greedy
and seeded sampling); reused blocks and slots carry nothing of their last owner (the whole
cache is poisoned with NaN first); impossible limits and over-long requests are clear errors."""
from helpers.engine_checks import assert_drained
import pytest
import torch

import kernelgate
from kernelgate import KernelgateError
from kernelgate.engine import Engine, SamplingParams
from kernelgate.models import build, tiny


@pytest.fixture(scope="module")
def model():
    return build(tiny(vocab_size=128), seed=5)


def _prompts(n=6, seed=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(L),), generator=g).tolist() for L in torch.randint(3, 18, (n,), generator=g)]


def _drive(eng, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    toks = {f"r{i}": [] for i in range(len(prompts))}
    reasons, preempted, steps = {}, 0, 0
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        preempted += eng.last_step.preempted if eng.last_step else 0
        steps += 1
        assert steps < 500, "engine does not make progress"
    return [toks[f"r{i}"] for i in range(len(prompts))], reasons, preempted


def _poison(eng):
    c = eng.runner.cache
    for t in (*c.kda_state.values(), *c.conv_state.values(), *c.mla_cache.values()):
        t.fill_(float("nan"))


@pytest.mark.parametrize("in_budget", [True, False], ids=["decodes-in-budget", "decodes-on-top"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_small_cache_completes_everything_through_preemption(model, sampled, in_budget):
    prompts = _prompts()
    kw = dict(temperature=1.3, top_p=0.9) if sampled else {}
    params = lambda: [SamplingParams(max_new_tokens=10, seed=100 + i, **kw) for i in range(len(prompts))]  # noqa: E731
    free = Engine(model, max_num_seqs=6, max_model_len=32, block_size=4)
    ref, _, none = _drive(free, prompts, params())
    # 9 blocks of 4 = 36 tokens for six requests of up to 27 tokens: decodes run out of blocks
    small = Engine(model, max_num_seqs=6, max_model_len=32, block_size=4, num_cache_blocks=9,
                   max_num_batched_tokens=16, decode_tokens_in_budget=in_budget)
    _poison(small)
    got, reasons, preempted = _drive(small, prompts, params())
    assert none == 0 and preempted > 0
    assert got == ref and set(reasons.values()) == {"length"} and len(reasons) == len(prompts)
    assert_drained(small)


def test_reused_blocks_and_slots_carry_nothing(model):
    """Requests run after others (their blocks and slots reused, the cache NaN-poisoned before
    anything ran) equal a fresh run of each alone."""
    prompts = _prompts(5, seed=3)
    alone = [kernelgate.generate(model, [p], max_new_tokens=5, stop_token_ids=())[0].token_ids for p in prompts]
    eng = Engine(model, max_num_seqs=2, max_model_len=32, block_size=4, num_cache_blocks=12)
    _poison(eng)
    got, _, _ = _drive(eng, prompts, [SamplingParams(max_new_tokens=5) for _ in prompts])
    assert got == alone


def test_impossible_limits_are_clear_errors(model):
    with pytest.raises(KernelgateError, match="max_num_seqs must be >= 1"):
        Engine(model, max_num_seqs=0)
    with pytest.raises(KernelgateError, match="num_cache_blocks must be >= 1"):
        Engine(model, num_cache_blocks=0)
    with pytest.raises(KernelgateError, match="block_size must be an int"):
        Engine(model, block_size=4.0)
    with pytest.raises(KernelgateError, match="gpu_memory_utilization must be <= 1"):
        Engine(model, gpu_memory_utilization=1.5)
    eng = Engine(model, max_model_len=40, block_size=4, num_cache_blocks=5)
    with pytest.raises(KernelgateError, match=r"needs 6 cache blocks of 4 tokens \(21 tokens\) but the cache holds 5"):
        eng.add_request("a", [1] * 20, SamplingParams(max_new_tokens=1))
    with pytest.raises(KernelgateError, match="= 41 exceeds max_model_len 40"):
        eng.add_request("b", [1] * 40, SamplingParams(max_new_tokens=1))
    eng.add_request("c", [1] * 19, SamplingParams(max_new_tokens=1))       # 20 tokens: exactly 5 blocks
    assert eng.capacity.cache_tokens == 20 and "20 tokens of MLA latents" in eng.capacity.report()
