"""Chunked prefill (token budget per step): a prompt prefilled over several steps, each chunk
attending to its cached prefix with KDA / conv states carried across chunks, gives the same
greedy tokens and the same logits (fp32) as one unchunked prefill and as a plain uncached
full-sequence forward -- for budgets that cut prompts mid-way and mid-block."""
import pytest
import torch

import kernelgate
from kernelgate.engine import Engine, SamplingParams
from kernelgate.executor import model_runner
from kernelgate.models import build, tiny
from kernelgate.tools.testing import rel_err


@pytest.fixture(scope="module")
def model():
    return build(tiny(vocab_size=128), seed=21)


def _prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (65, 13, 1, 40)]


def _run(model, prompts, monkeypatch, **knobs):
    """-> (tokens per request, logits of every sampled position per request, step kinds)."""
    params = [SamplingParams(max_new_tokens=4) for _ in prompts]
    logits = {id(p): [] for p in params}
    real = model_runner.sample_async

    def spy(rows, ps, gens):
        for row, p in zip(rows, ps):
            logits[id(p)].append(row.clone())
        return real(rows, ps, gens)
    monkeypatch.setattr(model_runner, "sample_async", spy)
    # (no prefix cache: its snapshot points would split the prompts into other chunks than the budget's)
    eng = Engine(model, max_model_len=96, block_size=8, enable_prefix_caching=False, **knobs)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    toks = {str(i): [] for i in range(len(prompts))}
    kinds = []
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
        if eng.last_step is not None:
            kinds.append(eng.last_step.kind)
    monkeypatch.setattr(model_runner, "sample_async", real)
    return [toks[str(i)] for i in range(len(prompts))], [logits[id(p)] for p in params], kinds


def _padded_steps(model, monkeypatch) -> list:
    """Engines built from now on pad their eager steps (as on a GPU); -> the list that will hold
    each model step's (tokens, decode?, sequences)."""
    sizes = []
    real_step = type(model).step

    def spy(self, tokens, batch, cache):
        sizes.append((tokens.shape[0], batch.decode, batch.num_seqs))
        return real_step(self, tokens, batch, cache)
    monkeypatch.setattr(type(model), "step", spy)
    real_init = model_runner.ModelRunner.__init__

    def padded(self, *a, **k):
        real_init(self, *a, **k)
        self.pad_steps = True
    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padded)
    return sizes


@pytest.mark.parametrize("budget", [4096, 33])
def test_padded_eager_steps_change_nothing(model, monkeypatch, budget):
    """Eager prefill / mixed steps padded to a few sizes (what every non-CPU device does) by one
    more sequence in the scratch slot and block: the same tokens and logits as unpadded steps,
    pure decode steps untouched, and each padded step really ran at its padded size."""
    prompts = _prompts()                                   # 119 prompt tokens
    ref_tok, ref_logits, _ = _run(model, prompts, monkeypatch, max_num_batched_tokens=budget)
    sizes = _padded_steps(model, monkeypatch)              # (vLLM's policy: steps within the budget)
    tok, logits, kinds = _run(model, prompts, monkeypatch, max_num_batched_tokens=budget,
                              decode_tokens_in_budget=True)
    assert tok == ref_tok
    for a, b in zip(logits, ref_logits):
        for x, y in zip(a, b):
            assert rel_err(x, y) < 1e-5
    eager = [(t, n) for t, dec, n in sizes if not dec]
    if budget == 4096:   # one step of all four prompts, padded 119 -> 128 by a fifth sequence
        assert eager == [(128, 5)], sizes
    else:                # chunks and mixed steps, each padded to the budget
        assert "mixed" in kinds and eager and all(t == 33 for t, _ in eager), sizes
        assert any(n > 1 and t == 33 for t, n in eager)
    assert any(dec for _, dec, _ in sizes)                 # decode steps ran unpadded
    assert model_runner.padded_tokens(1, 8192) == 64 and model_runner.padded_tokens(1025, 8192) == 1280
    assert model_runner.padded_tokens(4097, 8192) == 4608 and model_runner.padded_tokens(7900, 8000) == 8000
    # past the budget (decodes riding on a full chunk): multiples of 64, never past the largest step
    assert model_runner.padded_tokens(8195, 8192, 8192 + 72) == 8256
    assert model_runner.padded_tokens(8262, 8192, 8192 + 72) == 8264
    assert model_runner.padded_tokens(7900, 8192, 8192 + 72) == 8192


