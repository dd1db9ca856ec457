"""FP8 weights in the model (models/quant.py, models/quant_load.py).

Checkpoints are written as published ones look: released tensor names (q / k / v, per-expert
w1 / w2 / w3, gate / up), e4m3 codes + scales from the ops/quant helpers, config.json's
quantization_config. Their scales are rounded to powers of two, so that the dequantized twin
(codes x scale, exact in bf16 and fp32) quantizes back to the very same codes and scales: every
block's largest code stays 448 and 448 * 2^k / 448 is exact.

The config is small but real-shaped where it matters: 128-row parts (q / k / v, f_a, g_a, gate / up
of width 128 per rank at tensor parallel 2), partial edge blocks (hidden 192, b_proj's 2 rows,
kv_a's 96), one KDA + dense and one MLA + MoE layer (shared expert stacked with the routed ones).
"""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import kernelgate
from helpers.fp8_xpu import check_simulated_xpu_fp8
from kernelgate import KernelgateError, platform
from kernelgate.models import build, quant, quant_load, tiny
from kernelgate.models.loader import load_model, save_checkpoint
from kernelgate.models.parallel import Parallel, shard_specs
from kernelgate.ops.common.compare import rel_err
from kernelgate.ops.quant import dequantize_fp8, quantize_fp8_block, quantize_fp8_channel

FP8 = torch.float8_e4m3fn
CFG = dict(vocab_size=64, hidden_size=192, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2,
           layer_types=["kda", "mla"], mlp_types=["dense", "moe"], linear_num_heads=2, linear_head_dim=128,
           num_attention_heads=2, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, kv_lora_rank=64,
           num_experts=4, num_experts_per_token=2)
BLOCK_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CT_IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*kv_a_proj_with_mqa$"]
CT_QC = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
         "ignore": CT_IGNORE, "config_groups": {"group_0": {
             "targets": ["Linear"], "output_activations": None,
             "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                   "dynamic": True}}}}
PROJ = re.compile(r"(_proj|_proj_with_mqa|\.w[123])\.weight$")
IDS = torch.tensor([[5, 17, 30, 2, 41, 9, 63], [1, 2, 3, 4, 5, 6, 7]])


def released(model) -> dict:
    """A model's tensors under the released checkpoint names (fp32)."""
    out = {}
    for n, p in model.named_parameters():
        p = p.detach().float()
        if n.endswith("qkv_proj.weight"):
            out.update({n.replace("qkv_proj", f"{x}_proj"): t for x, t in zip("qkv", p.chunk(3))})
        elif n.endswith("gate_up_proj.weight"):
            out.update({n.replace("gate_up_proj", x): t for x, t in zip(("gate_proj", "up_proj"), p.chunk(2))})
        elif n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj"):
            base = n[:n.rindex(".") + 1].replace(".mlp.", ".block_sparse_moe.")
            for e in range(p.shape[0]):
                parts = p[e].chunk(2) if n.endswith("gate_up_proj") else [p[e]]
                out.update({f"{base}{e}.w{w}.weight": t for w, t in zip((1, 3) if len(parts) == 2 else (2,), parts)})
        else:
            out[n] = p
    return out


def quantized(tensors: dict, block, suffix: str, ignore=()) -> tuple[dict, dict]:
    """(FP8 checkpoint tensors, their dequantized twin): every projection but lm_head and `ignore`."""
    ckpt, twin = {}, {}
    for n, t in tensors.items():
        if PROJ.search(n) and not any(re.match(p[3:], n[:-7]) for p in ignore if p.startswith("re:")):
            codes, s = quantize_fp8_block(t, block) if block else quantize_fp8_channel(t)
            s = torch.exp2(torch.round(torch.log2(s)))          # see the module docstring
            ckpt[n], ckpt[n + suffix] = codes, s
            twin[n] = dequantize_fp8(codes, s, block)
        else:
            ckpt[n] = twin[n] = t
    return ckpt, twin


def write(folder, config, tensors: dict, qc=None):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**config.to_checkpoint(), "dtype": "bfloat16"}
    if qc is not None:
        cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    config = tiny(**CFG)
    src = released(build(config, dtype=torch.float32, seed=3))
    block, twin = quantized(src, (128, 128), "_scale_inv")
    chan, chan_twin = quantized(src, None, "_scale", CT_IGNORE)
    return {"config": config, "src": src, "block": write(root / "block", config, block, BLOCK_QC),
            "twin": write(root / "twin", config, twin), "ct": write(root / "ct", config, chan, CT_QC),
            "ct_twin": write(root / "ct_twin", config, chan_twin)}


def params(model) -> dict:
    return dict(model.named_parameters())


def test_block_checkpoint_loads_fp8_and_equals_its_dequantized_twin(ckpts):
    m = load_model(ckpts["block"], dtype=torch.float32)
    p = params(m)
    for n in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.b_proj.weight",
              "model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.self_attn.q_proj.weight",
              "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.shared_experts.down_proj.weight"):
        assert p[n].dtype == FP8, n
    assert p["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 4, 2)
    # kept as they are: router, decay, norms, embeddings, lm_head; dequantized where the checkpoint
    # has codes: MLA's kv_b (read as a tensor), KDA's f_b / g_b (one batched matmul, 1 MB each)
    kept = ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.f_b_proj.weight",
            "model.layers.0.self_attn.g_b_proj.weight")
    for n in ("model.layers.1.mlp.gate.weight", "model.layers.0.self_attn.A_log", "lm_head.weight",
              "model.embed_tokens.weight", *kept):
        assert p[n].dtype == torch.float32, n
    twin = load_model(ckpts["twin"], dtype=torch.float32)
    for n in kept:
        assert torch.equal(p[n], params(twin)[n]), n
    assert rel_err(m(IDS), twin(IDS)) < 1e-5


