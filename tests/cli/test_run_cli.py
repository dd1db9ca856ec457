"""`kernelgate run`: the built-in model end to end through the CLI, text and --json, token-id
and text prompts, --chat, --stop, a checkpoint folder with --model, and a simulated platform."""
import json
import os

import pytest

from kernelgate import cli


def test_run_builtin_text(capsys):
    assert cli.main(["run", "--max-new-tokens", "3", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "dispatch plan (op -> implementation):" in out
    for op in ("kda_prefill", "kda_packed_decode", "fused_experts", "biased_grouped_topk", "short_conv"):
        assert f"  {op}" in out
    assert "[1]" in out and "[2]" not in out and "tokens/s" in out


def test_run_json_with_prompt_ids(capsys):
    assert cli.main(["run", "--json", "--max-new-tokens", "4", "--batch", "3", "--prompt-ids", "5,6,7"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["prompt_ids"] for r in rep["results"]] == [[5, 6, 7]] * 3
    assert all(len(r["token_ids"]) == 4 for r in rep["results"])
    assert rep["results"][0]["token_ids"] == rep["results"][2]["token_ids"]         # greedy, same prompt
    assert rep["decode_tokens"] == 3 * 3 and rep["prefill_tokens"] == 9
    assert rep["decode_tokens_per_s"] > 0 and rep["plan"]["kda_prefill"]


def test_run_model_folder_and_platform(tmp_path, capsys):
    from helpers.kimi_hf import tiny_hf_model
    tiny_hf_model(seed=1).save_pretrained(tmp_path)
    assert cli.main(["run", "--json", "--model", str(tmp_path), "--platform", "npu", "--max-new-tokens", "2",
                     "--batch", "1", "--prompt-ids", "3,4"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["platform"] == "npu" and rep["model"] == str(tmp_path) and len(rep["results"]) == 1


def test_run_prompt_ids_need_no_tokenizer_text_does(tmp_path, capsys):
    from helpers.kimi_hf import tiny_hf_model
    tiny_hf_model(seed=1).save_pretrained(tmp_path)          # a checkpoint without tokenizer files
    assert cli.main(["run", "--model", str(tmp_path), "--prompt", "hello"]) == 2
    assert "no tokenizer: give token ids with --prompt-ids 5,17,300" in capsys.readouterr().err


def _offline(prompt_ids, n, **kw):
    import kernelgate
    from kernelgate.cli.model import builtin_model
    model = builtin_model()
    [r] = kernelgate.generate(model, [prompt_ids], max_new_tokens=n, **kw)
    return model, r.token_ids


def test_run_text_prompt_is_tokenized_not_parsed_as_ids(capsys):
    assert cli.main(["run", "--json", "--max-new-tokens", "5", "--batch", "1", "--prompt", "5,17,300"]) == 0
    [r] = json.loads(capsys.readouterr().out)["results"]
    assert r["prompt_ids"] == list(b"5,17,300")
    model, want = _offline(r["prompt_ids"], 5, temperature=0.0)
    assert r["token_ids"] == want
    assert r["text"] == model.tokenizer.decode(want, skip_special_tokens=True)     # special tokens skipped


def test_run_chat_applies_template(capsys):
    assert cli.main(["run", "--json", "--max-new-tokens", "3", "--batch", "1", "--chat", "--prompt", "Hi"]) == 0
    [r] = json.loads(capsys.readouterr().out)["results"]
    assert r["prompt_ids"] == [257, *b"user\nHi", 258, 10, 257, *b"assistant\n"]


def test_run_stop_string_cuts_text(capsys):
    ids = [3, 1, 4, 1, 5]
    model, want = _offline(ids, 24, temperature=0.0, stop_token_ids=[])
    full = model.tokenizer.decode(want, skip_special_tokens=True)
    assert len(full) >= 3, full
    stop = full[1:3]
    assert cli.main(["run", "--json", "--max-new-tokens", "24", "--batch", "1", "--prompt-ids", "3,1,4,1,5",
                     "--stop", stop]) == 0
    [r] = json.loads(capsys.readouterr().out)["results"]
    assert r["text"] == full[:full.find(stop)] and r["finish_reason"] == "stop"
    assert r["token_ids"] == want[:len(r["token_ids"])] and len(r["token_ids"]) < 24


def test_run_engine_flags(capsys):
    assert cli.main(["run", "--json", "--max-new-tokens", "2", "--batch", "3", "--max-num-seqs", "2",
                     "--max-model-len", "64", "--prompt-ids", "1,2"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["engine"]["max_num_seqs"] == 2 and rep["engine"]["max_model_len"] == 64
    assert rep["engine"]["max_num_batched_tokens"] == 8192           # EngineConfig's default
    assert [len(r["token_ids"]) for r in rep["results"]] == [2, 2, 2]
    assert cli.main(["run", "--max-model-len", "8", "--max-new-tokens", "4", "--prompt-ids", "1,2,3,4,5"]) == 2
    assert "longest prompt (5 tokens) + --max-new-tokens 4 exceeds --max-model-len 8" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_env_leak(monkeypatch):
    # cli.main writes KERNELGATE_PLATFORM into os.environ; keep it inside the test
    monkeypatch.setenv("KERNELGATE_PLATFORM", os.environ.get("KERNELGATE_PLATFORM", ""))
