"""Checkpoint config parsing (both spellings) and loader errors: missing, unexpected and
mis-shaped tensors are all named in one KernelgateError."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kernelgate
from kernelgate import KernelgateError
from kernelgate.models import KimiLinearConfig
from helpers.kimi_hf import TINY, hf_kimi_module, tiny_hf_model

# The fields of a released Kimi-Linear config.json (48B-A3B), with 1-indexed layer lists.
RELEASED = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "moe_intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 32,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446,
    "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "rms_norm_eps": 1e-5, "eos_token_id": 163586, "torch_dtype": "bfloat16",
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8],
                           "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
}


def test_config_released_names():
    c = KimiLinearConfig.from_dict(RELEASED)
    assert c.layer_types == ["kda", "kda", "kda", "mla"] * 2
    assert c.mlp_types == ["dense"] + ["moe"] * 7
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts, c.n_group) == (256, 8, 1, 1)
    assert (c.linear_num_heads, c.linear_head_dim, c.conv_kernel_size) == (32, 128, 4)
    assert c.qk_head_dim == 192 and c.q_lora_rank is None and c.eos_token_ids == [163586]
    assert c.dtype == "bfloat16" and c.scoring == "sigmoid"


def test_config_hf_names():
    d = {"num_hidden_layers": 3, "num_local_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 2,
         "n_group": 4, "norm_topk_prob": False, "linear_num_heads": 2, "linear_head_dim": 60,
         "linear_conv_kernel_dim": 3, "layer_types": ["full_attention", "linear_attention", "linear_attention"],
         "mlp_layer_types": ["sparse", "dense", "sparse"], "eos_token_id": [5, 6]}
    c = KimiLinearConfig.from_dict(d)
    assert c.layer_types == ["mla", "kda", "kda"] and c.mlp_types == ["moe", "dense", "moe"]
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts, c.n_group) == (16, 4, 2, 4)
    assert c.moe_renormalize is False and (c.linear_num_heads, c.linear_head_dim, c.conv_kernel_size) == (2, 60, 3)
    assert c.eos_token_ids == [5, 6]


def test_config_bad_layer_list():
    bad = {**RELEASED, "linear_attn_config": {**RELEASED["linear_attn_config"], "full_attn_layers": [4]}}
    with pytest.raises(KernelgateError, match="layer_types"):
        KimiLinearConfig.from_dict(bad)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    tiny_hf_model(seed=3).save_pretrained(root)
    return root


def _edited(src, dst, edit):
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_unexpected_misshaped_all_reported(ckpt, tmp_path):
    def edit(t):
        del t["model.layers.1.self_attn.k_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.0.extra.weight"] = torch.zeros(3)
        t["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(7, 32)
    folder = _edited(ckpt, tmp_path / "bad", edit)
    with pytest.raises(KernelgateError) as e:
        kernelgate.load_model(folder)
    msg = str(e.value)
    assert "missing (2)" in msg and "qkv_proj.weight (needs model.layers.1.self_attn.k_proj.weight)" in msg and "model.norm.weight" in msg
    assert "unexpected (1)" in msg and "model.layers.0.extra.weight" in msg
    assert "mis-shaped (1)" in msg and "kv_b_proj.weight: checkpoint (7, 32) != model (128, 32)" in msg


def test_missing_expert(ckpt, tmp_path):
    folder = _edited(ckpt, tmp_path / "noexp", lambda t: t.pop("model.layers.2.block_sparse_moe.experts.5.w3.weight"))
    with pytest.raises(KernelgateError) as e:
        kernelgate.load_model(folder)
    assert "missing (1): model.layers.2.mlp.experts.gate_up_proj (needs model.layers.2.mlp.experts.5.w3.weight)" \
        in str(e.value) and "unexpected" not in str(e.value)


def test_missing_shard_and_files(ckpt, tmp_path):
    with pytest.raises(KernelgateError, match="not a folder"):
        kernelgate.load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KernelgateError, match="no config.json"):
        kernelgate.load_model(tmp_path / "empty")
    shutil.copy(ckpt / "config.json", tmp_path / "empty" / "config.json")
    with pytest.raises(KernelgateError, match="no \\*.safetensors"):
        kernelgate.load_model(tmp_path / "empty")
    index = {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "empty" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KernelgateError, match="shard model-00001-of-00002.safetensors"):
        kernelgate.load_model(tmp_path / "empty")


def test_dtype_argument(ckpt):
    with pytest.raises(KernelgateError, match="dtype 'int8'"):
        kernelgate.load_model(ckpt, dtype="int8")
    m = kernelgate.load_model(ckpt, dtype=torch.float16)
    assert m.dtype == torch.float16 and m.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float16


_CHILD = r"""
import json, sys, torch
import kernelgate, kernelgate.models, kernelgate.ops
kernelgate.models.build(kernelgate.models.tiny(), seed=None)   # lazy imports (meta init: ~170 MB) first
kernelgate.platform.default_device()   # and the platform probe (imports triton: ~100 MB)
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
before = rss("VmRSS:")
m = kernelgate.load_model(sys.argv[1])
weights = sum(p.numel() * p.element_size() for p in m.parameters())
print(json.dumps({"before": before, "peak": rss("VmHWM:"), "weights": weights}))
"""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs /proc")
def test_host_memory_stays_at_weights_plus_one_tensor(tmp_path):
    """A ~55 MB checkpoint written by HF save_pretrained (per-expert tensors of 256 KB), loaded on
    the CPU in a child process: its resident memory grows by the model's own weights plus at most
    the largest tensor and 24 MiB (no mmap of the files, no fp32 or stacked copies on the host)."""
    import subprocess
    import sys

    from safetensors import safe_open
    from transformers import KimiLinearConfig as HFConfig
    with torch.device("meta"):   # HF's own weight init is slow and beside the point here
        hf = hf_kimi_module().KimiLinearForCausalLM(HFConfig(**{
            **TINY, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
            "num_local_experts": 32}))
    hf = hf.to_empty(device="cpu")
    with torch.no_grad():
        for p in (*hf.parameters(), *hf.buffers()):
            p.normal_() if p.is_floating_point() else p.zero_()
    hf.save_pretrained(tmp_path, max_shard_size="20MB")
    largest, total = 0, 0
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                n = torch.Size(s.get_shape()).numel() * 4
                largest, total = max(largest, n), total + n
    del hf
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True,
                         cwd=str(__import__("pathlib").Path(kernelgate.__file__).parents[1]), check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert total > 45e6 and r["weights"] > 0.95 * total
    grew = r["peak"] - r["before"]
    assert grew <= r["weights"] + largest + (24 << 20), (grew, r, largest)


def test_fused_projections_are_views_of_one_matrix(tmp_path):
    """A layer's projections of x are one matrix (one matmul), each parameter a view of it: the
    loader fills the views, a checkpoint names them one by one and never the matrix."""
    from kernelgate.models import build, tiny
    from kernelgate.models.loader import save_checkpoint
    src = build(tiny(vocab_size=64), seed=3)
    save_checkpoint(src, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert not any(n.endswith(("self_attn.in_proj", "self_attn.up_proj")) for n in names) and names
    m = kernelgate.load_model(tmp_path)
    kda = next(layer.self_attn for layer in m.model.layers if hasattr(layer.self_attn, "qkv_proj"))
    mla = next(layer.self_attn for layer in m.model.layers if hasattr(layer.self_attn, "kv_a_proj_with_mqa"))
    for mod, fused, parts in ((kda, kda.in_proj, ("qkv_proj", "f_a_proj", "g_a_proj", "b_proj")),
                              (kda, kda.up_proj, ("f_b_proj", "g_b_proj")),
                              (mla, mla.in_proj, (mla.q_in, "kv_a_proj_with_mqa"))):
        ws = [getattr(mod, p).weight for p in parts]
        assert all(w.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for w in ws)
        assert torch.equal(fused, torch.cat(ws)) and fused.shape[0] == sum(w.shape[0] for w in ws)
    ref = dict(src.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in m.named_parameters())
    # one allocation per fused matrix: the parameters' bytes are the model's, no copy beside them
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in src.parameters())


# Every field of KimiLinearConfig away from its default (hidden_act: 'silu' is the only one supported).
NON_DEFAULT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, num_attention_heads=2, kv_lora_rank=16,
                   q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, linear_num_heads=2,
                   linear_head_dim=8, conv_kernel_size=3, num_experts=6, num_experts_per_token=3,
                   num_shared_experts=2, n_group=3, topk_group=2, moe_renormalize=False, routed_scaling_factor=1.5,
                   scoring="softmax", layer_types=["mla", "kda", "kda"], mlp_types=["moe", "dense", "moe"],
                   bos_token_id=1, eos_token_ids=[5, 7], dtype="bfloat16")


def test_non_default_config_covers_every_field():
    import dataclasses
    for f in dataclasses.fields(KimiLinearConfig):
        if f.name == "hidden_act":
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert f.name in NON_DEFAULT and NON_DEFAULT[f.name] != default, f.name


def test_save_load_round_trips_every_config_field(tmp_path):
    from kernelgate.models import build
    from kernelgate.models.loader import save_checkpoint
    c = KimiLinearConfig(**NON_DEFAULT)
    assert KimiLinearConfig.from_dict(json.loads(json.dumps(c.to_checkpoint()))) == c
    src = build(c, dtype=torch.bfloat16, seed=4)
    save_checkpoint(src, tmp_path)
    m = kernelgate.load_model(tmp_path)
    assert m.config == c and m.dtype == torch.bfloat16
    ref = dict(src.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in m.named_parameters())


@pytest.mark.parametrize("edit,message", [
    ({"num_hidden_layers": 100_000}, "num_hidden_layers 100000; the checkpoint .* holds layers 0..3 \\(4 of them\\)"),
    ({"hidden_size": 1 << 20}, "model.embed_tokens.weight: checkpoint \\(256, 64\\) != config \\(256, 1048576\\)"),
    ({"num_local_experts": 1 << 16, "num_experts": 1 << 16}, "model.layers.1.mlp.gate.weight: checkpoint \\(8, 64\\) != config \\(65536, 64\\)"),
    ({"v_head_dim": 1 << 20}, "mis-shaped .*o_proj.weight: checkpoint \\(64, 64\\) != model \\(64, 4194304\\)"),
], ids=["layers", "hidden", "experts", "v-head-dim"])
def test_config_checked_against_headers_before_allocation(ckpt, tmp_path, monkeypatch, edit, message):
    """A config.json whose sizes do not match the tensors fails in well under a second, before
    any parameter is allocated (only meta-device models are built)."""
    import time

    from kernelgate.models import loader
    folder = tmp_path / "big"
    folder.mkdir()
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(edit)
    for key in ("layer_types", "mlp_layer_types", "linear_attn_config"):   # the default per-layer patterns
        cfg.pop(key, None)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    built = []
    real_build = loader.build
    monkeypatch.setattr(loader, "build", lambda c, device=None, **kw: built.append(str(device)) or real_build(c, device, **kw))
    t0 = time.perf_counter()
    with pytest.raises(KernelgateError, match=message):
        kernelgate.load_model(folder)
    assert time.perf_counter() - t0 < 2.0
    assert set(built) <= {"meta"}


def test_config_upper_bounds():
    with pytest.raises(KernelgateError, match=r"num_hidden_layers must be an int in \[1, 100000\], got int 1000000000"):
        KimiLinearConfig.from_dict({**RELEASED, "num_hidden_layers": 10**9})
    with pytest.raises(KernelgateError, match=r"hidden_size must be an int in \[1, 2147483647\]"):
        KimiLinearConfig.from_dict({**RELEASED, "hidden_size": 2**40})