def test_on_load_quantization_of_the_twin_gives_the_same_fp8_model(ckpts, monkeypatch):
    """Bit-equal codes and scales, quantized a slab at a time (a small slab here: 4 slabs per
    stacked expert tensor), never a whole bf16 tensor beside the FP8 one."""
    published = load_model(ckpts["block"], dtype=torch.bfloat16)
    monkeypatch.setattr(quant, "_CHUNK", 128 * 192 * 4)
    seen = []
    real = quant_load.quantize
    monkeypatch.setattr(quant_load, "quantize", lambda w, b: seen.append(w.numel()) or real(w, b))
    ours = load_model(ckpts["twin"], dtype=torch.bfloat16, quantization="fp8")
    assert max(seen) <= 128 * 192 * 2 and len(seen) > 30
    a, b = params(published), params(ours)
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype, n
        x, y = (a[n].view(torch.uint8), b[n].view(torch.uint8)) if a[n].dtype == FP8 else (a[n], b[n])
        assert torch.equal(x, y), n


def test_bf16_checkpoint_quantized_on_load_is_at_most_0_6x_the_bytes(tmp_path):
    save_checkpoint(build(tiny(**CFG), dtype=torch.bfloat16, seed=1), tmp_path)

    def size(m):
        return sum(p.numel() * p.element_size() for p in m.parameters())
    bf16, fp8 = load_model(tmp_path), load_model(tmp_path, quantization="fp8")
    assert fp8.dtype == torch.bfloat16 and size(fp8) <= 0.6 * size(bf16)
    # written back, it is a block FP8 checkpoint that loads as published
    save_checkpoint(fp8, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"] == BLOCK_QC
    again = params(load_model(tmp_path / "again"))
    assert all(torch.equal(p.view(torch.uint8), again[n].view(torch.uint8)) if p.dtype == FP8 else
               torch.equal(p, again[n]) for n, p in fp8.named_parameters())


def test_compressed_tensors_checkpoint_matches_its_dequantized_twin(ckpts):
    m = load_model(ckpts["ct"], dtype=torch.float32)
    p = params(m)
    assert p["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    assert p["model.layers.0.self_attn.qkv_proj.weight_scale"].shape == (768, 1)
    assert p["model.layers.1.mlp.experts.down_proj_scale"].shape == (4, 192, 1)
    # kv_a is on the ignore list (stored unquantized): q_proj, fused with it, is dequantized too
    for n in ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert p[n].dtype == torch.float32, n
    assert rel_err(m(IDS), load_model(ckpts["ct_twin"], dtype=torch.float32)(IDS)) < 1e-5


def _edited(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


Q = "model.layers.0.self_attn.q_proj.weight"
W2 = "model.layers.1.block_sparse_moe.experts.1.w2.weight"


def _nan(t):
    t[W2 + "_scale_inv"][1, 0] = float("nan")


@pytest.mark.parametrize("tensors,config,message", [
    (lambda t: t.pop(Q + "_scale_inv"), None, f"{Q} is float8_e4m3fn but its scale {Q}_scale_inv is missing"),
    (lambda t: t.__setitem__(Q + "_scale_inv", torch.ones(2, 1)), None,
     f"{Q}_scale_inv shape (2, 1) != (2, 2) (block [128, 128] scales of {Q} (256, 192))"),
    (_nan, None, "scale model.layers.1.mlp.experts.1.w2.weight_scale_inv[1, 0] = nan is not finite (1 of 4)"),
    (None, lambda c: c.pop("quantization_config"), f"{Q} is float8_e4m3fn but config.json has no quantization_config"),
    (None, lambda c: c["quantization_config"].update(modules_to_not_convert=["self_attn.q_proj"]),
     "ignore list keeps model.layers.0.self_attn.q_proj unquantized ('self_attn.q_proj')"),
    (None, lambda c: c["quantization_config"].update(weight_block_size=[128]),
     "quantization_config weight_block_size must be two ints > 0, got [128]"),
], ids=["missing", "shape", "nan", "no-config", "ignored", "bad-block"])
def test_malformed_fp8_checkpoint_is_one_line_naming_the_tensor(ckpts, tmp_path, tensors, config, message):
    folder = _edited(ckpts["block"], tmp_path / "bad", tensors, config)
    with pytest.raises(KernelgateError) as e:
        load_model(folder)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_unknown_quantization_is_one_line(ckpts, capsys):
    with pytest.raises(KernelgateError, match=r"^load_model: quantization 'int4' is not one of: fp8"):
        kernelgate.load_model(ckpts["twin"], quantization="int4")
    from kernelgate import cli
    assert cli.main(["run", "--quantization", "int4"]) == 2
    err = capsys.readouterr().err
    assert "argument --quantization: 'int4' is not one of fp8" in err and err.count("\n") == 1


def test_generate_on_the_fp8_model_gives_the_twins_tokens(ckpts):
    m, twin = load_model(ckpts["block"], dtype=torch.float32), load_model(ckpts["twin"], dtype=torch.float32)
    prompts = [[5, 17, 30, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    got = [r.token_ids for r in kernelgate.generate(m, prompts, max_new_tokens=5, stop_token_ids=())]
    want = [r.token_ids for r in kernelgate.generate(twin, prompts, max_new_tokens=5, stop_token_ids=())]
    kernelgate.release(m)
    kernelgate.release(twin)
    assert got == want and all(len(t) == 5 for t in got)


@pytest.mark.skipif(not platform.interpreting(), reason="runs under TRITON_INTERPRET=1 only")
def test_simulated_xpu_runs_the_triton_fp8_kernels(ckpts):
    """fp8_linear's and fused_experts_fp8's Triton kernels on an XPU's dispatch (helpers/fp8_xpu.py)."""
    check_simulated_xpu_fp8(load_model(ckpts["block"], dtype=torch.float32), IDS[:1, :3])


def test_tensor_parallel_shards_hold_their_codes_and_scales(ckpts):
    """Each rank of 2 holds its slices of the published codes and scales: dequantized, exactly the
    slices of the whole model's weights. Where a part would split a scale block between a fused
    matrix's members (MLA's q rows: 64 per rank), that matrix loads dequantized."""
    full = load_model(ckpts["block"], dtype=torch.float32)
    fp8 = quant.fp8_params(full)

    def value(model, n, p):
        s = quant.fp8_params(model).get(n)
        return dequantize_fp8(p, *s) if s else p
    scales = quant.fp8_tensors(full)[1]
    dense = {n: value(full, n, p) for n, p in full.named_parameters() if n not in scales}
    for r in range(2):
        shard = load_model(ckpts["block"], dtype=torch.float32, par=Parallel(r, 2))
        specs, mine = shard_specs(shard), quant.fp8_params(shard)
        assert "model.layers.0.self_attn.qkv_proj.weight" in mine and "model.layers.1.mlp.experts.down_proj" in mine
        assert "model.layers.1.self_attn.q_proj.weight" in fp8 and "model.layers.1.self_attn.q_proj.weight" not in mine
        for n, p in shard.named_parameters():
            if n not in dense:      # a scale
                continue
            want = dense[n]
            if n in specs:
                dim, segments = specs[n]
                want = torch.cat([s.chunk(2, dim)[r] for s in want.chunk(segments, dim)], dim)
            assert torch.equal(value(shard, n, p), want), n


def test_tensor_parallel_quantize_on_load_reads_its_slabs(ckpts, tmp_path, monkeypatch):
    """Quantized on load per rank from stacked tensors (save_checkpoint's layout: experts [E, 2I, D]),
    a few experts of this rank's rows at a time: where a rank's parts fill whole blocks (all but
    b_proj's single rows and MLA's 32-column o_proj: quantized per rank), the same codes and scales
    as the whole model quantized, sliced."""
    save_checkpoint(load_model(ckpts["twin"], dtype=torch.float32), tmp_path)
    full = load_model(tmp_path, quantization="fp8")
    monkeypatch.setattr(quant, "_CHUNK", 2 * 128 * 192 * 4)     # 2 experts of a rank's 128 gate rows
    fp8 = quant.fp8_params(full)
    for r in range(2):
        shard = load_model(tmp_path, quantization="fp8", par=Parallel(r, 2))
        specs, mine, p = shard_specs(shard), quant.fp8_params(shard), params(full)
        assert "model.layers.1.mlp.experts.gate_up_proj" in mine
        for n, (s, block) in mine.items():
            if "b_proj" in n or n == "model.layers.1.self_attn.o_proj.weight":
                continue
            want = dequantize_fp8(p[n], *fp8[n])
            dim, segments = specs[n] if n in specs else (0, 1)
            if n in specs:
                want = torch.cat([x.chunk(2, dim)[r] for x in want.chunk(segments, dim)], dim)
            assert torch.equal(dequantize_fp8(params(shard)[n], s, block), want), n