def test_padded_steps_past_the_budget_change_nothing(model, monkeypatch):
    """With the decodes on top of the budget, a full chunk beside decodes is a step past the
    budget, padded up to the largest step (budget + max_num_seqs): the same tokens and logits."""
    prompts = _prompts()
    ref_tok, ref_logits, _ = _run(model, prompts, monkeypatch, max_num_batched_tokens=33)
    sizes = _padded_steps(model, monkeypatch)
    tok, logits, kinds = _run(model, prompts, monkeypatch, max_num_batched_tokens=33, max_num_seqs=8,
                              decode_tokens_in_budget=False)
    assert tok == ref_tok
    for a, b in zip(logits, ref_logits):
        for x, y in zip(a, b):
            assert rel_err(x, y) < 1e-5
    eager = {t for t, dec, _ in sizes if not dec}
    assert eager == {33, 41}, sizes                      # the budget, and the budget + 8 sequences


@pytest.mark.parametrize("in_budget", [True, False], ids=["decodes-in-budget", "decodes-on-top"])
@pytest.mark.parametrize("budget", [7, 16, 33])
def test_chunked_equals_unchunked(model, monkeypatch, budget, in_budget):
    prompts = _prompts()
    ref_tok, ref_logits, ref_kinds = _run(model, prompts, monkeypatch, max_num_batched_tokens=4096)
    tok, logits, kinds = _run(model, prompts, monkeypatch, max_num_batched_tokens=budget,
                              decode_tokens_in_budget=in_budget)
    assert tok == ref_tok
    for a, b in zip(logits, ref_logits):
        assert len(a) == len(b) == 4
        for x, y in zip(a, b):
            assert rel_err(x, y) < 1e-5
    assert ref_kinds[0] == "prefill" and kinds.count("mixed") >= 1    # chunks share steps with decodes
    assert len(kinds) > len(ref_kinds)


def test_first_token_logits_equal_full_forward(model, monkeypatch):
    prompts = _prompts()
    _, logits, _ = _run(model, prompts, monkeypatch, max_num_batched_tokens=9, max_num_seqs=2)
    for p, lg in zip(prompts, logits):
        full = model(torch.tensor([p]))[0, -1].float()
        assert rel_err(lg[0], full) < 1e-5, f"prompt of {len(p)}"


def test_generate_knobs(model):
    prompts = _prompts()
    a = kernelgate.generate(model, prompts, max_new_tokens=3, stop_token_ids=())
    b = kernelgate.generate(model, prompts, max_new_tokens=3, stop_token_ids=(), max_num_batched_tokens=5,
                            max_num_seqs=3, block_size=4, num_cache_blocks=64)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_mixed_steps_decode_through_the_absorbed_kernel(model, monkeypatch):
    """In a mixed step the decoding sequences (first in the batch) attend through mla_decode over
    their latents, the prompt chunks through mla_prefill: every MLA call of a mixed step splits
    its rows so, and the tokens are those of test_chunked_equals_unchunked's reference."""
    from kernelgate import ops
    calls = []
    real_dec, real_pre = ops.mla_decode, ops.mla_prefill

    def dec(q, *a, **k):
        calls.append(("decode", q.shape[0]))
        return real_dec(q, *a, **k)

    def pre(q, *a, **k):
        calls.append(("prefill", q.shape[0]))
        return real_pre(q, *a, **k)
    monkeypatch.setattr(ops, "mla_decode", dec)
    monkeypatch.setattr(ops, "mla_prefill", pre)
    prompts = _prompts()
    tok, _, kinds = _run(model, prompts, monkeypatch, max_num_batched_tokens=16)
    monkeypatch.setattr(ops, "mla_decode", real_dec)
    monkeypatch.setattr(ops, "mla_prefill", real_pre)
    ref_tok, _, _ = _run(model, prompts, monkeypatch, max_num_batched_tokens=4096)
    assert tok == ref_tok and "mixed" in kinds
    pairs = [(a, b) for a, b in zip(calls, calls[1:]) if a[0] == "decode" and b[0] == "prefill"]
    assert pairs and all(b[1] <= 16 for a, b in pairs)     # one mixed step's rows, split (chunk: the budget)


