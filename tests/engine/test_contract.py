"""The engine's edges answer bad input with one clear line naming the argument (issue 20):
generate(), Engine, SamplingParams, config reading and load_model. Types are checked, not
coerced. Also: non-finite logits end only the affected request, with finish_reason "error"
and a logged line, never a token 0."""
import json
import logging
import shutil

import pytest
import torch

import kernelgate
from kernelgate import KernelgateError
from kernelgate.engine import Engine, SamplingParams
from kernelgate.models import KimiLinearConfig, build, tiny
from helpers.kimi_hf import TINY, tiny_hf_model


@pytest.fixture(scope="module")
def model():
    return build(tiny(vocab_size=64), seed=3)


def _one_line(e):
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), "prompts must be a non-empty list"),
    (dict(max_batch=2), r"unknown argument\(s\) max_batch \(engine settings: max_num_seqs, "),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an int, got float 2.0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int, got bool"),
    (dict(top_k=1.0), "top_k must be an int, got float"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="1"), "temperature must be a finite number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(seed=2**64), "seed must be <= 18446744073709551615"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of int token ids, got 5"),
    (dict(stop_token_ids=["2"]), "stop_token_ids must be a list of int token ids"),
    (dict(prompts=[[1.0, 2.0]]), "token ids must be ints, got float 1.0"),
    (dict(prompts=[[1, 64]]), r"token ids outside \[0, 64\)"),
    (dict(prompts=[torch.tensor([1.0, 2.0])]), "prompt tensor must be 1-D integer"),
    (dict(max_model_len=4), "exceeds max_model_len 4"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization must be > 0.0"),
    (dict(block_size="64"), "block_size must be an int, got str"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_generate_arguments(model, kwargs, match):
    kw = dict(prompts=[[1, 2, 3]], max_new_tokens=2)
    kw.update(kwargs)
    with pytest.raises(KernelgateError, match=match) as e:
        kernelgate.generate(model, kw.pop("prompts"), **kw)
    _one_line(e)


def test_engine_arguments(model):
    eng = Engine(model, max_model_len=32, block_size=8)
    eng.add_request("a", [1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(KernelgateError, match="request id 'a' is already running") as e:
        eng.add_request("a", [3], SamplingParams(max_new_tokens=2))
    _one_line(e)
    with pytest.raises(KernelgateError, match="request_id must be a non-empty str, got 7"):
        eng.add_request(7, [3], SamplingParams())
    with pytest.raises(KernelgateError, match="params must be a SamplingParams, got dict"):
        eng.add_request("b", [3], {"max_new_tokens": 2})
    with pytest.raises(KernelgateError, match="has an empty prompt"):
        eng.add_request("b", [], SamplingParams())
    with pytest.raises(KernelgateError, match="graphs must be a bool"):
        Engine(model, graphs="no")
    with pytest.raises(KernelgateError, match="async_scheduling must be a bool"):
        Engine(model, async_scheduling=1)
    eng.abort("a")
    outs = eng.step()                  # the abort is reported once, then the request is gone
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "abort")]
    assert not eng.has_unfinished() and eng.step() == [] and eng.blocks.free_slots == 16


def test_non_finite_logits_end_only_that_request(caplog):
    m = build(tiny(vocab_size=64), seed=3)
    ref = kernelgate.generate(m, [[5, 6, 7]], max_new_tokens=4, stop_token_ids=())[0].token_ids
    with torch.no_grad():
        m.model.embed_tokens.weight[9] = float("nan")          # any sequence holding token 9 goes NaN
    with caplog.at_level(logging.ERROR, logger="kernelgate.engine"):
        out = kernelgate.generate(m, [[5, 6, 7], [1, 9, 2]], max_new_tokens=4, stop_token_ids=())
    assert out[0].token_ids == ref and out[0].finish_reason == "length"
    assert out[1].finish_reason == "error" and out[1].token_ids == [] and "non-finite logits" in out[1].error
    assert any("non-finite logits" in r.message for r in caplog.records)


RELEASED = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16, "v_head_dim": 16, "num_experts": 8, "num_experts_per_token": 2,
            "eos_token_id": 2}


@pytest.mark.parametrize("edit, match", [
    ({"eos_token_id": "2"}, "eos_token_id must be int token ids"),
    ({"eos_token_id": 99}, r"eos_token_id must be int token ids in \[0, 64\)"),
    ({"hidden_size": "64"}, r"hidden_size must be an int in \[1, 2147483647\], got str '64'"),
    ({"num_hidden_layers": 4.0}, r"num_hidden_layers must be an int in \[1, 100000\], got float 4.0"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a positive number, got str"),
    ({"vocab_size": -5}, r"vocab_size must be an int in \[1, 2147483647\], got int -5"),
    ({"num_experts_per_token": 99}, "num_experts_per_token 99 > num_experts 8"),
    ({"moe_router_activation_func": "relu"}, "moe_router_activation_func 'relu' not in"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true / false"),
    ({"linear_attn_config": {"kda_layers": [1, 2, 9], "full_attn_layers": [4]}}, "entry 9 is not a layer number"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_config_values(edit, match):
    KimiLinearConfig.from_dict(RELEASED)
    with pytest.raises(KernelgateError, match=match) as e:
        KimiLinearConfig.from_dict({**RELEASED, **edit})
    _one_line(e)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    tiny_hf_model(seed=2).save_pretrained(root)
    return root


def _copy(ckpt, dst):
    shutil.copytree(ckpt, dst)
    return dst


def test_config_files(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path / "notjson")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(KernelgateError, match="config.json is not JSON") as e:
        kernelgate.load_model(bad)
    _one_line(e)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(KernelgateError, match="must hold a JSON object, got list"):
        kernelgate.load_model(bad)


def test_checkpoint_files(ckpt, tmp_path):
    st = "model.safetensors"
    size = (ckpt / st).stat().st_size
    cases = {
        "truncated": (lambda p: p.write_bytes((ckpt / st).read_bytes()[:size - 100]), "truncated safetensors file"),
        "zero-byte": (lambda p: p.write_bytes(b""), r"truncated safetensors file \(0 bytes, no header\)"),
        "corrupt-header": (lambda p: p.write_bytes((ckpt / st).read_bytes()[:8] + b"#" * 50
                                                   + (ckpt / st).read_bytes()[58:]), "corrupt safetensors header"),
        "huge-header": (lambda p: p.write_bytes((10**12).to_bytes(8, "little") + b"{}"), "corrupt or truncated"),
    }
    for name, (write, match) in cases.items():
        folder = _copy(ckpt, tmp_path / name)
        write(folder / st)
        with pytest.raises(KernelgateError, match=match) as e:
            kernelgate.load_model(folder)
        assert st in _one_line(e), name
    folder = _copy(ckpt, tmp_path / "index")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(KernelgateError, match="has no weight_map object") as e:
        kernelgate.load_model(folder)
    _one_line(e)


def test_integer_tensor_for_float_parameter(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = _copy(ckpt, tmp_path / "int")
    t = load_file(folder / "model.safetensors")
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)
    save_file(t, folder / "model.safetensors")
    with pytest.raises(KernelgateError, match="wrong dtype.*model.norm.weight: checkpoint int32 for a floating point"):
        kernelgate.load_model(folder)


def test_tiny_config_is_hf_compatible():
    assert TINY["num_experts_per_tok"] == 2      # the checkpoints above come from this config


def test_load_model_arguments(ckpt):
    with pytest.raises(KernelgateError, match="path must be a folder path"):
        kernelgate.load_model(42)
    with pytest.raises(KernelgateError, match="device 'nope' is not a torch device"):
        kernelgate.load_model(ckpt, device="nope")
    if not torch.cuda.is_available():
        with pytest.raises(KernelgateError, match="device 'cuda' is not available on this machine"):
            kernelgate.load_model(ckpt, device="cuda")
    with pytest.raises(KernelgateError, match="dtype 'foo' is not a floating point torch dtype"):
        kernelgate.load_model(ckpt, dtype="foo")
