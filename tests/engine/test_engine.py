"""Engine: batch independence under continuous batching, stop / max tokens, sampling
(seeded, top-k, top-p against hand-computed cases), state pool and scheduler errors.
Reference for token streams: the same model run one request at a time (greedy) and a
plain full-sequence forward re-run per token (no cache)."""
import pytest
import torch

import kernelgate
from helpers.engine_checks import assert_drained
from kernelgate import KernelgateError
from kernelgate.config import EngineConfig
from kernelgate.executor.plan import StepResult
from kernelgate.engine import Engine, SamplingParams
from kernelgate.executor.sampling import filter_logits
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
    mixed = kernelgate.generate(model, prompts, max_new_tokens=6, stop_token_ids=(), max_num_seqs=2)
    assert [r.token_ids for r in mixed] == alone
    together = kernelgate.generate(model, prompts[::-1], max_new_tokens=6, stop_token_ids=(), max_num_seqs=5)
    assert [r.token_ids for r in together] == alone[::-1]


def test_requests_join_between_steps(model):
    p = _prompts()
    eng = Engine(model, max_num_seqs=3, max_model_len=64, block_size=8)
    eng.add_request("a", p[0], SamplingParams(max_new_tokens=6))
    kinds = []
    got = {"a": [], "b": []}

    def step():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
        if eng.last_step is not None:      # (the last call may only read the last step back)
            kinds.append(eng.last_step.kind)
    for _ in range(2):                                                   # prefill a, decode a
        step()
    eng.add_request("b", p[2], SamplingParams(max_new_tokens=3))
    while eng.has_unfinished():
        step()
    # b's prefill shares a step with a's decode
    assert kinds[:3] == ["prefill", "decode", "mixed"] and "prefill" not in kinds[3:]
    ref = kernelgate.generate(model, [p[0], p[2]], max_new_tokens=6, stop_token_ids=())
    assert got["b"] == ref[1].token_ids[:3] and got["a"] == ref[0].token_ids
    assert_drained(eng)


def test_admission_delay_groups_arriving_prompts(model):
    """scheduler_delay_factor (vLLM's): while requests run, waiting prompts join once the oldest
    has waited factor x the last admitting step's duration -- so prompts arriving over several
    steps share one (eager) step -- and at once when nothing runs. A fake clock drives it."""
    from kernelgate.engine.block_manager import BlockManager
    from kernelgate.engine.scheduler import Request, Scheduler
    now = [0.0]
    s = Scheduler(BlockManager(64, 8, 16), EngineConfig(max_num_seqs=8, max_num_batched_tokens=1000,
                                                        max_model_len=512, scheduler_delay_factor=1.0),
                  clock=lambda: now[0])

    def step(t):
        now[0] = t
        out = s.schedule()
        s.advance(out)
        s.resolve(out, StepResult([5] * len(out.seqs), [None] * len(out.seqs), [None] * len(out.seqs)))
        return sorted(x.req.request_id for x in out.seqs if x.start == 0)   # admitted this step
    def add(name, t):
        now[0] = t
        s.add(Request(name, [1] * 10, SamplingParams(max_new_tokens=50)))
    add("a", 0.0)
    assert step(0.0) == ["a"]                       # nothing runs: at once
    add("b", 0.030)
    assert step(0.030) == []                        # the admitting step took 30 ms; b waited 0
    add("c", 0.040)
    assert step(0.045) == []                        # b waited 15 ms < 1.0 x 30 ms
    assert step(0.061) == ["b", "c"]                # 31 ms: both join one step
    s.delay_factor = 0.0
    add("d", 0.062)
    assert step(0.062) == ["d"]                     # factor 0: at once
    # through the engine: the same tokens as without the delay
    prompts = _prompts()
    want = kernelgate.generate(model, prompts, max_new_tokens=5, stop_token_ids=(), max_num_seqs=5)
    eng = Engine(model, max_num_seqs=5, max_model_len=64, scheduler_delay_factor=2.0)
    got = kernelgate.generate(model, prompts, max_new_tokens=5, stop_token_ids=(), engine=eng)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    with pytest.raises(KernelgateError, match="scheduler_delay_factor must be >= 0"):
        Engine(model, max_num_seqs=2, max_model_len=64, scheduler_delay_factor=-1.0)


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
    b = kernelgate.generate(model, prompts, max_num_seqs=1, **kw)
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
    from kernelgate.executor.sampling import make_generator, sample
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]]))
    g = make_generator(0, "cpu")
    p = SamplingParams(temperature=1.0)
    draws = torch.tensor([sample(logits, [p], [g])[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=4).float() / 3000
    assert torch.allclose(freq[:3], torch.tensor([0.6, 0.3, 0.1]), atol=0.04) and freq[3] == 0


def test_batched_sampling_follows_each_rows_filtered_distribution():
    """Rows of one call with different settings (greedy, temperature, top-k, top-p, both) are
    filtered and drawn together: each row's frequencies follow softmax(filter_logits(row)), the
    single-row definition; a non-finite row gives -1 and still draws."""
    from kernelgate.executor.sampling import make_generator, sample
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 1e-9]])).repeat(6, 1)
    logits[5, 2] = float("nan")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_k=2), SamplingParams(temperature=1.0, top_p=0.7),
              SamplingParams(temperature=2.0, top_k=3, top_p=0.8), SamplingParams(temperature=1.0)]
    gens = [make_generator(i, "cpu") for i in range(6)]
    draws = torch.tensor([sample(logits, params, gens) for _ in range(4000)])      # [4000, 6]
    assert (draws[:, 0] == 0).all() and (draws[:, 5] == -1).all()
    for r in range(1, 5):
        p = params[r]
        want = torch.softmax(filter_logits(logits[r], p.temperature, p.top_k, p.top_p), dim=-1)
        freq = torch.bincount(draws[:, r], minlength=5).float() / len(draws)
        assert torch.allclose(freq, want, atol=0.03) and (freq[want == 0] == 0).all(), (r, freq, want)


