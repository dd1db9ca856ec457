"""Tensor / expert parallel on the CPU with Gloo: 2 ranks (this process is rank 0, the driver).

The sharded model must give the single-process model's logits (fp32, rel 1e-5) and greedy
tokens, with and without expert parallel, through kernelgate.generate / load_model; the
loader must read only each rank's slices; bad sizes and a killed rank end with one clear
error. One worker group is spawned per test process and reused (process startup dominates).
"""
from __future__ import annotations

import signal
from collections import Counter

import pytest
import torch

import kernelgate
from kernelgate import platform
from kernelgate.distributed import launch
from kernelgate.executor.parallel import parallelize
from kernelgate.models import build, tiny
from kernelgate.models import safetensors_file
from kernelgate.models.loader import load_model, save_checkpoint
from kernelgate.models.parallel import Parallel, shard_specs

PROMPTS = [[5], list(range(3, 66)), list(range(100, 163)) + [7, 8], [11, 12, 13]]   # T = 1, 63, 65, 3


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def model():
    return build(tiny(), seed=0)


@pytest.fixture(scope="module")
def single(model):
    """The single-process references: logits of a full forward, greedy tokens of generate()."""
    ids = torch.tensor([list(range(40, 105))])                       # [1, 65]
    gen = kernelgate.generate(model, PROMPTS, max_new_tokens=6, max_num_batched_tokens=32)
    return ids, model(ids), [r.token_ids for r in gen]


@pytest.mark.parametrize("name,backend", [("cuda", "nccl"), ("rocm", "nccl"), ("xpu", "xccl"),
                                          ("npu", "hccl"), ("cpu", "gloo")])
def test_collective_backend_declared_per_platform(name, backend):
    with platform.simulate(name) as p:
        got, reason = platform.collective_backend(p)
        line = platform.collective_line(p)
    assert got == backend and reason
    assert line.startswith(f"collectives: {backend} (")
    if name != platform.current().real and platform.COLLECTIVE_BACKENDS[platform.current().real][0] != backend:
        assert "simulated: runs use" in line


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_loader_reads_only_its_slices(model, tmp_path, ep):
    save_checkpoint(model, tmp_path)
    full = dict(model.named_parameters())
    for r in range(2):
        safetensors_file.bytes_read[0] = 0
        shard = load_model(tmp_path, device="cpu", par=Parallel(r, 2, ep))
        specs = shard_specs(shard)
        want_bytes = 0
        for n, p in shard.named_parameters():
            f = full[n]
            want_bytes += f.numel() * f.element_size() // (2 if n in specs else 1)
            if n not in specs:
                assert torch.equal(p, f), n
                continue
            dim, segments = specs[n]
            assert torch.equal(p, torch.cat([s.chunk(2, dim)[r] for s in f.chunk(segments, dim)], dim)), n
        assert safetensors_file.bytes_read[0] == want_bytes
        # the routed experts are half of each rank's reads' worth of the checkpoint at most
        assert "model.layers.1.mlp.experts.gate_up_proj" in specs


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_loader_slices_a_released_layout_checkpoint(tmp_path, ep):
    """HF save_pretrained's original format: separate q/k/v and conv [C, 1, W], A_log [1, 1, H, 1],
    per-expert w1 / w2 / w3 (expert parallel: whole experts or none; otherwise strided row reads)."""
    from helpers.kimi_hf import tiny_hf_model
    tiny_hf_model().save_pretrained(tmp_path)
    full = dict(load_model(tmp_path, device="cpu").named_parameters())
    for r in range(2):
        shard = load_model(tmp_path, device="cpu", par=Parallel(r, 2, ep))
        specs = shard_specs(shard)
        for n, p in shard.named_parameters():
            f = full[n]
            if n in specs:
                dim, segments = specs[n]
                f = torch.cat([s.chunk(2, dim)[r] for s in f.chunk(segments, dim)], dim)
            assert torch.equal(p, f), n


def test_bad_sizes_are_clear_errors(model, monkeypatch):
    with pytest.raises(kernelgate.KernelgateError, match=r"tensor_parallel_size 3 does not divide linear_num_heads"):
        kernelgate.generate(model, [[1, 2]], tensor_parallel_size=3)
    with pytest.raises(kernelgate.KernelgateError, match=r"tensor_parallel_size must be >= 1, got 0"):
        kernelgate.generate(model, [[1, 2]], tensor_parallel_size=0)
    odd = build(tiny(num_experts=6), seed=0)
    with pytest.raises(kernelgate.KernelgateError, match=r"does not divide num_experts \(enable_expert_parallel\) \(6\)"):
        kernelgate.generate(odd, [[1, 2]], tensor_parallel_size=4, enable_expert_parallel=True)
    from kernelgate.distributed import group
    monkeypatch.setattr(group, "device_count", lambda: 1)
    with pytest.raises(kernelgate.KernelgateError, match=r"tensor_parallel_size 2 > the 1 cpu device\(s\) available"):
        kernelgate.generate(model, [[1, 2]], tensor_parallel_size=2)


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_sharded_equals_single_process(model, single, ep):
    ids, logits, tokens = single
    out = kernelgate.generate(model, PROMPTS, max_new_tokens=6, max_num_batched_tokens=32,
                              tensor_parallel_size=2, enable_expert_parallel=ep)
    assert [r.token_ids for r in out] == tokens
    pm = parallelize(model, 2, ep)
    got = pm(ids)
    assert got.shape == logits.shape
    assert rel(got, logits) < 1e-5
    with pytest.raises(kernelgate.KernelgateError, match=r"token ids must be in \[0, 512\), got \[3, 512\]"):
        pm(torch.tensor([[3, 512]]))


