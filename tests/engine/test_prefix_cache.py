"""Prefix caching is exact: with the cache on, every request's greedy tokens and logprobs (the
raw distribution's top 8, i.e. its logits) equal a cache-off engine's (fp32, 1e-5 relative), over
workloads that hit in every way (same prompt, multi-turn chat, branching prefixes, a prefix
ending inside a block or at its end, a shared long document), under eviction, preemption and
aborts -- and each workload's requests really hit (num_cached_tokens counted). A snapshot whose
recorded tokens disagree with the request is refused."""
import pytest
import torch

from helpers.engine_checks import assert_drained
from kernelgate.engine import Engine, SamplingParams
from kernelgate.engine.prefix_cache import digest
from kernelgate.models import build, tiny

BS = 8
K = 8                                   # logprobs per token compared


@pytest.fixture(scope="module")
def model():
    return build(tiny(vocab_size=128), seed=0)


def _engine(model, on, **kw):
    cfg = dict(max_num_seqs=4, max_model_len=160, block_size=BS, max_num_batched_tokens=32,
               enable_prefix_caching=on)
    cfg.update(kw)
    return Engine(model, **cfg)


def _params(n=6):
    return SamplingParams(max_new_tokens=n, logprobs=K)


def _run(eng, batches, new=6):
    """batches: lists of (request_id, prompt) submitted together, one batch after another (each
    runs to its end) -> {id: (tokens, [per token [(id, logprob)]], num_cached)}."""
    got = {}
    for batch in batches:
        for rid, prompt in batch:
            eng.add_request(rid, list(prompt), _params(new))
        while eng.has_unfinished():
            for o in eng.step():
                t, lps, c = got.setdefault(o.request_id, ([], [], 0))
                t.extend(o.new_token_ids)
                lps.extend(e.top for e in o.logprobs or [])
                got[o.request_id] = (t, lps, max(c, o.num_cached_tokens))
    return got


def _same(on: dict, off: dict) -> None:
    assert on.keys() == off.keys()
    for rid in on:
        t1, l1, _ = on[rid]
        t0, l0, _ = off[rid]
        assert t1 == t0, rid
        for a, b in zip(l1, l0):
            assert [i for i, _ in a] == [i for i, _ in b], rid
            x, y = torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b])
            assert (x - y).norm() <= 1e-5 * y.norm(), (rid, (x - y).norm().item())


def _check(model, batches, **kw):
    on, off = _engine(model, True, **kw), _engine(model, False, **kw)
    got, want = _run(on, batches), _run(off, batches)
    _same(got, want)
    assert_drained(on)
    return got


def _rand(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g).tolist()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_same_prompt_twice(model, async_scheduling):
    p = _rand(37, 1)
    got = _check(model, [[("a", p)], [("b", p)]], async_scheduling=async_scheduling)
    assert got["a"][2] == 0 and got["b"][2] == 32            # up to the last block boundary before its end


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_four_turn_chat_resends_the_conversation(model, async_scheduling):
    """Each turn sends the whole conversation so far plus a new user message: turn N+1 resumes
    where turn N ended (its answer's state included)."""
    conv = _rand(13, 2)
    on = _engine(model, True, async_scheduling=async_scheduling)
    off = _engine(model, False, async_scheduling=async_scheduling)
    hits = []
    for turn in range(4):
        got, want = _run(on, [[(f"t{turn}", conv)]]), _run(off, [[(f"t{turn}", conv)]])
        _same(got, want)
        hits.append(got[f"t{turn}"][2])
        conv = conv + want[f"t{turn}"][0] + _rand(5 + turn, 10 + turn)
    assert hits[0] == 0 and all(h >= 13 for h in hits[1:]), hits
    assert_drained(on)


@pytest.mark.parametrize("in_budget", [True, False], ids=["decodes-in-budget", "decodes-on-top"])
def test_branching_requests_share_random_length_prefixes(model, in_budget):
    roots = [_rand(60, 20 + r) for r in range(3)]
    g = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(24):
        root = roots[int(torch.randint(0, 3, (1,), generator=g))]
        cut = int(torch.randint(1, 60, (1,), generator=g))
        reqs.append((f"r{i}", root[:cut] + _rand(int(torch.randint(1, 12, (1,), generator=g)), 100 + i)))
    batches = [reqs[i:i + 3] for i in range(0, len(reqs), 3)]       # some together, some after others
    got = _check(model, batches, max_num_seqs=3, prefix_snapshots=64, decode_tokens_in_budget=in_budget)
    assert sum(1 for _, _, c in got.values() if c > 0) >= 13      # (the first on each root, and cuts inside its
                                                                   # first blocks, find nothing)


