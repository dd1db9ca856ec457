"""Async scheduling: each step is queued before the last one's tokens are read, and a decode
step (or a mixed step's decodes) takes the tokens the previous step sampled straight from the
device. The token streams,
finish reasons and the cache left behind must equal the synchronous engine's, whatever ends a
request (stop token seen one step late, max tokens, max_model_len, abort while a step is
queued, non-finite logits), through joins, chunked prefill, preemption and seeded sampling."""
from helpers.engine_checks import assert_drained
import pytest
import torch

from kernelgate.engine import Engine, SamplingParams
from kernelgate.serving.messages import AddRequest, Exit, Outputs
from kernelgate.executor import model_runner as mr
from kernelgate.models import build, tiny


@pytest.fixture(scope="module")
def model():
    return build(tiny(vocab_size=128), seed=11)


def _prompts(n=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(L),), generator=g).tolist() for L in torch.randint(2, 20, (n,), generator=g)]


def _drive(eng, prompts, params, abort_at=None):
    """-> (tokens per request, finish reasons, number of steps fed back on the device)."""
    fed = [0]
    launch = eng.runner.launch

    def counting(seqs, fresh, prev=None, cache_ops=None):
        fed[0] += prev is not None
        return launch(seqs, fresh, prev, cache_ops)
    eng.runner.launch = counting
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    toks = {f"r{i}": [] for i in range(len(prompts))}
    reasons, calls = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id not in reasons, "output after the request finished"
            assert None not in o.new_token_ids, "a placeholder escaped"
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        calls += 1
        if abort_at is not None and calls == abort_at[1]:
            eng.abort(abort_at[0])
        assert calls < 500, "engine does not make progress"
    assert_drained(eng)
    return [toks[f"r{i}"] for i in range(len(prompts))], reasons, fed[0]


def _both(model, prompts, params, **knobs):
    return [_drive(Engine(model, max_model_len=64, block_size=4, async_scheduling=flag, **knobs), prompts, params)
            for flag in (False, True)]


def test_async_equals_sync_greedy_with_stops_and_joins(model):
    prompts = _prompts()
    free = Engine(model, max_model_len=64, block_size=4, async_scheduling=False)
    ref, _, _ = _drive(free, prompts, [SamplingParams(max_new_tokens=12) for _ in prompts])
    # stop on a token each request really produces mid-way, so the stop is seen one step late
    params = [SamplingParams(max_new_tokens=12, stop_token_ids=(r[4],)) for r in ref]
    (sync, sr, fed_sync), (asy, ar, fed) = _both(model, prompts, params, max_num_seqs=3)
    assert fed_sync == 0 and fed >= 8          # the async run really fed tokens back on the device
    assert asy == sync and ar == sr
    assert all(t[-1] in p.stop_token_ids and reasons == "stop" for t, p, reasons in zip(asy, params, ar.values()))


def test_async_equals_sync_sampling_chunked_preempted(model):
    prompts = _prompts(8, seed=9)
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=100 + i)
              for i in range(len(prompts))]
    (sync, sr, _), (asy, ar, fed) = _both(model, prompts, params, max_num_seqs=5, max_num_batched_tokens=9,
                                          num_cache_blocks=14)
    assert fed > 0 and asy == sync and ar == sr
    assert set(ar.values()) == {"length"} and all(len(t) == 10 for t in asy)


