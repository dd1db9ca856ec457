"""Tensor / expert parallel for the Gated DeltaNet family (Qwen3-Next, Qwen3.5-MoE) on the CPU
with Gloo: 2 ranks, this process rank 0.

Checkpoints written by transformers' save_pretrained: Qwen3-Next's (q|k|v|z and b|a fused and
interleaved per key head: each rank de-interleaves only its heads' rows; a dense MLP layer) and
Qwen3.5-MoE's (separate projections, the multimodal wrapper). Sharded = single process: logits
(fp32, rel 1e-5) and greedy tokens; each rank holds exactly its slices (q | k | v are segments of
unequal size); one all-reduce per block.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

import kernelgate
from kernelgate.models.loader import load_model, save_checkpoint
from kernelgate.models.parallel import Parallel, shard_specs
from kernelgate.models.qwen3_next import build
from kernelgate.models.qwen3_next_config import tiny

PROMPTS = [[5], list(range(3, 66)), [11, 12, 13]]   # T = 1, 63, 3
IDS = torch.tensor([list(range(40, 105))])           # [1, 65]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from helpers.qwen_hf import tiny_qwen3_5_moe, tiny_qwen3_next
    root = tmp_path_factory.mktemp("qwen-tp")
    models = {"next": tiny_qwen3_next(seed=0, mlp_only_layers=[1]),
              # the shared expert as wide as a routed one: stacked with them (tensor parallel) or beside them (EP)
              "next_stacked": tiny_qwen3_next(seed=3, shared_expert_intermediate_size=32),
              "q35": tiny_qwen3_5_moe(seed=1, multimodal=True)}
    for name, m in models.items():
        m.save_pretrained(root / name)
    return root


def _slice(full: torch.Tensor, spec, r: int) -> torch.Tensor:
    """Rank r of 2's part of `full` under shard mark (dim, segments), computed independently of
    Parallel.part: each segment (equal parts, or the given full sizes) halved."""
    dim, segments = spec
    n = full.shape[dim]
    sizes = [n // segments] * segments if isinstance(segments, int) else list(segments)
    parts = torch.split(full, sizes, dim)
    return torch.cat([s.chunk(2, dim)[r] for s in parts], dim)


@pytest.mark.parametrize("name", ["next", "q35"])
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_each_rank_holds_its_slices(ckpts, name, ep):
    full = dict(load_model(ckpts / name, device="cpu").named_parameters())
    seen = set()
    for r in range(2):
        shard = load_model(ckpts / name, device="cpu", par=Parallel(r, 2, ep))
        specs = shard_specs(shard)
        for n, p in shard.named_parameters():
            want = _slice(full[n], specs[n], r) if n in specs else full[n]
            assert torch.equal(p, want), n
            if n in specs:
                seen.add(n.split(".", 3)[-1])
    # the unequal q | k | v segments and the per-head interleaved checkpoint rows are among them
    assert "linear_attn.in_proj_qkv.weight" in seen and "linear_attn.conv1d.weight" in seen
    assert any("experts" in s for s in seen)


@pytest.mark.parametrize("name", ["next", "next_stacked", "q35"])
@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_sharded_equals_single_process(ckpts, name, ep):
    single = load_model(ckpts / name, device="cpu")
    logits = single(IDS)
    want = [r.token_ids for r in kernelgate.generate(single, PROMPTS, max_new_tokens=6, max_num_batched_tokens=32)]
    pm = kernelgate.load_model(ckpts / name, tensor_parallel_size=2, enable_expert_parallel=ep)
    assert pm.config == single.config
    assert rel(pm(IDS), logits) < 1e-5
    got = kernelgate.generate(pm, PROMPTS, max_new_tokens=6, max_num_batched_tokens=32)
    assert [r.token_ids for r in got] == want


def test_in_process_model_and_checkpoint_round_trip(tmp_path):
    """generate(model, tensor_parallel_size=2) on a model built here (written once to a checkpoint
    in kernelgate's own names, config.json in transformers' layout) gives its tokens."""
    m = build(tiny(model_type="qwen3_5_moe", eos_token_ids=[]), seed=0)
    want = [r.token_ids for r in kernelgate.generate(m, PROMPTS, max_new_tokens=5)]
    got = kernelgate.generate(m, PROMPTS, max_new_tokens=5, tensor_parallel_size=2, enable_expert_parallel=True)
    assert [r.token_ids for r in got] == want
    save_checkpoint(m, tmp_path)
    assert load_model(tmp_path).config == dataclasses.replace(m.config, dtype="float32")   # the dtype written


def test_bad_sizes_are_clear_errors():
    m = build(tiny(), seed=0)
    with pytest.raises(kernelgate.KernelgateError,
                       match=r"tensor_parallel_size 4 does not divide linear_num_key_heads \(Gated DeltaNet key heads\) \(2\)"):
        kernelgate.generate(m, [[1, 2]], tensor_parallel_size=4)
    m = build(tiny(linear_num_key_heads=4, linear_num_value_heads=8, num_attention_heads=8,
                   num_key_value_heads=2, num_experts=8), seed=0)
    with pytest.raises(kernelgate.KernelgateError, match=r"does not divide num_key_value_heads"):
        kernelgate.generate(m, [[1, 2]], tensor_parallel_size=4)


def _collectives(fn) -> Counter:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_one_all_reduce_per_block(ckpts, ep):
    """The embedding, each token mixer (GDN or attention) and each MLP / MoE block: one
    all-reduce each (the shared expert's partial sum folded into the routed experts'); one
    all-gather of the logits."""
    pm = kernelgate.load_model(ckpts / "next", tensor_parallel_size=2, enable_expert_parallel=ep)
    L = pm.config.num_hidden_layers
    got = _collectives(lambda: pm(IDS[:, :10]))
    assert got["c10d::allreduce_"] == 1 + 2 * L and got["c10d::allgather_"] == 1, got