@pytest.mark.parametrize("family", ["kimi", "qwen"])
def test_mixed_steps_linear_attention_decodes_take_the_one_token_kernels(model, monkeypatch, family):
    """In a mixed step the KDA (Kimi) / Gated DeltaNet (Qwen) layers run their leading decodes
    through the packed one-token kernel and only the prompt chunks through the chunked prefill
    (each decode would otherwise take a chunk of the prefill's work): every such step's rows split
    so, and tokens and logits are the unchunked run's."""
    from kernelgate import ops
    if family == "qwen":
        from kernelgate.models import qwen3_next
        from kernelgate.models.qwen3_next_config import tiny as qwen_tiny
        model = qwen3_next.build(qwen_tiny(vocab_size=128), seed=21)
        names = ("gdn_packed_decode", "gdn_prefill")
    else:
        names = ("kda_packed_decode", "kda_prefill")
    calls = []
    reals = [getattr(ops, n) for n in names]

    def spy(kind, real):
        def f(*a, **k):
            calls.append((kind, a[0].shape[0]))
            return real(*a, **k)
        return f
    for kind, n, real in zip(("decode", "prefill"), names, reals):
        monkeypatch.setattr(ops, n, spy(kind, real))
    prompts = _prompts()
    tok, logits, kinds = _run(model, prompts, monkeypatch, max_num_batched_tokens=16)
    for n, real in zip(names, reals):
        monkeypatch.setattr(ops, n, real)
    ref_tok, ref_logits, _ = _run(model, prompts, monkeypatch, max_num_batched_tokens=4096)
    assert tok == ref_tok and "mixed" in kinds
    for a, b in zip(logits, ref_logits):
        for x, y in zip(a, b):
            assert rel_err(x, y) < 1e-5
    pairs = [(a, b) for a, b in zip(calls, calls[1:]) if a[0] == "decode" and b[0] == "prefill"]
    assert pairs and all(b[1] <= 16 for a, b in pairs)     # one mixed step's rows, split (chunk: the budget)


@pytest.mark.parametrize("in_budget", [True, False], ids=["decodes-in-budget", "decodes-on-top"])
def test_a_chunk_beside_decodes_takes_the_budget_or_what_the_decodes_leave(model, in_budget):
    """Three requests decoding, then a 100-token prompt with a budget of 32: vLLM's policy gives
    its chunks 32 - 3 = 29 tokens; with the decodes on top of the budget, chunks of 32 and steps
    of 35 (the chunk keeps the budget's length: a planned attention shape on a GPU)."""
    eng = Engine(model, max_num_seqs=4, max_model_len=128, block_size=8, max_num_batched_tokens=32,
                 enable_prefix_caching=False, decode_tokens_in_budget=in_budget)
    for i in range(3):
        eng.add_request(f"d{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=40))
    eng.step()
    eng.step()
    eng.add_request("long", list(range(1, 101)), SamplingParams(max_new_tokens=1))
    seen = []
    while eng.has_unfinished():
        eng.step()
        st = eng.last_step
        if st is not None and st.kind == "mixed":
            seen.append((st.tokens, st.seqs))
    chunk = 29 if in_budget else 32
    beside = [t - 3 for t, n in seen if n == 4]                # the prompt's tokens in each step beside the decodes
    assert beside[:3] == [chunk] * 3, seen
    assert sum(beside) == 100, seen                             # all of it went in beside the decodes
