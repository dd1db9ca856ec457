"""FP8 weights for the Gated DeltaNet family (models/quant.py through qwen3_next.build): a bf16 /
fp32 checkpoint quantized on load (128 x 128 blocks), and the FP8 checkpoint it writes loaded
as published. FP8 here: the experts (routed and the stacked / separate shared one), the dense
MLP, the GDN output projection and the attention projections where their fused parts are whole
scale blocks; the GDN input projection stays in the model dtype (its b / a rows, one per value
head, are not whole blocks of the one fused matrix), as do router, norms, decay, embeddings and
the LM head. In fp32 the FP8 model equals its dequantized twin within round-off.
"""
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