def test_prefix_cache_hits_on_every_rank(model, single):
    """The same prompts again on the sharded engine: every rank restores the snapshots the driver
    planned (the step plan carries the saves / restores / copies), giving the single-process tokens."""
    ids, logits, tokens = single
    first = kernelgate.generate(model, PROMPTS, max_new_tokens=6, max_num_batched_tokens=32, tensor_parallel_size=2)
    again = kernelgate.generate(model, PROMPTS, max_new_tokens=6, max_num_batched_tokens=32, tensor_parallel_size=2)
    assert [r.token_ids for r in first] == [r.token_ids for r in again] == tokens
    assert max(r.num_cached_tokens for r in again) >= 60      # the long prompts resumed


def test_load_model_tensor_parallel(model, single, tmp_path):
    ids, logits, tokens = single
    save_checkpoint(model, tmp_path)
    pm = kernelgate.load_model(tmp_path, tensor_parallel_size=2, enable_expert_parallel=True)
    assert rel(pm(ids), logits) < 1e-5
    eng = kernelgate.engine.Engine(pm, max_num_seqs=4, max_model_len=80, max_num_batched_tokens=32)
    out = kernelgate.generate(pm, PROMPTS, max_new_tokens=6, engine=eng)
    assert [r.token_ids for r in out] == tokens


def test_rank_stats_name_every_rank(model):
    pm = parallelize(model, 2, True)
    kernelgate.generate(pm, PROMPTS[:1], max_new_tokens=2)
    stats = pm.rank_stats()
    assert [s["device"] for s in stats] == ["cpu", "cpu"] and all(s["peak_bytes"] is None for s in stats)
    # the last engine's decode graphs, per rank: none on the CPU (Gloo decodes eagerly), with the reason
    assert all(s["graphs"] == 0 and s["graphs_off"] == "torch has no device graphs for 'cpu'" for s in stats)


def _collectives(fn) -> Counter:
    """torch.distributed calls this process (rank 0) makes while fn() runs, by kind (the profiler
    records each c10d op; nothing is wrapped)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_one_all_reduce_per_block(model, ep):
    """Per step: one all-reduce for the vocab-parallel embedding, then one per attention block and one
    per MLP block (the MoE folds the shared expert's partial sum into the routed experts' one), one
    all-gather of the vocab-parallel logits. Each block needs at least one (its output is a partial
    sum; the equality tests check it is reduced), so a total of 1 + 2 x layers means exactly one each.
    A decode step's metadata is one tensor broadcast (no pickling)."""
    L = model.config.num_hidden_layers
    pm = parallelize(model, 2, ep)
    ids = torch.tensor([list(range(40, 50))])
    got = _collectives(lambda: pm(ids))
    assert got["c10d::allreduce_"] == 1 + 2 * L and got["c10d::allgather_"] == 1, got
    eng = kernelgate.engine.Engine(pm, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32)
    for i, p in enumerate([PROMPTS[0], PROMPTS[3]]):
        eng.add_request(str(i), p, kernelgate.engine.SamplingParams(max_new_tokens=4))
    while eng.last_step is None or eng.last_step.kind != "decode":
        eng.step()
    got = _collectives(eng.step)
    assert eng.last_step.kind == "decode"
    assert got == Counter({"c10d::allreduce_": 1 + 2 * L, "c10d::allgather_": 1, "c10d::broadcast_": 1}), got
    while eng.has_unfinished():
        eng.step()
    eng.close()


def test_step_plan_words_round_trip():
    from kernelgate.distributed import group
    from kernelgate.executor.plan import StepPlan
    plan = StepPlan(lengths=[3, 1], slots=[0, 3], starts=[0, 40], tables=[[1], [4, 7, 8]], tokens=[5, 6, 7, 9],
                    fresh_slots=[3], fresh_blocks=[7, 8])
    words = group.frame("step", plan.to_words())
    assert words[:2] == [group.STEP, len(words) - 2] and group.remainder(words) == 0
    assert StepPlan.from_words(group.unframe(words)) == plan
    big = StepPlan(lengths=[group.HEAD - 1, 1], slots=[0, 3], starts=[0, 40], tables=[[1], [4, 7, 8]],
                   tokens=list(range(group.HEAD)), fresh_slots=[3], fresh_blocks=[7, 8])
    words = group.frame("step", big.to_words())
    assert group.remainder(words[:group.HEAD]) == len(words) - group.HEAD > 0
    assert StepPlan.from_words(group.unframe(words)) == big
    assert group.frame("load", {"path": "x"}) == [group.OBJECT, 0]


