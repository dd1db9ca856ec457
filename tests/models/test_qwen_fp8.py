"""FP8 weights for the Gated DeltaNet family (models/quant.py through qwen3_next.build): a bf16 /
fp32 checkpoint quantized on load (128 x 128 blocks), and the FP8 checkpoint it writes loaded
as published. FP8 here: the experts (routed and the stacked / separate shared one), the dense
MLP, the GDN output projection and the attention projections where their fused parts are whole
scale blocks; the GDN input projection stays in the model dtype (its b / a rows, one per value
head, are not whole blocks of the one fused matrix), as do router, norms, decay, embeddings and
the LM head. In fp32 the FP8 model equals its dequantized twin within round-off. A checkpoint in
transformers' published block-FP8 layout loads as well (codes kept where the model holds FP8).
"""
import json
import re

import pytest
import torch

import kernelgate
from helpers.fp8_xpu import check_simulated_xpu_fp8
from kernelgate import platform
from kernelgate.models import quant
from kernelgate.models.loader import load_model, save_checkpoint
from kernelgate.models.qwen3_next import build
from kernelgate.models.qwen3_next_config import tiny
from kernelgate.ops.common.compare import rel_err
from kernelgate.ops.quant import dequantize_fp8

FP8 = torch.float8_e4m3fn
IDS = torch.tensor([[5, 17, 30, 2, 41, 9, 63], [1, 2, 3, 4, 5, 6, 7]])
# 128-row parts where it matters (attention q 4 heads x 2 x 16, k / v 128; expert widths 128);
# hidden 192: a partial edge block along K
CFG = dict(hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64, moe_intermediate_size=128,
           intermediate_size=256, mlp_types=["moe", "dense", "moe", "moe"])


@pytest.fixture(scope="module", params=[128, 256], ids=["stacked-shared", "separate-shared"])
def ckpt(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen-fp8")
    save_checkpoint(build(tiny(**CFG, shared_expert_intermediate_size=request.param), dtype=torch.float32, seed=1),
                    folder)
    return folder


def twin_of(m8, folder):
    """The fp32 model with every FP8 weight of m8 replaced by its dequantized value."""
    twin = load_model(folder, dtype=torch.float32)
    mine, theirs = dict(m8.named_parameters()), dict(twin.named_parameters())
    with torch.no_grad():
        for n, (s, block) in quant.fp8_params(m8).items():
            theirs[n].copy_(dequantize_fp8(mine[n], s, block))
    return twin


def test_quantized_on_load_equals_its_dequantized_twin(ckpt):
    m8 = load_model(ckpt, dtype=torch.float32, quantization="fp8")
    p = dict(m8.named_parameters())
    for n in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
              "model.layers.0.mlp.shared_expert.gate_up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight",
              "model.layers.0.linear_attn.out_proj.weight", "model.layers.3.self_attn.q_proj.weight",
              "model.layers.3.self_attn.o_proj.weight"):
        assert p[n].dtype == FP8, n
    for n in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.mlp.gate.weight",
              "model.layers.0.linear_attn.A_log", "lm_head.weight", "model.embed_tokens.weight"):
        assert p[n].dtype == torch.float32, n
    twin = twin_of(m8, ckpt)
    assert rel_err(m8(IDS), twin(IDS)) < 1e-5
    prompts = [[5, 6, 7], list(range(10, 50))]
    assert [r.token_ids for r in kernelgate.generate(m8, prompts, max_new_tokens=6)] == \
        [r.token_ids for r in kernelgate.generate(twin, prompts, max_new_tokens=6)]