@pytest.mark.parametrize("cut", [4 * BS, 4 * BS + 5], ids=["at-block-end", "inside-a-block"])
def test_prefix_ending_at_or_inside_a_block(model, cut):
    """b resumes at the last block boundary of a's prompt; c at a's prompt end (cut + 1)."""
    base = _rand(cut, 7)
    got = _check(model, [[("a", base + [1])], [("b", base + [2, 3])], [("c", base + [1, 9])]])
    assert got["b"][2] == 4 * BS and got["c"][2] == cut + 1


def test_shared_long_document(model):
    """A document longer than a step's budget, then several questions about it: later ones
    resume near the end of the document (its last chunk end or block boundary, and the point
    where the first question diverged)."""
    doc = _rand(100, 11)
    qs = [[(f"q{i}", doc + _rand(3 + i, 40 + i))] for i in range(4)]
    got = _check(model, qs)
    assert got["q0"][2] == 0
    assert got["q1"][2] >= 100 - 2 * BS and all(got[f"q{i}"][2] == 100 for i in (2, 3)), \
        [got[f"q{i}"][2] for i in range(4)]


def test_eviction_under_a_cache_too_small_for_the_working_set(model):
    """Four roots asked about in turn, each twice in a row; 4 snapshots and 16 blocks hold about
    one root's worth: the second of a pair hits, the next root evicts it, and a root seen again
    later is recomputed -- with the cache-off tokens throughout."""
    roots = [_rand(40, 60 + r) for r in range(4)]
    batches = [[(f"r{i}", roots[(i // 2) % 4] + _rand(3, 200 + i))] for i in range(16)]
    on = _engine(model, True, num_cache_blocks=16, prefix_snapshots=4, max_num_seqs=2)
    got = _run(on, batches)
    _same(got, _run(_engine(model, False, max_num_seqs=2), batches))
    hits = [got[f"r{i}"][2] for i in range(16)]
    assert all(hits[i] >= 40 for i in range(1, 16, 2)) and hits[8] == 0, hits
    assert on.prefix_cache.evictions > 0
    assert_drained(on)


def test_a_preempted_request_that_had_hit(model):
    """Three requests resume from a cached document; blocks run out mid-decode, so the newest
    (which had hit) is preempted, gives its shared blocks back and is recomputed: the tokens are
    those of an unconstrained cache-off run."""
    doc = _rand(30, 13)
    batches = [[("warm", doc)], [(f"r{i}", doc + _rand(2, 300 + i)) for i in range(3)]]
    on = _engine(model, True, num_cache_blocks=10, max_num_seqs=3, prefix_snapshots=4)
    seen = []
    real = on.scheduler._preempt

    def spy(req):
        seen.append((req.request_id, req.num_cached))
        real(req)
    on.scheduler._preempt = spy
    got = _run(on, batches, new=16)
    want = _run(_engine(model, False, max_num_seqs=3), batches, new=16)
    _same(got, want)
    assert all(got[f"r{i}"][2] == 30 for i in range(3))
    assert any(c == 30 for _, c in seen), seen                # a request that had hit was preempted
    assert_drained(on)


def test_aborting_a_request_whose_blocks_are_shared(model):
    """A request that restored shared blocks is aborted mid-decode; the blocks stay with the
    snapshot (no one else is handed them zeroed or dirty) and later requests still match."""
    doc = _rand(27, 17)
    on, off = _engine(model, True), _engine(model, False)
    _run(on, [[("a", doc + [1])]])
    on.add_request("b", doc + [2, 3], _params(20))
    for _ in range(3):
        on.step()
    on.abort("b")
    while on.has_unfinished():
        on.step()
    batches = [[("c", doc + [2, 3, 4])], [("d", doc + [1, 8])]]
    got, want = _run(on, batches), _run(off, [[("a", doc + [1])]] + batches)
    del want["a"]
    _same(got, want)
    assert got["c"][2] >= 27 and got["d"][2] >= 27
    assert_drained(on)


def test_a_snapshot_whose_tokens_disagree_is_refused(model, caplog):
    p = _rand(37, 23)
    on = _engine(model, True)
    _run(on, [[("a", p)]])
    snaps = list(on.prefix_cache._lru.values())
    assert snaps
    for s in snaps:                           # the index still points at them; the record disagrees
        s.digest = digest([t ^ 1 for t in p[:s.length]])
    with caplog.at_level("ERROR", logger="kernelgate.engine"):
        got = _run(on, [[("b", p)]])
    assert got["b"][2] == 0 and "refused" in caplog.text
    _same(got, _run(_engine(model, False), [[("b", p)]]))