def test_ranks_agree_on_each_decode_graph():
    """A captured shape is used only if every rank captured it; otherwise all ranks decode it
    eagerly (no rank replays a graph while another steps eagerly), the reason naming the rank."""
    from kernelgate.executor.parallel.rank_runner import LockstepGraphs

    class Groups:
        rank, graph_state = 0, None

        def __init__(self, whys):
            self.whys = whys

        def gather(self, why):
            return [why, *self.whys[1:]]

    g = object.__new__(LockstepGraphs)
    g.graphs = {}
    g.groups = Groups([None, None])
    assert g.agree(None) is None and g.groups.graph_state == (1, None)
    g.groups = Groups([None, "capture failed (RuntimeError: x)"])
    assert g.agree(None) == "rank 1: capture failed (RuntimeError: x)"
    assert g.agree("capture failed (here)") == "capture failed (here)"


def test_killed_rank_ends_the_job_with_its_name(model):
    pm = parallelize(model, 2, False)
    w = pm.workers
    w.procs[0].send_signal(signal.SIGKILL)
    with pytest.raises(kernelgate.KernelgateError, match=r"tensor parallel: rank 1 of 2 died \(killed by signal SIGKILL\)"):
        kernelgate.generate(model, PROMPTS[:2], max_new_tokens=4, tensor_parallel_size=2)
    assert w.closed and launch._live.get("workers") is None
    with pytest.raises(kernelgate.KernelgateError, match="worker ranks are gone"):
        pm(torch.tensor([[1, 2]]))


def test_run_cli_tensor_parallel_equals_single_process():
    """`kernelgate run --tp 2 --enable-expert-parallel --json` (the built-in model, Gloo ranks) gives
    the single-process greedy tokens for the same prompts."""
    import json
    import subprocess
    import sys

    import kernelgate
    from kernelgate.cli.model import builtin_model
    cmd = [sys.executable, "-m", "kernelgate", "run", "--tp", "2", "--enable-expert-parallel", "--json",
           "--prompt-ids", "5,17,300", "--prompt-ids", "9,2", "--batch", "2", "--max-new-tokens", "6", "--device", "cpu"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["engine"]["tensor_parallel_size"] == 2
    got = [r["token_ids"] for r in report["results"]]
    model = builtin_model("cpu")
    want = [r.token_ids for r in kernelgate.generate(model, [[5, 17, 300], [9, 2]], max_new_tokens=6,
                                                      stop_token_ids=list(model.config.eos_token_ids))]
    assert got == want and all(len(t) >= 1 for t in got)


# Every config field away from its default (as tests/models/test_loader.py's NON_DEFAULT), sizes
# that split over 2 ranks (heads, vocab, intermediate sizes, experts).
ODD = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
           rms_norm_eps=1e-6, tie_word_embeddings=True, num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24,
           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, linear_num_heads=2, linear_head_dim=8,
           num_experts=6, num_experts_per_token=3, num_shared_experts=2, n_group=3, topk_group=2,
           moe_renormalize=False, routed_scaling_factor=1.5, layer_types=["mla", "kda", "kda"],
           mlp_types=["moe", "dense", "moe"], bos_token_id=1, dtype="float32")


@pytest.mark.parametrize("scoring,conv,ep", [("softmax", 3, False), ("sqrtsoftplus", 5, True)],
                         ids=["softmax-conv3-tp2", "sqrtsoftplus-conv5-tp2-ep"])
def test_every_config_gives_single_process_tokens(tmp_path, scoring, conv, ep):
    """Scoring functions, conv widths and EOS ids reach every rank: generate() over 2 ranks and a
    checkpoint loaded with tensor_parallel_size 2 stop where the single process stops, with its tokens."""
    from kernelgate.models import KimiLinearConfig
    m = build(KimiLinearConfig(**ODD, scoring=scoring, conv_kernel_size=conv), seed=2)
    prompts = [p for p in PROMPTS if max(p) < 96]
    free = kernelgate.generate(m, prompts, max_new_tokens=8, stop_token_ids=[])
    m.config.eos_token_ids = [free[0].token_ids[3]]          # the first prompt stops at its 4th token
    want = [r.token_ids for r in kernelgate.generate(m, prompts, max_new_tokens=8)]
    assert len(want[0]) == 4
    got = kernelgate.generate(m, prompts, max_new_tokens=8, tensor_parallel_size=2, enable_expert_parallel=ep)
    assert [r.token_ids for r in got] == want
    save_checkpoint(m, tmp_path)
    pm = kernelgate.load_model(tmp_path, tensor_parallel_size=2, enable_expert_parallel=ep)
    assert pm.config == m.config
    assert [r.token_ids for r in kernelgate.generate(pm, prompts, max_new_tokens=8)] == want
