"""`kernelgate doctor | check | bench` on this machine (Triton under TRITON_INTERPRET=1), and the
one-line errors of every command."""
import json

import pytest
import torch

from kernelgate import cli


@pytest.fixture
def clean_env(monkeypatch):
    # The CLI writes KERNELGATE_PLATFORM / KERNELGATE_FORCE into os.environ. setenv makes
    # monkeypatch record the original state (even "unset") and restore it afterwards.
    for name in ("KERNELGATE_PLATFORM", "KERNELGATE_FORCE", "KERNELGATE_GRAPHS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def doctor_json(capsys, *args):
    assert cli.main(["doctor", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_doctor_xpu_chooses_triton_gated_rms_norm(clean_env, capsys):
    report = doctor_json(capsys, "--platform", "xpu")
    assert report["platform"]["platform"] == "xpu" and report["platform"]["simulated"] != (
        report["platform"]["real"] == "xpu")
    entry = report["ops"]["gated_rms_norm"]
    assert entry["chosen"] == "triton"
    reasons = {i["name"]: i["reason"] for i in entry["implementations"]}
    assert reasons["triton"] is None and reasons["native"] == "lower priority than triton"
    if not torch.cuda.is_available():
        assert "Triton unusable" in reasons["fla"] or "needs compiled Triton" in reasons["fla"]

    assert cli.main(["doctor", "--platform", "xpu"]) == 0
    text = capsys.readouterr().out
    assert "platform  xpu" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("gated_rms_norm"))
    assert "-> triton" in line and "chosen" in line


def test_doctor_cpu_explains_why_not_triton(clean_env, capsys):
    entry = doctor_json(capsys, "--platform", "cpu")["ops"]["gated_rms_norm"]
    reasons = {i["name"]: i["reason"] for i in entry["implementations"]}
    assert entry["chosen"] == "native"
    assert reasons["triton"] == "not declared for cpu (declared: cuda, rocm, xpu)"


def test_doctor_force(clean_env, capsys):
    entry = doctor_json(capsys, "--platform", "xpu", "--force", "gated_rms_norm=native")["ops"]["gated_rms_norm"]
    reasons = {i["name"]: i["reason"] for i in entry["implementations"]}
    assert entry["chosen"] == "native" and reasons["triton"] == "override forces native"


@pytest.mark.parametrize("argv,message", [
    (["doctor", "--platform", "tpu"], "KERNELGATE_PLATFORM='tpu' is not one of"),
    (["doctor", "--force", "gated_rms_norm=nope"], "gated_rms_norm: unknown implementation 'nope'"),
    (["doctor", "--force", "nope=native"], "unknown op 'nope'"),
    (["bench", "nope", "--no-compile"], "unknown op 'nope'"),
])
def test_cli_errors(clean_env, capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_check_gated_rms_norm_passes(clean_env, capsys):
    assert cli.main(["check", "gated_rms_norm", "-v"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "ok   gated_rms_norm/triton/63x60-nbg-sigmoid/float32" in out


def test_bench_tiny_case_on_this_device(clean_env, capsys, tmp_path):
    assert cli.main(["bench", "gated_rms_norm", "--no-compile", "--case", "32x128", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / f"gated_rms_norm-{result_platform()}.json").read_text())
    rows = {r["impl"]: r for r in result["rows"]}
    assert {"native", "triton"} <= set(rows)
    for r in rows.values():
        # GB/s from the declared byte count (rounds to 0.0 for the interpreter on a busy CPU)
        assert r["case"] == "32x128" and r["dtype"] == "bfloat16" and r["us"] > 0 and r["gb_s"] >= 0
    assert result["copy_gb_s"] > 0
    assert "| 32x128 | bfloat16 | triton |" in (tmp_path / f"gated_rms_norm-{result_platform()}.md").read_text()


def result_platform():
    from kernelgate import platform
    return platform.current().real


def test_version(capsys):
    from kernelgate import __version__
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kernelgate {__version__}"


@pytest.mark.parametrize("argv,message", [
    (["check", "nosuchop"], "check: unknown op 'nosuchop' (known: biased_grouped_topk,"),
    (["bench", "nosuchop", "--no-compile"], "unknown op 'nosuchop'"),
    (["run", "--dtype", "foo"], "argument --dtype: 'foo' is not one of float32,"),
    (["serve", "--dtype", "int8"], "argument --dtype: 'int8' is not one of"),
    (["run", "--device", "nodevice"], "argument --device: 'nodevice' is not a torch device"),
    (["run", "--temperature", "nan"], "argument --temperature: must be a finite number in [0.0, inf], got nan"),
    (["run", "--top-p", "0"], "argument --top-p: must be a finite number in (0.0, 1.0], got 0"),
    (["run", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["run", "--max-new-tokens", "1000000000"], "run: --max-new-tokens 1000000000 leaves no room for a prompt "
                                                "in --max-model-len 4096"),
    (["run", "--prompt-ids", "5,x"], "--prompt-ids '5,x' must be comma-separated integers"),
    (["serve", "--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be a finite number"),
    (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
    (["serve", "--scheduler-delay-factor", "-1"], "argument --scheduler-delay-factor: must be a finite number"),
    (["bench", "serve", "--request-rate", "0"], "argument --request-rate: must be > 0 (or inf), got 0"),
    (["serve", "--port", "99999"], "argument --port: must be in [1, 65535], got 99999"),
    (["serve", "--port", "0"], "argument --port: must be in [1, 65535], got 0"),
    (["serve", "--port", "http"], "argument --port: 'http' is not an integer"),
    (["serve", "--max-queued-requests", "0"], "argument --max-queued-requests: must be >= 1, got 0"),
    (["serve", "--host", "no-such-host.invalid", "--port", "8123"], "serve: cannot listen on no-such-host.invalid:8123"),
    (["bench", "gated_rms_norm", "--impl", "nope", "--no-compile"],
     ("bench: gated_rms_norm has no implementation named 'nope' (known: native, triton, fla, native-compiled)")),
    (["bench", "gated_rms_norm", "--case", "nope", "--no-compile"], "bench: gated_rms_norm has no bench case named 'nope'"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
], ids=lambda v: "-".join(v) if isinstance(v, list) else None)
def test_cli_errors_are_one_line(clean_env, capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_device_without_backend_is_one_line(clean_env, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["run", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "argument --device: 'cuda': this machine (torch " in err and "has no cuda device" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_graphs_env_validated(clean_env, capsys, monkeypatch, value):
    monkeypatch.setenv("KERNELGATE_GRAPHS", value)
    assert cli.main(["run", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert f"KERNELGATE_GRAPHS={value!r}: must be 0 (eager decode) or 1 (device graphs)" in err


def test_cli_error_in_a_fresh_process():
    # what a user sees: rc 2 and one line on stderr, from the installed entry point's module
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "kernelgate", "run", "--dtype", "foo"], capture_output=True, text=True, check=False)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1 and "--dtype" in p.stderr


def test_serve_on_a_busy_port_is_one_line_at_once(clean_env, capsys):
    """The socket is bound before the model loads: a port in use fails in a moment, in one line."""
    import socket
    import time
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.perf_counter()
        assert cli.main(["serve", "--port", str(port)]) == 2
        assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert err == f"kernelgate: error: serve: cannot listen on 127.0.0.1:{port}: Address already in use\n", err


def test_bench_that_runs_nothing_keeps_the_saved_results(clean_env, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("Triton runs here")
    saved = tmp_path / f"gated_rms_norm-{result_platform()}.md"
    saved.write_text("earlier results")
    assert cli.main(["bench", "gated_rms_norm", "--impl", "triton", "--no-compile", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bench: no implementation of gated_rms_norm runs on this platform (triton: Triton unusable" in err and err.count("\n") == 1
    assert saved.read_text() == "earlier results" and len(list(tmp_path.iterdir())) == 1


BAD_ENV = {"KERNELGATE_CHECKS": ("banana", "KERNELGATE_CHECKS='banana': expected 0 or 1"),
           "KERNELGATE_TRACE": ("maybe", "KERNELGATE_TRACE='maybe': expected 0 or 1"),
           "KERNELGATE_GRAPHS": ("2", "KERNELGATE_GRAPHS='2': must be 0 (eager decode) or 1"),
           "KERNELGATE_PDL": ("often", "KERNELGATE_PDL='often': expected 0 or 1"),
           "KERNELGATE_DIST_TIMEOUT": ("-1", "KERNELGATE_DIST_TIMEOUT='-1': must be seconds > 0"),
           "KERNELGATE_DEBUG": ("yes please", "KERNELGATE_DEBUG='yes please': expected 0 or 1"),
           "KERNELGATE_PLATFORM": ("tpu", "KERNELGATE_PLATFORM='tpu' is not one of"),
           "KERNELGATE_FORCE": ("gated_rms_norm=nope", "gated_rms_norm: unknown implementation 'nope'")}


@pytest.mark.parametrize("name", sorted(BAD_ENV))
def test_bad_environment_value_is_one_line(clean_env, capsys, monkeypatch, name):
    value, message = BAD_ENV[name]
    monkeypatch.setenv(name, value)
    assert cli.main(["doctor", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_every_variable_with_a_parser_has_a_bad_value_case():
    from kernelgate import envs
    checked = {n for n, v in envs.VARS.items() if v.parse is not envs._text}
    assert checked <= set(BAD_ENV), checked - set(BAD_ENV)


def test_bad_environment_is_read_where_used_not_at_import():
    """KERNELGATE_CHECKS=banana: `--version` answers without importing torch; importing the
    package's modules works; the first command reads it and says so in one line."""
    import subprocess
    import sys
    env = {**__import__("os").environ, "KERNELGATE_CHECKS": "banana"}
    code = "import sys; from kernelgate import cli; rc = cli.main(['--version']); print('torch' in sys.modules); sys.exit(rc)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert p.returncode == 0 and p.stdout.split() == ["kernelgate", __import__("kernelgate").__version__, "False"], p
    code = ("import kernelgate.ops, kernelgate.engine.engine, kernelgate.server.app, kernelgate.registry; "
            "from kernelgate import cli; raise SystemExit(cli.main(['doctor']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert p.returncode == 2 and p.stderr == "kernelgate: error: KERNELGATE_CHECKS='banana': expected 0 or 1\n", p


def test_doctor_says_which_fp8_form_each_platform_gets(clean_env, capsys):
    """By name (no GPU known): the rule for that platform's GPUs; as one GPU: its form, and why."""
    from kernelgate import platform
    from kernelgate.cli.ops import doctor_report
    from kernelgate.platform import Device
    notes = {p: doctor_json(capsys, "--platform", p)["ops"] for p in ("cuda", "xpu", "cpu")}
    cuda, xpu = notes["cuda"]["fp8_linear"]["note"], notes["xpu"]["fp8_linear"]["note"]
    assert "w8a8" in cuda and ">= 128 tokens on sm_89+" in cuda and "w8a16" in cuda
    assert xpu.startswith("fp8 form on xpu") and "w8a16" in xpu and "w8a8 is taken only with fp8 matrix" in xpu
    assert "no w8a8 experts kernel" in notes["cuda"]["fused_experts_fp8"]["note"]
    assert notes["cpu"]["fp8_linear"]["note"] is None and notes["cpu"]["gated_rms_norm"]["note"] is None
    for device, w8a8, decode in ((Device("cuda", "sm_90", "H100"), True, "fp8 conversion instructions"),
                                 (Device("rocm", "gfx90a", "MI250"), False, "exact integer ops"),
                                 (Device("xpu", "pvc", "Max 1550"), False, "exact integer ops")):
        with platform.simulate(device):
            ops = doctor_report()["ops"]
        line, experts = ops["fp8_linear"]["note"], ops["fused_experts_fp8"]["note"]
        assert line.startswith(f"fp8 form on {device.capability}: ") and decode in line and decode in experts
        assert ("w8a8 (x quantized" in line) is w8a8 and "w8a8 (x" not in experts, line
    assert cli.main(["doctor", "--platform", "cuda"]) == 0
    text = capsys.readouterr().out.splitlines()
    row = text.index(next(ln for ln in text if ln.startswith("fused_experts_fp8")))
    assert text[row + 3].strip().startswith("note: fp8 form on cuda")    # under the op's three rows