def test_async_feeds_mixed_steps(model):
    """A long prompt chunked beside decoding requests: each mixed step takes its decodes' inputs
    from the device and its chunk's from the host, queued before the previous step is read (it
    used to wait for it); tokens and finish reasons equal the synchronous engine's, a stop token
    seen one step late included."""
    g = torch.Generator().manual_seed(12)
    prompts = _prompts(3, seed=12) + [torch.randint(0, 128, (40,), generator=g).tolist()]
    free = Engine(model, max_model_len=64, block_size=4, async_scheduling=False)
    ref, _, _ = _drive(free, prompts, [SamplingParams(max_new_tokens=10) for _ in prompts])
    params = [SamplingParams(max_new_tokens=10, stop_token_ids=(r[3],)) for r in ref]
    runs = []
    for flag in (False, True):
        eng = Engine(model, max_model_len=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                     async_scheduling=flag)
        mixed_fed, launch = [0], eng.runner.launch

        def counting(seqs, fresh, prev=None, cache_ops=None, launch=launch, mixed_fed=mixed_fed):
            mixed_fed[0] += prev is not None and prev[2] is not None
            return launch(seqs, fresh, prev, cache_ops)
        eng.runner.launch = counting
        runs.append((*_drive(eng, prompts, params), mixed_fed[0]))
    (sync, sr, _, _), (asy, ar, fed, mixed_fed) = runs
    assert mixed_fed >= 3 and fed > mixed_fed, (fed, mixed_fed)
    assert asy == sync and ar == sr and "stop" in ar.values()


def test_async_prompt_only_step_queued_before_the_previous_is_read(model):
    """A step of prompt chunks only needs nothing the previous step sampled: it is queued before
    that step is read (one request finishes with its first token while the next prompt waits for
    its slot), and the tokens equal the synchronous engine's."""
    prompts = _prompts(3, seed=14)
    params = [SamplingParams(max_new_tokens=1) for _ in prompts]
    ref, _, _ = _drive(Engine(model, max_model_len=64, max_num_seqs=1, async_scheduling=False), prompts, params)
    eng = Engine(model, max_model_len=64, max_num_seqs=1)
    order, launch, resolve = [], eng.runner.launch, eng._resolve

    def launching(*a, **k):
        order.append("launch")
        return launch(*a, **k)

    def resolving(pending):
        order.append("read")
        return resolve(pending)
    eng.runner.launch, eng._resolve = launching, resolving
    got, reasons, _ = _drive(eng, prompts, params)
    assert got == ref and set(reasons.values()) == {"length"}
    assert order[:3] == ["launch", "launch", "read"], order


def test_async_max_model_len_and_abort_while_queued(model):
    prompts = _prompts(3, seed=4)
    params = [SamplingParams(max_new_tokens=40) for _ in prompts]
    eng = Engine(model, max_model_len=28, block_size=4, async_scheduling=False)
    sync, sr, _ = _drive(eng, prompts, [SamplingParams(max_new_tokens=28 - len(p)) for p in prompts])
    eng = Engine(model, max_model_len=28, block_size=4)
    asy, ar, fed = _drive(eng, prompts, [SamplingParams(max_new_tokens=28 - len(p)) for p in prompts])
    assert fed > 0 and asy == sync and ar == sr == {f"r{i}": "length" for i in range(3)}
    # abort r1 after the 4th call: a step of r1 is queued then; nothing of it may come out
    eng = Engine(model, max_model_len=64, block_size=4)
    got, reasons, _ = _drive(eng, prompts, params[:1] + [SamplingParams(max_new_tokens=40)] * 2, abort_at=("r1", 4))
    ref, _, _ = _drive(Engine(model, max_model_len=64, block_size=4, async_scheduling=False), prompts,
                       [SamplingParams(max_new_tokens=40)] * 3)
    assert reasons["r1"] == "abort" and got[1] == ref[1][:len(got[1])] and len(got[1]) < 40
    assert got[0] == ref[0] and got[2] == ref[2]


def test_async_non_finite_logits_end_the_request(model, monkeypatch):
    """One request's logits turn NaN at its 3rd token: it ends with an error and no token for that
    position; the step already queued for it is dropped; the others are unaffected."""
    prompts = _prompts(3, seed=6)
    params = [SamplingParams(max_new_tokens=8) for _ in prompts]
    ref, _, _ = _drive(Engine(model, max_model_len=64, block_size=4, async_scheduling=False), prompts, params)
    real, seen = mr.sample_async, {}

    def poisoned(logits, ps, gens):
        for i in [i for i, p in enumerate(ps) if p is params[1]]:
            seen["r1"] = seen.get("r1", 0) + 1
            if seen["r1"] == 3:
                logits = logits.clone()
                logits[i, 7] = float("nan")
        return real(logits, ps, gens)
    monkeypatch.setattr(mr, "sample_async", poisoned)
    got, reasons, fed = _drive(Engine(model, max_model_len=64, block_size=4), prompts, params)
    assert fed > 0 and reasons == {"r0": "length", "r1": "error", "r2": "length"}
    assert got[1] == ref[1][:2] and got[0] == ref[0] and got[2] == ref[2]


