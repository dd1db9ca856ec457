"""biased_grouped_topk against independent references: HF transformers' DeepseekV3 and
KimiLinear routers on random inputs, hand-computed E=8 cases, the fp32-bias dtype contract,
the empty batch, argument errors, and the sgl_kernel vendor slot's limits and adapter.
Every test runs each implementation that can run here (Triton under TRITON_INTERPRET=1)."""
import math

import pytest
import torch

from kernelgate import KernelgateError, forcing, platform, registry
from kernelgate.ops.moe import moe_routing

from helpers.impls import on_device, on_platform

OP = "biased_grouped_topk"


def _impls():
    op = registry.get(OP)
    return [pytest.param(name, id=name) for name in op.impls]


def route(impl, *args, **kwargs):
    """Call the op through the registry with `impl` forced; skip if it cannot run here."""
    op = registry.get(OP)
    why = op.impls[impl].unavailable(platform.current())
    if why:
        pytest.skip(f"{impl} cannot run here: {why}")
    with forcing({OP: impl}):
        return on_device(op, *args, **kwargs)


def by_id(w, ids):
    """Per row: (ids, weights) sorted by expert id, so pick order does not matter."""
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), w.gather(1, order)


# -- HF transformers routers (independent reference) -----------------------------------
def _hf_router(kind, E, n_group, topk_group, topk, rsf):
    if kind == "deepseek_v3":
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router
        cfg = DeepseekV3Config(hidden_size=E, n_routed_experts=E, n_group=n_group, topk_group=topk_group,
                               num_experts_per_tok=topk, routed_scaling_factor=rsf, norm_topk_prob=True)
    else:
        from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter as Router
        cfg = KimiLinearConfig(hidden_size=E, num_experts=E, num_expert_group=n_group, topk_group=topk_group,
                               num_experts_per_token=topk, routed_scaling_factor=rsf, moe_renormalize=True)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))   # identity gate: router_logits == hidden states, exactly
    return router


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("kind,T,E,n_group,topk_group,topk,rsf", [
    pytest.param("deepseek_v3", 63, 256, 8, 4, 8, 2.5, id="dsv3-T63-E256-G8g4-k8"),
    pytest.param("deepseek_v3", 1, 64, 4, 2, 6, 1.0, id="dsv3-T1-E64-G4g2-k6"),
    pytest.param("kimi_linear", 65, 256, 1, 1, 8, 2.446, id="kimi-T65-E256-G1-k8"),
    pytest.param("kimi_linear", 17, 384, 1, 1, 8, 2.827, id="kimi-T17-E384-G1-k8"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_hf_router(impl, kind, T, E, n_group, topk_group, topk, rsf, dtype):
    g = torch.Generator().manual_seed(T * 1000 + E)
    logits = (2 * torch.randn(T, E, generator=g)).to(dtype)
    bias = 0.1 * torch.randn(E, generator=g)
    router = _hf_router(kind, E, n_group, topk_group, topk, rsf)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(bias)
        _, hf_w, hf_ids = router(logits.float())
    w, ids = route(impl, logits, bias, topk, n_group, topk_group, True, rsf)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, topk)
    got_ids, got_w = by_id(w, ids)
    ref_ids, ref_w = by_id(hf_w.float(), hf_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)


def _hf_softmax_router(kind, E, topk, norm):
    """transformers' Qwen routers (softmax over E in fp32, top-k, optional renormalisation)."""
    if kind == "qwen3_next":
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig as Config
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter as Router
    elif kind == "qwen3_5_moe":   # always renormalises (no norm_topk_prob)
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter as Router
    else:
        from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig as Config
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter as Router
    router = Router(Config(hidden_size=E, num_experts=E, num_experts_per_tok=topk, norm_topk_prob=norm))
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))   # identity gate: router_logits == hidden states, exactly
    return router


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("kind,T,E,topk,norm", [
    pytest.param("qwen3_next", 65, 512, 10, True, id="qwen3next-80b-T65-E512-k10"),
    pytest.param("qwen3_5_moe", 63, 256, 8, True, id="qwen3.5-35b-T63-E256-k8"),
    pytest.param("qwen2_moe", 1, 60, 4, False, id="qwen2moe-T1-E60-k4-raw"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_hf_qwen_softmax_router(impl, kind, T, E, topk, norm, dtype):
    # softmax routing, no bias, one group, the shared expert's slot fused (its id E; the model
    # writes its weight). bf16 logits are distinct multiples of 1/64 (exact in bf16): torch.topk
    # orders ties its own way, the op by expert id
    g = torch.Generator().manual_seed(T * 1000 + E)
    if dtype == torch.bfloat16:
        logits = torch.stack([(torch.randperm(E, generator=g) - E // 2) / 64 for _ in range(T)]).to(dtype)
    else:
        logits = 2 * torch.randn(T, E, generator=g)
    router = _hf_softmax_router(kind, E, topk, norm)
    with torch.no_grad():
        _, hf_w, hf_ids = router(logits.float())
    w, ids = route(impl, logits, None, topk, 1, 1, norm, 1.0, scoring="softmax", num_fused_shared_experts=1)
    assert w.shape == ids.shape == (T, topk + 1) and w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids[:, topk], torch.full((T,), E, dtype=torch.int32))
    got_ids, got_w = by_id(w[:, :topk], ids[:, :topk])
    ref_ids, ref_w = by_id(hf_w.float(), hf_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-7)
    # a zero bias selects the same experts with the same weights
    w0, ids0 = route(impl, logits, torch.zeros(E), topk, 1, 1, norm, 1.0, scoring="softmax", num_fused_shared_experts=1)
    assert torch.equal(ids0, ids) and torch.equal(w0, w)


# -- hand-computed E=8, 2 groups of 4 ------------------------------------------------------
P = [0.9, 0.1, 0.2, 0.3, 0.8, 0.7, 0.6, 0.05]    # sigmoid scores; group sums (top-2): 1.2 | 1.5


def _logit(p):
    return torch.tensor([[math.log(x / (1 - x)) for x in p]], dtype=torch.float32)


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("bias_at,want_ids,want_w", [
    # group 2 wins (1.5 > 1.2) although expert 0 has the top score: picks 4 (0.8), 5 (0.7)
    pytest.param(None, [4, 5], [0.8 / 1.5 * 2, 0.7 / 1.5 * 2], id="group-beats-top-expert"),
    # bias +0.15 on expert 6: c6 = 0.75 > c5 = 0.7; its weight stays the unbiased 0.6
    pytest.param((6, 0.15), [4, 6], [0.8 / 1.4 * 2, 0.6 / 1.4 * 2], id="bias-reorders"),
    # bias +0.7 on expert 1: group 1 = 0.9 + 0.8 = 1.7 wins; weight of expert 1 is s = 0.1
    pytest.param((1, 0.7), [0, 1], [0.9 / 1.0 * 2, 0.1 / 1.0 * 2], id="bias-flips-group"),
])
def test_hand_computed_sigmoid(impl, bias_at, want_ids, want_w):
    bias = torch.zeros(8)
    if bias_at:
        bias[bias_at[0]] = bias_at[1]
    w, ids = route(impl, _logit(P), bias, 2, 2, 1, True, 2.0)
    assert ids.tolist() == [want_ids]
    torch.testing.assert_close(w, torch.tensor([want_w]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", _impls())
def test_hand_computed_shared_slots(impl):
    # SGLang convention: shared ids E, E+1; weight = sum of renormalized routed weights = 1
    w, ids = route(impl, _logit(P), torch.zeros(8), 2, 2, 1, True, 2.0, num_fused_shared_experts=2)
    assert ids.tolist() == [[4, 5, 8, 9]]
    torch.testing.assert_close(w, torch.tensor([[0.8 / 1.5 * 2, 0.7 / 1.5 * 2, 1.0, 1.0]]))


@pytest.mark.parametrize("impl", _impls())
def test_hand_computed_gated_shared_slots(impl):
    # shared_gate="sigmoid": columns 8, 9 are the two shared experts' gate logits; routing reads
    # columns 0..7 only (a huge gate logit must not be picked), each shared slot weighs sigmoid(its logit)
    logits = torch.cat([_logit(P), torch.tensor([[30.0, math.log(0.25 / 0.75)]])], dim=1)   # [1, 10]
    w, ids = route(impl, logits, torch.zeros(8), 2, 2, 1, True, 2.0, num_fused_shared_experts=2,
                   shared_gate="sigmoid")
    assert ids.tolist() == [[4, 5, 8, 9]]
    torch.testing.assert_close(w, torch.tensor([[0.8 / 1.5 * 2, 0.7 / 1.5 * 2, 1.0, 0.25]]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", _impls())
def test_hand_computed_ties_go_to_lower_ids(impl):
    # all scores equal: both groups tie (group 0 kept), experts tie (0 then 1)
    w, ids = route(impl, torch.zeros(3, 8), torch.zeros(8), 2, 2, 1, True, 2.0)
    assert ids.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(w, torch.ones(3, 2))
    # tie only inside the kept group: experts 5 and 6 equal, lower (5) is picked first
    p = [0.1, 0.1, 0.1, 0.1, 0.2, 0.7, 0.7, 0.3]
    w, ids = route(impl, _logit(p), None, 2, 2, 1, False, 1.0)
    assert ids.tolist() == [[5, 6]]


@pytest.mark.parametrize("impl", _impls())
def test_hand_computed_softmax_and_sqrtsoftplus(impl):
    # softmax of log(1..8) = i / 36; group 2 (5..8) wins; no renormalize, rsf 1
    logits = torch.log(torch.arange(1, 9, dtype=torch.float32))[None]
    w, ids = route(impl, logits, None, 3, 2, 1, False, 1.0, scoring="softmax")
    assert ids.tolist() == [[7, 6, 5]]
    torch.testing.assert_close(w, torch.tensor([[8 / 36, 7 / 36, 6 / 36]]))
    # sqrtsoftplus: x = log(exp(y^2) - 1) gives s = y exactly in real arithmetic
    y = [0.3, 1.7, 0.2, 0.9, 1.1, 0.5, 2.5, 0.4]
    logits = torch.tensor([[math.log(math.expm1(v * v)) for v in y]])
    w, ids = route(impl, logits, None, 2, 1, 1, True, 1.0, scoring="sqrtsoftplus")
    assert ids.tolist() == [[6, 1]]
    torch.testing.assert_close(w, torch.tensor([[2.5 / 4.2, 1.7 / 4.2]]))


# -- the dtype contract: the fp32 bias is never rounded to the logits' dtype ----------------
@pytest.mark.parametrize("impl", _impls())
def test_fp32_bias_below_bf16_resolution_orders_experts(impl):
    E, k = 64, 8
    g = torch.Generator().manual_seed(7)
    rank = torch.randperm(E, generator=g).float()
    bias = 0.3 + 1e-5 * rank                 # steps of 1e-5; bf16 spacing at 0.3 is ~2e-3
    logits = torch.zeros(2, E, dtype=torch.bfloat16)   # equal scores: the bias alone decides
    want = rank.argsort(descending=True)[:k].tolist()  # fp32 math: the k largest bias entries
    w, ids = route(impl, logits, bias, k, 1, 1, True, 1.0)
    assert ids.tolist() == [want, want]
    # proof the test bites: a bias rounded to bf16 collapses to ties and picks other experts
    rounded = bias.to(torch.bfloat16).float()
    assert rounded.unique().numel() < E // 4
    _, ids_rounded = route(impl, logits, rounded, k, 1, 1, True, 1.0)
    assert set(ids_rounded[0].tolist()) != set(want)


# -- empty batch, argument errors -----------------------------------------------------------
@pytest.mark.parametrize("impl", _impls())
def test_empty_batch(impl):
    if impl == "sgl_kernel":
        pytest.skip("moe_fused_gate declines T=0 (supports reason); the registry falls back")
    w, ids = route(impl, torch.randn(0, 256, dtype=torch.bfloat16), torch.zeros(256), 8, 8, 4, True, 2.5,
                  num_fused_shared_experts=1)
    assert w.shape == (0, 9) and w.dtype == torch.float32
    assert ids.shape == (0, 9) and ids.dtype == torch.int32


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n_group=3), "n_group 3 must divide the expert count 64"),
    (dict(topk_group=5), "topk_group 5 must be <= n_group 4"),
    (dict(topk=40), "topk 40 > experts in the kept groups"),
    (dict(scoring="relu"), "scoring 'relu' not in"),
    (dict(bias=torch.zeros(63)), "bias shape (63,) != (64,)"),
    (dict(logits=torch.zeros(4, 64, dtype=torch.int32)), "logits dtype int32"),
    (dict(num_fused_shared_experts=-1), "num_fused_shared_experts must be an int >= 0"),
    (dict(shared_gate="sigmoid"), "num_fused_shared_experts must be >= 1"),
    (dict(shared_gate="tanh", num_fused_shared_experts=1), "shared_gate 'tanh' not in"),
    (dict(shared_gate="sigmoid", num_fused_shared_experts=1), "bias shape (64,) != (63,)"),   # gate column
    (dict(shared_gate="sigmoid", num_fused_shared_experts=1, bias=None, logits=torch.zeros(4, 64)),
     "n_group 4 must divide the expert count 63"),
])
def test_bad_arguments_name_op_argument_and_constraint(kwargs, needle):
    a = dict(logits=torch.zeros(4, 64), bias=torch.zeros(64), topk=8, n_group=4, topk_group=2,
             renormalize=True, routed_scaling_factor=1.0)
    a.update(kwargs)
    with pytest.raises(KernelgateError, match=OP) as e:
        registry.get(OP)(**a)
    assert needle in str(e.value)


# -- sgl_kernel vendor slot -------------------------------------------------------------------
def _call(E=256, n_group=8, topk_group=4, topk=8, T=4, **kw):
    args = (torch.zeros(T, E, dtype=torch.bfloat16), torch.zeros(E), topk, n_group, topk_group,
            kw.pop("renormalize", True), 2.5)
    return args, kw


@pytest.mark.parametrize("change,reason", [
    (dict(), None),                                                    # DeepSeek V3 routing fits
    (dict(scoring="softmax"), "sigmoid only"),
    (dict(renormalize=False), "always renormalizes"),
    (dict(E=384, n_group=12, topk_group=4), "power-of-two expert count (E=384)"),
    (dict(n_group=1, topk_group=1), "E / n_group <= 32 experts per group (got 256)"),
    (dict(E=2048, n_group=64, topk_group=4), "n_group <= 32 (got 64)"),
    (dict(num_fused_shared_experts=2), "one shared slot"),
    (dict(num_fused_shared_experts=1, shared_gate="sigmoid"), "fixed weight"),
    (dict(T=0), "empty batch"),
])
def test_sgl_kernel_limits(change, reason):
    change = dict(change)
    shape = {k: change.pop(k) for k in ("E", "n_group", "topk_group", "T", "renormalize") if k in change}
    args, kw = _call(**shape)
    got = moe_routing.sgl_kernel_limits(*args, **{**kw, **change})
    assert got is None if reason is None else reason in got


def test_sgl_kernel_adapter_upcasts_at_the_call_only():
    logits = torch.randn(3, 256).to(torch.bfloat16)
    bias = (0.3 + 1e-5 * torch.arange(256.0)).to(torch.bfloat16)     # a model that stores bf16
    args, kwargs = moe_routing.sgl_kernel_adapt((logits, bias, 8, 8, 4, True, 2.5), {})
    assert kwargs["logits"].dtype == torch.float32 and kwargs["bias"].dtype == torch.float32
    assert torch.equal(kwargs["logits"], logits.float()) and torch.equal(kwargs["bias"], bias.float())
    assert bias.dtype == torch.bfloat16 and logits.dtype == torch.bfloat16   # stored tensors untouched


def test_doctor_explains_sgl_kernel():
    op = registry.get(OP)
    with platform.simulate("cuda"):
        reasons = {i.name: r for i, r in op.explain()}
    if platform.library_reason("sgl_kernel"):
        assert "sgl_kernel does not import" in reasons["sgl_kernel"]
    with platform.simulate("xpu"):
        reasons = {i.name: r for i, r in op.explain()}
    assert "not declared for xpu" in reasons["sgl_kernel"]


def test_xpu_and_rocm_dispatch_to_the_portable_kernel():
    if platform.current().triton:
        pytest.skip(f"Triton unusable here: {platform.current().triton}")
    op = registry.get(OP)
    host = (torch.randn(5, 256), torch.zeros(256), 8, 8, 4, True, 2.5)
    for name in ("xpu", "rocm"):
        with platform.simulate(name):
            args = on_platform(host)
            chosen = [i.name for i, r in op.explain(args, {}) if r is None]
            assert chosen == ["triton"], name
            w, ids = op(*args)
        assert torch.equal(ids.cpu(), moe_routing.biased_grouped_topk_native(*host)[1])
