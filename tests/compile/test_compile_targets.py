"""Every kernelgate Triton implementation, as dispatch launches it on each GPU family, compiles
for that family's GPUs (kernelgate/tools/compile_targets.py: a simulated device, a stand-in Triton
driver, no GPU needed). This catches a kernel only one vendor can build: fp8 casts Triton refuses
before sm_89, fp8 conversions LLVM cannot lower for gfx90a, tiles that overflow 64 KiB of LDS,
a 16-bit tl.dot that misses the matrix units, a kernel Intel's backend cannot lower.

One process per family compiles both of its targets (so one target's compile state cannot leak
into the next unnoticed); the families run in parallel under xdist. .ci/run compiles with
--family-once: a program is lowered once per vendor, for the older target (sm_80, gfx90a), and
the newer one lowers the programs its own launch choices make (checked below: sm_90's
mla_decode tiles); and --skip-fp32 (an implementation's fp32 cases are left out where its
16-bit ones launch: checked below); `python -m
kernelgate.tools.compile_targets` without them lowers everything for every target. Intel's backend is the
triton-xpu package, which installs as `triton`: it runs from its own venv (`.venv-xpu`, made by
.ci/run, or KERNELGATE_XPU_PYTHON). Missing there, the Intel test skips with the reason locally
and fails in CI. .ci/run starts every family's compile in the background as soon as its venv
has Triton, beside the installs and the main suite, and hands the results over in
KERNELGATE_COMPILE_REPORT (a folder per family: rows.json, rc, log; skip = why it could not run)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernelgate import registry
from kernelgate.tools.compile_stand_in import TARGETS, available

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {"nvidia": ("sm_80", "sm_90"), "amd": ("gfx90a", "gfx942"), "intel": ("pvc", "bmg")}
FLAGS = {family: ("--skip-fp32",) for family in FAMILIES}   # as .ci/run passes them
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
RUN_LAST = ("test_every_triton", "test_pvc_native")   # they may wait on .ci/run's background compiles


def _missing(reason: str):
    if IN_CI:
        pytest.fail(f"CI must compile this family: {reason}")
    pytest.skip(reason)


def _python(family: str) -> str:
    """An interpreter whose Triton has the family's backend."""
    why = available(FAMILIES[family][0])
    if why is None:
        return sys.executable
    if family == "intel":
        for cand in (os.environ.get("KERNELGATE_XPU_PYTHON"), str(ROOT / ".venv-xpu/bin/python")):
            if cand and Path(cand).exists():
                return cand
        _missing("no triton-xpu venv: set KERNELGATE_XPU_PYTHON or make .venv-xpu as .ci/run does "
                 "(pip install triton-xpu==3.3.0b1 torch numpy)")
    _missing(why)


def _background_rows(folder: Path, wait_s: float = 540) -> list:
    """The rows .ci/run's background compile writes; waits for its exit code."""
    deadline = time.monotonic() + wait_s
    while not (folder / "rc").exists():
        if (folder / "skip").exists():
            _missing((folder / "skip").read_text().strip())
        if time.monotonic() > deadline:
            pytest.fail(f"the background compile wrote no result in {wait_s:.0f} s ({folder})")
        time.sleep(2)
    if (folder / "skip").exists():
        _missing((folder / "skip").read_text().strip())
    text = (folder / "rows.json").read_text() if (folder / "rows.json").exists() else ""
    if not text:
        log = (folder / "log").read_text()[-3000:] if (folder / "log").exists() else ""
        pytest.fail(f"the background compile exited {(folder / 'rc').read_text().strip()}:\n{log}")
    return json.loads(text)


def _report(family: str) -> Path | None:
    """The folder .ci/run's background compile of `family` writes to, if it runs one."""
    root = os.environ.get("KERNELGATE_COMPILE_REPORT")
    return Path(root) / family if root and (Path(root) / family).is_dir() else None