def test_fp8_checkpoint_round_trip_and_size(ckpt, tmp_path):
    def size(m):
        return sum(p.numel() * p.element_size() for p in m.parameters())
    bf16 = load_model(ckpt, dtype=torch.bfloat16)
    m8 = load_model(ckpt, dtype=torch.bfloat16, quantization="fp8")
    experts = [n for n, p in m8.named_parameters() if "experts." in n and p.dtype == FP8]
    assert experts and size(m8) < 0.75 * size(bf16)    # tiny: embeddings and LM head are a large share
    save_checkpoint(m8, tmp_path)                        # e4m3 codes + scales, quantization_config
    again = dict(load_model(tmp_path).named_parameters())
    for n, p in m8.named_parameters():
        assert p.dtype == again[n].dtype, n
        assert torch.equal(p.view(torch.uint8), again[n].view(torch.uint8)) if p.dtype == FP8 else \
            torch.equal(p, again[n]), n


@pytest.mark.skipif(not platform.interpreting(), reason="runs under TRITON_INTERPRET=1 only")
def test_simulated_xpu_runs_the_triton_fp8_kernels(ckpt):
    """fp8_linear's and fused_experts_fp8's Triton kernels on an XPU's dispatch (helpers/fp8_xpu.py)."""
    check_simulated_xpu_fp8(load_model(ckpt, dtype=torch.float32, quantization="fp8"), IDS[:1, :3])


BLOCK_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# what a published block-FP8 Qwen3-Next checkpoint quantizes: the projections (in_proj_qkvz / _ba fused
# and interleaved per key head, the attention and MLP projections, every expert's), not the router,
# the shared expert's gate, norms, decay, conv, embeddings or lm_head
PUBLISHED_FP8 = re.compile(r"\.(in_proj_qkvz|in_proj_ba|out_proj|[qkvo]_proj|gate_proj|up_proj|down_proj)\.weight$")


def test_published_layout_fp8_checkpoint_equals_its_dequantized_twin(tmp_path):
    """A Qwen3-Next checkpoint in transformers' layout with e4m3 weights + weight_scale_inv per
    128 x 128 block (scales powers of two, so the twin's weights re-quantize exactly): FP8 where the
    model can hold the codes (experts, attention projections), dequantized where it cannot (the fused
    GDN input projection, de-interleaved from in_proj_qkvz rows that split scale blocks); fp32 logits
    and greedy tokens equal to its dequantized twin's."""
    from helpers.qwen_hf import tiny_qwen3_next
    from safetensors.torch import load_file, save_file

    from kernelgate.ops.quant import quantize_fp8_block
    hf = tiny_qwen3_next(seed=4, hidden_size=128, head_dim=64, moe_intermediate_size=128,
                         shared_expert_intermediate_size=128)
    hf.save_pretrained(tmp_path / "src")
    tensors = {n: t.float() for n, t in load_file(str(tmp_path / "src" / "model.safetensors")).items()}
    ckpt, twin = {}, {}
    for n, t in tensors.items():
        if PUBLISHED_FP8.search(n):
            codes, s = quantize_fp8_block(t, (128, 128))
            s = torch.exp2(torch.round(torch.log2(s)))
            ckpt[n], ckpt[n + "_scale_inv"] = codes, s
            twin[n] = dequantize_fp8(codes, s, (128, 128))
        else:
            ckpt[n] = twin[n] = t
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    for name, tens, qc in (("fp8", ckpt, BLOCK_QC), ("twin", twin, None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})}))
        save_file({k: v.contiguous() for k, v in tens.items()}, str(tmp_path / name / "model.safetensors"))
    m8 = load_model(tmp_path / "fp8", dtype=torch.float32)
    p = dict(m8.named_parameters())
    assert p["model.layers.0.mlp.experts.gate_up_proj"].dtype == FP8
    assert p["model.layers.3.self_attn.q_proj.weight"].dtype == FP8
    assert p["model.layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.float32
    twin_model = load_model(tmp_path / "twin", dtype=torch.float32)
    assert rel_err(m8(IDS), twin_model(IDS)) < 1e-5
    prompts = [[5, 6, 7], list(range(10, 50))]
    assert [r.token_ids for r in kernelgate.generate(m8, prompts, max_new_tokens=6)] == \
        [r.token_ids for r in kernelgate.generate(twin_model, prompts, max_new_tokens=6)]