def test_a_rows_draws_do_not_depend_on_the_other_rows():
    """A seeded request draws the same tokens alone and among other sampled rows."""
    from kernelgate.executor.sampling import make_generator, sample
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g)
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    ga, gb = make_generator(5, "cpu"), make_generator(5, "cpu")
    alone = [sample(logits[1:2], [p], [ga])[0] for _ in range(20)]
    others = [SamplingParams(temperature=1.0, top_k=3), p, SamplingParams(), SamplingParams(temperature=1.5)]
    gens = [make_generator(7, "cpu"), gb, make_generator(8, "cpu"), make_generator(9, "cpu")]
    batched = [sample(logits, others, gens)[1] for _ in range(20)]
    assert alone == batched


def test_errors(model):
    with pytest.raises(KernelgateError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(KernelgateError, match="max_new_tokens must be >= 1"):
        kernelgate.generate(model, [[1, 2]], max_new_tokens=0)
    with pytest.raises(KernelgateError, match="exceeds max_model_len 10"):
        kernelgate.generate(model, [[1] * 8], max_new_tokens=4, max_model_len=10)
    with pytest.raises(KernelgateError, match=r"token ids outside \[0, 128\)"):
        kernelgate.generate(model, [[1, 500]], max_new_tokens=2)
    with pytest.raises(KernelgateError, match="string prompts need a checkpoint with a tokenizer"):
        kernelgate.generate(model, ["hello"], max_new_tokens=2)
    from kernelgate.engine import BlockManager
    bm = BlockManager(4, 1, 8)
    slot = bm.take_slot()
    with pytest.raises(KernelgateError, match="all 1 state slots are in use"):
        bm.take_slot()
    bm.give_slot(slot)
    with pytest.raises(KernelgateError, match="slot 0 is not in use"):
        bm.give_slot(slot)


def test_slot_and_block_reuse_start_from_zero(model):
    from kernelgate.engine.block_manager import BlockManager
    cache = model.new_cache(2, 3, 4)
    bm = BlockManager(3, 2, 4)
    blocks = []
    slot = bm.take_slot()
    assert bm.grow(blocks, 9) and blocks == [0, 1, 2] and not bm.grow(blocks, 13)
    bm.take_fresh()
    for t in (*cache.kda_state.values(), *cache.conv_state.values(), *cache.mla_cache.values()):
        t.fill_(float("nan"))
    bm.release(blocks)
    bm.give_slot(slot)
    slot, again = bm.take_slot(), []
    assert bm.grow(again, 5) and len(again) == 2
    cache.clear(*bm.take_fresh())
    left = ({0, 1, 2} - set(again)).pop()
    assert all(float(t[slot].abs().sum()) == 0 for t in (*cache.kda_state.values(), *cache.conv_state.values()))
    assert all(float(t[again].abs().sum()) == 0 and t[left].isnan().all() for t in cache.mla_cache.values())


@pytest.mark.parametrize("in_budget", [True, False], ids=["decodes-in-budget", "decodes-on-top"])
def test_decodes_go_first_and_prompts_take_what_is_left(in_budget):
    """Every decoding request gets its token each step, even when an older request is prefilling a
    long prompt; the prompt's chunk takes the rest of the budget (vLLM's policy) or, by default, the
    whole budget with the decodes on top (SGLang's mixed chunks)."""
    from kernelgate.engine.block_manager import BlockManager
    from kernelgate.engine.scheduler import Request, Scheduler
    s = Scheduler(BlockManager(64, 4, 8), EngineConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                        max_model_len=256, decode_tokens_in_budget=in_budget))
    old = Request("old-long-prompt", list(range(1, 101)), SamplingParams(max_new_tokens=4))
    new = Request("new-decoding", [1, 2, 3], SamplingParams(max_new_tokens=8))
    for r, computed in ((old, 32), (new, 3)):
        r.slot = s.blocks.take_slot()
        assert s.blocks.grow(r.blocks, computed + 1)
        r.num_computed = computed
        s.running.append(r)
    new.output = [7]                                  # its first token: one to feed
    out = s.schedule()
    chunk = 15 if in_budget else 16
    assert [(x.req.request_id, x.start, x.n) for x in out.seqs] == [("new-decoding", 3, 1), ("old-long-prompt", 32, chunk)]
