"""bench/ops/variants/router_topk_one_launch.py: router logits + top-k routing of one token in one launch
equal the two ops (the native references): Kimi's sigmoid scoring with its fp32 bias and a fused shared
expert, grouped selection, Qwen's softmax with the shared expert's gate in the router's last row; repeated
calls (the counter is reset), and tiny Kimi / Qwen models decode the same greedy tokens with it. Not part
of CI (the kernel runs under the interpreter):
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_router_topk_one_launch.py"""
import os
import sys

import pytest
import torch

from kernelgate.ops.moe.moe_routing import biased_grouped_topk_native
from kernelgate.ops.moe.router_logits import router_logits_native

sys.path.insert(0, os.path.dirname(__file__))
import router_topk_one_launch as probe  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

CASES = {   # E_ALL, D, (topk, n_group, topk_group, renormalize, rsf, scoring, shared, shared_gate), bias
    "kimi": (64, 96, (6, 1, 1, True, 2.5, "sigmoid", 1, None), True),
    "grouped": (64, 80, (4, 8, 2, True, 1.5, "sigmoid", 0, None), True),
    "qwen": (33, 64, (4, 1, 1, True, 1.0, "softmax", 1, "sigmoid"), False),
    "no_renorm": (48, 40, (3, 1, 1, False, 1.0, "softmax", 0, None), False),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_two_ops(name, dtype):
    E_ALL, D, (k, ng, tg, renorm, rsf, scoring, shared, gate), has_bias = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    weight = torch.randn(E_ALL, D, generator=g).to(DEV)
    bias = (0.1 * torch.randn(E_ALL, generator=g)).to(DEV) if has_bias else None
    for call in range(3):                                  # the counter comes back to 0 after each call
        x = torch.randn(1, D, generator=g).to(dtype).to(DEV)
        logits = router_logits_native(x, weight)
        w_ref, ids_ref = biased_grouped_topk_native(logits, bias, k, ng, tg, renorm, rsf, scoring,
                                                    num_fused_shared_experts=shared, shared_gate=gate)
        w, ids = probe.route_one(x, weight, bias, k, ng, tg, renorm, rsf, scoring, shared, gate)
        assert ids.shape == ids_ref.shape == (1, k + shared)
        assert torch.equal(ids.long(), ids_ref.long()), (call, ids, ids_ref)
        torch.testing.assert_close(w, w_ref.float(), rtol=1e-5, atol=1e-6)
        assert int(probe._COUNTERS[torch.device(DEV)].item()) == 0


def test_ties_go_to_the_lower_expert():
    E, D = 32, 16
    weight = torch.zeros(E, D, device=DEV)
    weight[[3, 7, 20, 21, 30], 0] = 1.0                   # five equal logits: the top 4 are the lowest ids
    x = torch.ones(1, D, device=DEV)
    _, ids = probe.route_one(x, weight, None, 4, 1, 1, True, 1.0, "sigmoid")
    assert ids[0].tolist() == [3, 7, 20, 21]


@pytest.mark.parametrize("family", ["kimi", "qwen"])
def test_tiny_models_decode_the_same_greedy_tokens(family, monkeypatch):
    import kernelgate
    if family == "kimi":
        from kernelgate.models import build, tiny
        model = build(tiny(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=3), device=DEV, dtype=torch.float32, seed=5)
    else:
        from kernelgate.models.qwen3_next import build
        from kernelgate.models.qwen3_next_config import tiny
        model = build(tiny(shared_expert_intermediate_size=32), device=DEV, dtype=torch.float32, seed=5)
    prompts = [[5, 9, 17, 33, 2]]                         # one sequence: its decode steps are one token
    ref = [r.token_ids for r in kernelgate.generate(model, prompts, max_new_tokens=8, stop_token_ids=())]
    calls = []
    route = probe.route_one
    monkeypatch.setattr(probe, "route_one", lambda *a, **kw: calls.append(1) or route(*a, **kw))
    probe.install(num_warps=4)
    try:
        got = [r.token_ids for r in kernelgate.generate(model, prompts, max_new_tokens=8, stop_token_ids=())]
    finally:
        probe.uninstall()
    assert got == ref
    assert len(calls) >= 7                                           # one-token steps took the one launch


def test_uninstall_gives_the_forwards_back():
    from kernelgate.models.layers import Router
    from kernelgate.models.qwen_moe import SparseMoE
    before = Router.forward, SparseMoE.forward
    assert probe.install().startswith("router_topk_one_launch")
    assert Router.forward is not before[0] and SparseMoE.forward is not before[1]
    probe.uninstall()
    assert (Router.forward, SparseMoE.forward) == before
