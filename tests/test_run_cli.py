"""`kernelgate run`: the built-in model end to end through the CLI, text and --json, a
checkpoint folder with --model, and a simulated platform."""
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
    assert cli.main(["run", "--json", "--max-new-tokens", "4", "--batch", "3", "--prompt", "5,6,7"]) == 0
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
                     "--batch", "1", "--prompt", "3,4"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["platform"] == "npu" and rep["model"] == str(tmp_path) and len(rep["results"]) == 1


def test_run_bad_prompt(capsys):
    assert cli.main(["run", "--prompt", "hello"]) == 2
    assert "comma-separated token ids" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_env_leak(monkeypatch):
    # cli.main writes KERNELGATE_PLATFORM into os.environ; keep it inside the test
    monkeypatch.setenv("KERNELGATE_PLATFORM", os.environ.get("KERNELGATE_PLATFORM", ""))
