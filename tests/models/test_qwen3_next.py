"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE text) vs HF transformers' own models, on
tiny checkpoints that transformers writes in the test: logits, greedy tokens through the
engine (chunked prefill, a prompt resumed from the prefix cache), bf16 loading, bad input."""
import json
import shutil
import warnings

import pytest
import torch
from helpers.qwen_hf import hf_greedy, tiny_qwen3_5_moe, tiny_qwen3_next

import kernelgate
from kernelgate import KernelgateError
from kernelgate.models.qwen3_next_config import Qwen3NextConfig
from kernelgate.tools.testing import rel_err

# fp32 parity at 1e-4 and greedy equality run on the CPU everywhere: on a GPU, fla's chunk kernels and
# Triton's tl.dot compute fp32 products in TF32 (~1e-3 off transformers' CPU fp32 there, Session 29).
# The bf16 tests load on the default device.
FP32_DEVICE = "cpu"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    models = {"next": tiny_qwen3_next(seed=0, mlp_only_layers=[1]),     # a dense MLP layer too
              "q35": tiny_qwen3_5_moe(seed=1, multimodal=True),
              "q35_text": tiny_qwen3_5_moe(seed=2, multimodal=False),
              # the shared expert as wide as a routed one: stacked with them into one fused_experts call
              "next_stacked": tiny_qwen3_next(seed=3, shared_expert_intermediate_size=32, norm_topk_prob=False)}
    for name, m in models.items():
        m.save_pretrained(root / name)
    models["next"].save_pretrained(root / "next_sharded", max_shard_size="100KB")   # index + shards
    ids = torch.randint(3, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    return {"models": models, "root": root, "ids": ids}


def _ref(hf, name, ids):
    with torch.no_grad():
        return hf["models"][name](input_ids=ids).logits


@pytest.mark.parametrize("name", ["next", "next_sharded", "q35", "q35_text", "next_stacked"])
def test_logits_match_hf(hf, name):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model = kernelgate.load_model(hf["root"] / name, device=FP32_DEVICE)
    skipped = [str(x.message) for x in w if "checkpoint-only" in str(x.message)]
    assert len(skipped) == (1 if name == "q35" else 0), skipped               # the vision tower, named once
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    assert model.model.layers[0].mlp.stacked == (name == "next_stacked")
    ref = _ref(hf, name.replace("_sharded", ""), hf["ids"])
    out = model(hf["ids"])                                   # B2-T65: crosses a 64-token chunk
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-4
    for T in (1, 63):
        assert rel_err(model(hf["ids"][:1, :T]), _ref(hf, name.replace("_sharded", ""), hf["ids"][:1, :T])) < 1e-4


def test_config_from_hf(hf):
    c = kernelgate.load_model(hf["root"] / "next").config
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert c.mlp_types == ["moe", "dense", "moe", "moe"] and c.rotary_dim == 4
    assert c.eos_token_ids == [2] and c.linear_num_value_heads == 4
    c = kernelgate.load_model(hf["root"] / "q35").config
    assert c.model_type == "qwen3_5_moe" and c.mlp_types == ["moe"] * 4 and c.intermediate_size is None


@pytest.mark.parametrize("name", ["next", "q35", "next_stacked"])
def test_greedy_matches_hf_chunked_and_resumed(hf, name):
    """Engine: prompts prefill in 16-token chunks; the second call's prompt extends the first
    one's and resumes from the prefix cache (blocks shared, GDN states restored)."""
    model = kernelgate.load_model(hf["root"] / name, device=FP32_DEVICE)
    ref = hf["models"][name]
    ids = hf["ids"]
    kw = {"max_new_tokens": 5, "stop_token_ids": (), "block_size": 8, "max_num_batched_tokens": 16, "max_model_len": 128,
              "max_num_seqs": 4}
    first = [ids[0, :40].tolist(), ids[1, :1].tolist(), ids[1, :19].tolist()]
    got = kernelgate.generate(model, first, **kw)
    for p, r in zip(first, got):
        assert r.token_ids == hf_greedy(ref, p, 5), f"prompt of {len(p)} tokens"
    again = ids[0, :40].tolist() + got[0].token_ids + ids[0, 40:46].tolist()
    r, = kernelgate.generate(model, [again], **kw)
    assert r.num_cached_tokens >= 32, r.num_cached_tokens
    assert r.token_ids == hf_greedy(ref, again, 5)


def test_bf16_keeps_router_and_decay_fp32(hf):
    model = kernelgate.load_model(hf["root"] / "next", dtype="bfloat16")
    layer = model.model.layers[0]
    assert model.dtype == torch.bfloat16 and layer.linear_attn.in_proj_qkv.weight.dtype == torch.bfloat16
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert layer.linear_attn.A_log.dtype == torch.float32 and layer.linear_attn.dt_bias.dtype == torch.float32
    out = model(hf["ids"][:, :17])
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), _ref(hf, "next", hf["ids"][:, :17])) < 5e-2


def test_unknown_model_type(hf, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf["root"] / "next", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(KernelgateError, match="model_type 'llama'.*not supported.*kimi_linear.*qwen3_next") as e:
        kernelgate.load_model(bad)
    assert "\n" not in str(e.value)


def test_mtp_tensors_skipped_and_named(hf, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "mtp"
    shutil.copytree(hf["root"] / "next", folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"skips 2 checkpoint-only tensors.*mtp\.\*"):
        kernelgate.load_model(folder)


@pytest.mark.parametrize("bad, field", [
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple of linear_num_key_heads"),
    ({"partial_rotary_factor": 0.01}, "partial_rotary_factor"),
    ({"layer_types": ["linear_attention", "mamba"], "num_hidden_layers": 2}, "layer_types"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts_per_token": 9}, "num_experts_per_tok 9 > num_experts"),
])
def test_bad_config_one_line(bad, field):
    from kernelgate.models.qwen3_next_config import tiny
    with pytest.raises(KernelgateError, match=field) as e:
        tiny(**bad)
    assert "\n" not in str(e.value)


def test_config_reads_old_style_rope_and_interval():
    c = Qwen3NextConfig.from_dict({"model_type": "qwen3_next", "num_hidden_layers": 8, "full_attention_interval": 4,
                                   "rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_scaling": None})
    assert c.layer_types.count("full_attention") == 2 and c.rope_theta == 1e7
    with pytest.raises(KernelgateError, match="rope_type 'yarn' is not supported"):
        Qwen3NextConfig.from_dict({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})


def test_simulated_xpu_matches_hf(hf):
    """The portable Triton kernels (GDN prefill / packed decode, short conv, paged attention,
    routing, experts, norms) on the XPU dispatch path, under the interpreter."""
    from kernelgate import platform, registry
    if not platform.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (as in CI) so XPU's Triton kernels run on CPU")
    model = kernelgate.load_model(hf["root"] / "next", device=FP32_DEVICE)
    registry._plan.clear()
    ids = hf["ids"]
    with platform.simulate("xpu"):
        out = model(ids[:1, :9])
        got = kernelgate.generate(model, [ids[0, :5].tolist()], max_new_tokens=2, stop_token_ids=())
    assert rel_err(out, _ref(hf, "next", ids[:1, :9])) < 1e-4
    assert got[0].token_ids == hf_greedy(hf["models"]["next"], ids[0, :5].tolist(), 2)
    used = {op: impls for op, impls in registry.plan().items() if set(impls) - {"native"}}
    assert {"gdn_prefill", "gdn_packed_decode", "paged_attention_decode"} <= set(used), registry.plan()