def _rows(family: str) -> list:
    folder = _report(family)
    if folder:
        return _background_rows(folder)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([_python(family), "-m", "kernelgate.tools.compile_targets", "--family-once", *FLAGS[family],
                          "--json", "-", *FAMILIES[family]],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    try:
        return json.loads(run.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"compile_targets exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")


def declared_for(target: str) -> set:
    plat = TARGETS[target].device.platform
    return {f"{op.name}/{impl.name}" for op in registry.ops().values() for impl in op.impls.values()
            if impl.provider == "triton" and plat in impl.platforms}


def check(rows: list, target: str):
    mine = [r for r in rows if r["target"] == target]
    assert mine, f"{target}: compile_targets reported nothing"
    failed = [f"{r['impl']}: {r['reason']}" for r in mine if r["status"] == "FAILED"]
    assert not failed, f"{target}: failed to compile\n" + "\n\n".join(failed)
    for r in mine:
        assert r["status"] in ("ok", "SKIPPED"), r
        assert r["status"] == "ok" or r["reason"], f"{target} {r['impl']}: SKIPPED without a reason"
        if r["status"] == "ok":
            assert r["specs"], f"{target} {r['impl']}: ok with nothing compiled"
            assert all(s["binary"].split()[0] in ("cubin", "hsaco", "spv", "zebin") for s in r["specs"]), r["specs"]
    ok = {r["impl"] for r in mine if r["status"] == "ok" and r["impl"] != "native"}   # (native code: its own test)
    skipped = {r["impl"]: r["reason"] for r in mine if r["status"] == "SKIPPED"}
    # every Triton implementation declared for the target's platform was compiled, not skipped
    assert ok == declared_for(target), (sorted(declared_for(target) - ok), skipped)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_triton_implementation_compiles_for(family):
    rows = _rows(family)
    for target in FAMILIES[family]:
        check(rows, target)
    first = FAMILIES[family][0]
    for r in rows:   # --family-once: only the family's first target lowers what the others share
        for s in r["specs"]:
            assert s.get("same_as") in (None, first) and not (s.get("same_as") and r["target"] == first), (r["target"], s)
    if any(s.get("same_as") for r in rows for s in r["specs"]) and family == "nvidia":
        own = [s for r in rows if r["target"] == "sm_90" and r["impl"] == "mla_decode/triton"
               for s in r["specs"] if not s.get("same_as")]
        assert own, "sm_90's own mla_decode launch choices were not lowered for sm_90"
    # --skip-fp32 left out only fp32 cases, and only beside 16-bit programs
    left_out = [r for r in rows if r.get("not_lowered")]
    assert bool(left_out) == bool(FLAGS[family]), [r["impl"] for r in left_out]
    for r in left_out:
        for why, cases in r["not_lowered"].items():
            assert r["status"] == "ok" and r["specs"] and all(c.endswith("-float32") for c in cases), (r, why)
    if family == "intel":   # PVC: bf16 / fp16 tl.dot on DPAS (checked per kernel by compile_targets too)
        pvc = [s for r in rows if r["target"] == "pvc" for s in r["specs"]]
        assert any(s["dot"].endswith("-> dpas") for s in pvc), "no kernel reached DPAS on PVC"


def test_pvc_native_code_from_the_background_compile():
    """.ci/run's Intel pass also has ocloc build native PVC code (zebin) from the SPIR-V."""
    folder = _report("intel")
    if not folder:
        pytest.skip("the native PVC pass runs in .ci/run (KERNELGATE_COMPILE_REPORT): "
                    "python -m kernelgate.tools.compile_targets --native pvc in the triton-xpu venv")
    rows = _background_rows(folder)
    native = [r for r in rows if r["target"] == "pvc" and r["impl"] == "native"]
    if not native or native[0]["status"] == "SKIPPED":
        _missing(native[0]["reason"] if native else "the background compile ran without --native")
    assert native[0]["status"] == "ok", native[0]["reason"]
    kinds = {s["binary"].split()[0] for s in native[0]["specs"]}
    assert kinds == {"zebin"}, kinds
    assert any(s["dot"].endswith("-> dpas") for s in native[0]["specs"])
