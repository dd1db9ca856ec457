"""Kimi Linear model vs HF transformers' own kimi_linear (independent reference), on a tiny
checkpoint that transformers writes in the test: logits and greedy tokens, in both
checkpoint layouts and sharded, on the real platform and on simulated XPU (Triton under the
interpreter)."""
import pytest
import torch

import kernelgate
from kernelgate import platform, registry
from kernelgate.tools.testing import rel_err
from helpers.kimi_hf import hf_greedy, tiny_hf_model

# fp32 parity at 1e-4 and greedy equality run on the CPU everywhere: on a GPU, fla's chunk kernels and
# Triton's tl.dot compute fp32 products in TF32 (~1e-3 off transformers' CPU fp32 there, Session 29).
# The bf16 tests load on the default device.
FP32_DEVICE = "cpu"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    model = tiny_hf_model(seed=0)
    root = tmp_path_factory.mktemp("kimi")
    model.save_pretrained(root / "released")                                   # original layout
    model.save_pretrained(root / "hf", save_original_format=False)             # transformers layout
    model.save_pretrained(root / "sharded", max_shard_size="100KB")            # index + shards
    ids = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    return dict(model=model, root=root, ids=ids, logits=logits)


@pytest.mark.parametrize("layout", ["released", "hf", "sharded"])
def test_logits_match_hf(hf, layout):
    model = kernelgate.load_model(hf["root"] / layout, device=FP32_DEVICE)
    out = model(hf["ids"])                               # B2-T65: crosses a 64-token chunk
    assert out.shape == hf["logits"].shape
    assert rel_err(out, hf["logits"]) < 1e-4


def test_single_token_and_odd_lengths(hf):
    model = kernelgate.load_model(hf["root"] / "hf", device=FP32_DEVICE)
    for T in (1, 63):
        ids = hf["ids"][:1, :T]
        with torch.no_grad():
            ref = hf["model"](ids).logits
        assert rel_err(model(ids), ref) < 1e-4, f"T={T}"


def test_bf16_load_keeps_router_and_decay_fp32(hf):
    model = kernelgate.load_model(hf["root"] / "released", dtype="bfloat16")
    layer = model.model.layers[1]
    assert model.dtype == torch.bfloat16 and layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.self_attn.A_log.dtype == torch.float32 and layer.self_attn.dt_bias.dtype == torch.float32
    out = model(hf["ids"][:, :17])
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        ref = hf["model"](hf["ids"][:, :17]).logits
    assert rel_err(out.float(), ref) < 5e-2


def _greedy_vs_hf(model, hf_model, prompts, n=6):
    got = kernelgate.generate(model, prompts, max_new_tokens=n, stop_token_ids=())
    for p, r in zip(prompts, got):
        assert r.token_ids == hf_greedy(hf_model, p, n), f"prompt of {len(p)} tokens"
        assert r.finish_reason == "length"


def test_greedy_matches_hf(hf):
    ids = hf["ids"]
    prompts = [ids[0, :7].tolist(), ids[1, :1].tolist(), ids[1, :20].tolist()]
    _greedy_vs_hf(kernelgate.load_model(hf["root"] / "sharded", device=FP32_DEVICE), hf["model"], prompts)


def test_simulated_xpu_matches_hf(hf):
    if not platform.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (as in CI) so XPU's Triton kernels run on CPU")
    model = kernelgate.load_model(hf["root"] / "hf", device=FP32_DEVICE)
    registry._plan.clear()
    with platform.simulate("xpu"):
        out = model(hf["ids"][:, :17])
        _greedy_vs_hf(model, hf["model"], [hf["ids"][0, :5].tolist(), hf["ids"][1, :1].tolist()], n=3)
    with torch.no_grad():
        ref = hf["model"](hf["ids"][:, :17]).logits
    assert rel_err(out, ref) < 1e-4
    used = {impl for impls in registry.plan().values() for impl in impls}
    assert used - {"native"}, f"simulated xpu ran only native implementations: {registry.plan()}"
