"""compile_targets' bookkeeping without compiling: an implementation that builds nothing is
SKIPPED with a reason (never ok), a failure fails the run and carries the compiler's message."""
import io

import pytest
import torch

from kernelgate import platform, registry
from kernelgate.tools.compile_stand_in import TARGETS, Recorder
from kernelgate.tools.compile_targets import compile_impl, report

pytest.importorskip("triton")   # imported under this run's TRITON_INTERPRET (see test_stand_in_platform)


def _ref(x):
    return x * 2


def _op(platforms, fn):
    op = registry.Op("fake_double", _ref, cases=lambda: [registry.Case("T3", lambda d, dt, g: ((torch.ones(3, dtype=dt),), {}))])
    return op, op.implementation("triton", fn, provider="triton", platforms=platforms)


def _compile(target, op, impl, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with platform.simulate(TARGETS[target].device, compiling=True):
        return compile_impl(target, op, impl, Recorder(TARGETS[target]))


def test_not_declared_is_skipped_with_the_registry_reason(monkeypatch):
    op, impl = _op(("xpu",), _ref)
    row = _compile("sm_90", op, impl, monkeypatch)
    assert row["status"] == "SKIPPED" and row["reason"] == "not declared for cuda (declared: xpu)"


def test_nothing_compiled_is_skipped_not_ok(monkeypatch):
    op, impl = _op(("cuda",), _ref)          # runs, but launches no Triton kernel
    row = _compile("sm_80", op, impl, monkeypatch)
    assert (row["status"], row["cases"], row["specs"]) == ("SKIPPED", 2, [])
    assert row["reason"] == "no parity case launched a kernel"


def test_a_failure_carries_the_message(monkeypatch):
    def broken(x):
        raise RuntimeError("PassManager::run failed\nerror: 'tt.fp_to_fp' op unsupported conversion")
    op, impl = _op(("rocm",), broken)
    row = _compile("gfx90a", op, impl, monkeypatch)
    assert row["status"] == "FAILED" and "unsupported conversion" in row["reason"]


def test_report_lines_and_exit_code():
    spec = {"kernel": "k", "key": "fp32|B=1", "warps": 4, "stages": 2, "binary": "spv 10 B", "shared": 0,
            "dot": "", "problem": "", "reuses": 1}
    rows = [{"target": "pvc", "impl": "a/triton", "status": "ok", "reason": None, "rejected": {}, "specs": [spec],
             "seconds": 1.0},
            {"target": "pvc", "impl": "b/triton", "status": "SKIPPED", "reason": "why", "rejected": {}, "specs": [],
             "seconds": 0.0}]
    out = io.StringIO()
    assert report(rows, out=out) == 0
    text = out.getvalue()
    assert "SKIPPED: why" in text and "    k[fp32|B=1] w4 s2 spv 10 B shared=0" in text
    assert text.endswith("compile_targets pvc: 1 specialisations, 1 implementations ok, 1 skipped, 0 failed\n")
    rows[1].update(status="FAILED", reason="LLVM ERROR: boom")
    assert report(rows, out=io.StringIO()) == 1


def test_intel_lowering_is_shared_only_for_the_same_ttgir():
    """PVC and BMG: a stage after TTGIR runs once per (input, options); a second target gets its
    output and the metadata it set, and the spec says whose lowering it took."""
    from types import SimpleNamespace

    from kernelgate.tools import compile_stand_in as cs
    calls = []

    def make_llir(src, metadata):   # (a stage: Triton's lambda around make_llir(src, metadata, options))
        calls.append(src)
        metadata["shared"] = len(src)
        return f"llir of {src}"
    opts = SimpleNamespace(num_warps=4, grf_mode="default")
    cs._LOWERED.clear()
    cs._reused.clear()
    pvc, bmg = (cs._lowered_once("llir", make_llir, opts, arch) for arch in ("pvc", "bmg"))
    md = {}
    assert pvc("ttgir A", md) == "llir of ttgir A" and md == {"shared": 7} and cs._reused == {}
    md = {}
    assert bmg("ttgir A", md) == "llir of ttgir A" and md == {"shared": 7} and cs._reused == {"llir": "pvc"}
    cs._reused.clear()
    assert bmg("ttgir B", {}) == "llir of ttgir B" and cs._reused == {}          # other TTGIR: lowered
    other = cs._lowered_once("llir", make_llir, SimpleNamespace(num_warps=8, grf_mode="default"), "bmg")
    other("ttgir A", {})                                                          # other options: lowered
    assert calls == ["ttgir A", "ttgir B", "ttgir A"]
    cs._LOWERED.clear()


class _Rec:
    """Stands in for the Recorder: the fake implementation adds a spec where a kernel would compile."""
    def begin(self, row):
        self.row = row

    def end(self):
        pass


def _fake(dtypes, launching):
    rec = _Rec()

    def fn(x):
        if x.dtype in launching:
            rec.row["specs"].append({"kernel": "k", "key": str(x.dtype)[6:], "problem": ""})
        return x * 2
    case = registry.Case("T3", lambda d, dt, g: ((torch.ones(3, dtype=dt),), {}), dtypes=dtypes)
    op = registry.Op("fake_double", _ref, cases=lambda: [case])
    return op, op.implementation("triton", fn, provider="triton", platforms=("rocm",)), rec


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("dtypes, launching, lowered, left_out", [
    ((F32, BF16), (F32, BF16), ["bfloat16"], ["T3-float32"]),   # fp32 left to the full check
    ((F32,), (F32,), ["float32"], []),                           # fp32 cases only (routing logits): lowered
    ((F32, BF16), (F32,), ["float32"], []),                      # its 16-bit cases launch nothing: fp32 lowered
])
def test_skip_fp32_leaves_out_fp32_only_beside_16_bit_programs(monkeypatch, dtypes, launching, lowered, left_out):
    from kernelgate.tools.compile_targets import SKIP_FP32
    op, impl, rec = _fake(dtypes, launching)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with platform.simulate(TARGETS["gfx90a"].device, compiling=True):
        row = compile_impl("gfx90a", op, impl, rec, skip_fp32=True)
        full = compile_impl("gfx90a", *_fake(dtypes, launching), skip_fp32=False)
    assert [s["key"] for s in row["specs"]] == lowered
    assert row["not_lowered"] == ({SKIP_FP32: left_out} if left_out else {})
    assert sorted(s["key"] for s in full["specs"]) == sorted(str(d)[6:] for d in launching)   # the full check
    assert full["not_lowered"] == {}
    for s in row["specs"]:
        s.update(warps=4, stages=1, binary="hsaco 1 B", shared=0, dot="", reuses=0)
    out = io.StringIO()
    report([row], out=out)     # what was left out is in the text report too, per row and in the summary
    assert (f"(1 cases not lowered: {SKIP_FP32})" in out.getvalue()) == bool(left_out)
    assert (f"0 failed; 1 cases not lowered: {SKIP_FP32}\n" in out.getvalue()) == bool(left_out)


_PTX = """
.visible .entry k(
{{
\tmov.u32 \t%r1, %ctaid.x;
\tld.global.b16 \t%rs1, [%rd1];
{before}\tgriddepcontrol.wait;
\tgriddepcontrol.launch_dependents;
\tld.global.b16 \t%rs2, [%rd2];
\t@%p1 st.global.b16 \t[%rd3], %rs2;
\tret;
}}
"""


@pytest.mark.parametrize("before,launch_pdl,problem", [
    ("", True, ""),                                                            # loads (weights) may come first
    ("", False, ""),
    ("\t@%p2 st.global.b16 \t[%rd3], %rs1;\n", True, "writes global memory before griddepcontrol.wait"),
    ("\tatom.global.add.u32 \t%r2, [%rd4], 1;\n", True, "writes global memory before griddepcontrol.wait"),
    ("\tst.global.b16 \t[%rd3], %rs1;\n", False, ""),                         # an ordinary launch: no contract
])
def test_pdl_contract_in_the_ptx(before, launch_pdl, problem):
    """A kernel launched as a programmatic dependent writes nothing before griddepcontrol.wait, and waits."""
    from kernelgate.tools.compile_stand_in import pdl_problem
    got = pdl_problem(_PTX.format(before=before), launch_pdl)
    assert (problem in got) if problem else got == "", got
    assert "without griddepcontrol.wait" in pdl_problem("\tld.global.b16 \t%rs2, [%rd2];\n\tret;", True)
