"""generate() keeps its engine on the model: a later call reuses it (same tokens, no rebuild), a
call that needs more sequences or context grows it, other settings rebuild it; the engine it
makes holds exactly what the calls need. And `kernelgate run` counts prefill / decode as
generate() does (one drive loop, one Timing)."""
import json

import pytest
import torch

import kernelgate
from kernelgate.cli import main as cli_main
from kernelgate.cli.model import builtin_model
from kernelgate.serving.drive import Timing
from kernelgate.serving.generate import KEPT


@pytest.fixture
def model():
    m = builtin_model(seed=0)
    yield m
    kernelgate.release(m)


def _prompts(n, seed=0, lo=3, hi=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 200, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def test_later_calls_reuse_the_engine_and_give_the_same_tokens(model):
    prompts = _prompts(3)
    first = kernelgate.generate(model, prompts, max_new_tokens=6, stop_token_ids=())
    eng = getattr(model, KEPT)
    cfg = eng.config
    assert cfg.max_num_seqs == 3 and cfg.max_model_len >= max(map(len, prompts)) + 6
    # the cache holds what the call needs, not a share of the device
    assert eng.capacity.num_blocks == 3 * -(-cfg.max_model_len // cfg.block_size)
    again = kernelgate.generate(model, prompts, max_new_tokens=6, stop_token_ids=())
    assert getattr(model, KEPT) is eng
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    fewer = kernelgate.generate(model, prompts[:1], max_new_tokens=3, stop_token_ids=())
    assert getattr(model, KEPT) is eng and fewer[0].token_ids == first[0].token_ids[:3]


def test_a_bigger_call_grows_the_engine_and_other_settings_rebuild_it(model):
    kernelgate.generate(model, _prompts(2), max_new_tokens=4)
    small = getattr(model, KEPT)
    kernelgate.generate(model, _prompts(5, seed=1), max_new_tokens=40)
    grown = getattr(model, KEPT)
    assert grown is not small and small.runner is None          # the old one was closed
    assert grown.config.max_num_seqs == 5 and grown.config.max_model_len >= 40
    kernelgate.generate(model, _prompts(2), max_new_tokens=4)   # smaller: fits the grown one
    assert getattr(model, KEPT) is grown
    kernelgate.generate(model, _prompts(2), max_new_tokens=4, max_num_batched_tokens=16)
    other = getattr(model, KEPT)
    assert other is not grown and other.config.max_num_batched_tokens == 16
    kernelgate.release(model)
    assert getattr(model, KEPT) is None and other.runner is None


def test_reused_engine_equals_a_fresh_one_and_an_engine_passed_in(model):
    prompts = _prompts(4, seed=2)
    kw = dict(max_new_tokens=5, temperature=0.8, top_k=20, seed=7, stop_token_ids=())
    kernelgate.generate(model, _prompts(4, seed=3), **kw)         # leaves state behind in the kept engine
    kept = kernelgate.generate(model, prompts, **kw)
    mine = kernelgate.Engine(model, max_num_seqs=4, max_model_len=64)
    passed = kernelgate.generate(model, prompts, engine=mine, **kw)
    mine.close()
    assert [r.token_ids for r in kept] == [r.token_ids for r in passed]
    with pytest.raises(kernelgate.KernelgateError, match="engine settings .* cannot apply to an engine passed in"):
        kernelgate.generate(model, prompts, engine=mine, max_num_seqs=2)


def test_run_counts_prefill_and_decode_as_generate_does(capsys):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    args = ["run", "--json", "--max-new-tokens", "5", "--max-model-len", "64"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    assert cli_main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    t = Timing()
    model = builtin_model(seed=0)
    res = kernelgate.generate(model, prompts, max_new_tokens=5, timing=t, max_num_seqs=3, max_model_len=64)
    kernelgate.release(model)
    assert [r["token_ids"] for r in rep["results"]] == [r.token_ids for r in res]
    assert (rep["prefill_tokens"], rep["decode_tokens"]) == (t.prefill_tokens, t.decode_tokens)
    assert rep["prefill_tokens"] == sum(map(len, prompts)) and rep["decode_tokens"] > 0