def test_engine_loop_reports_each_step_and_logs_slow_ones(model, monkeypatch, caplog):
    """The loop that owns the engine (under `kernelgate serve`) sends (kind, tokens, seconds) of
    every step with its outputs (the /metrics step histogram), and logs a step slower than
    SLOW_STEP_S with its kind and size."""
    from kernelgate.serving import core_loop
    monkeypatch.setattr(core_loop, "SLOW_STEP_S", 0.0)          # every step counts as slow here
    cmds = [[AddRequest("a", [5, 6, 7, 8], SamplingParams(max_new_tokens=3))], []]
    events = []

    def take(block):
        if cmds:
            return cmds.pop(0)
        return [Exit()] if block else []
    eng = Engine(model, max_num_seqs=2, max_model_len=64)
    with caplog.at_level("WARNING", logger="kernelgate.engine"):
        core_loop.run_loop(eng, take, events.extend)
    steps = [ev.step for ev in events if isinstance(ev, Outputs) and ev.step is not None]
    assert [k for k, _, _ in steps][:2] == ["prefill", "decode"] and steps[0][1] == 4
    assert all(t == 1 for k, t, _ in steps if k == "decode") and all(s > 0 for _, _, s in steps)
    out = [o for ev in events if isinstance(ev, Outputs) for o in ev.outputs]
    assert out[-1].finished and sum(len(o.new_token_ids) for o in out) == 3
    assert any("a prefill step of 4 tokens (1 sequence) took" in r.getMessage() for r in caplog.records)


def test_engine_loop_timeline_at_debug(model, caplog):
    """At log level DEBUG the loop logs every step: its start, the requests added before it,
    its kind, tokens, sequences and duration (bench/e2e/serve_separate.py --trace reads them)."""
    import re

    from kernelgate.serving import core_loop
    cmds = [[AddRequest("a", [5, 6, 7], SamplingParams(max_new_tokens=2)),
             AddRequest("b", [9, 8], SamplingParams(max_new_tokens=2))], []]

    def take(block):
        if cmds:
            return cmds.pop(0)
        return [Exit()] if block else []
    with caplog.at_level("DEBUG", logger="kernelgate.engine"):
        core_loop.run_loop(Engine(model, max_num_seqs=2, max_model_len=64), take, lambda evs: None)
    pat = re.compile(r"kernelgate step: t=[\d.]+ adds=(\d+) kind=(\w+) tokens=(\d+) seqs=(\d+) dt=[\d.]+$")
    lines = [m.groups() for r in caplog.records if (m := pat.match(r.getMessage()))]
    assert lines[0] == ("2", "prefill", "5", "2") and lines[1] == ("0", "decode", "2", "2")
    assert lines[-1][1] == "none" and len(lines) >= 3


def test_generate_timing_accounts_for_every_call(model):
    """Timing.steps has one entry per engine call, the first (which only queued the prefill
    under async scheduling) as "launch": their sum is the call's wall time but for bookkeeping."""
    import time

    import kernelgate
    from kernelgate.serving.drive import Timing
    t = Timing()
    t0 = time.perf_counter()
    out = kernelgate.generate(model, _prompts(3, seed=9), max_new_tokens=5, stop_token_ids=[], timing=t)
    wall = time.perf_counter() - t0
    kinds = [k for k, _, _ in t.steps]
    assert kinds[0] == "launch" and kinds[1] == "prefill" and kinds.count("launch") == 1
    assert kinds[2:] == ["decode"] * (len(kinds) - 2) and all(len(r.token_ids) == 5 for r in out)
    assert 0 < sum(s for _, _, s in t.steps) <= wall
