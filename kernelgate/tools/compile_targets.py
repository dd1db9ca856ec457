"""Compile every Triton implementation for GPUs this machine does not have.

    python -m kernelgate.tools.compile_targets [-j N | --family-once] [--skip-fp32] [--native] [--json FILE] [sm_80 sm_90 gfx90a gfx942 pvc bmg]

For each target the platform layer simulates that GPU (`platform.simulate(Device, compiling=True)`:
name, capability, the properties its runtime reports) and Triton's active driver is a stand-in
that reports it and launches nothing. Every registry implementation that needs Triton is then
called on each of its op's parity cases (CPU tensors): dispatch takes the launch choices it would
take on that GPU and Triton compiles them all the way to the target's binary -- cubin (ptxas),
hsaco (LLVM's AMDGPU backend), SPIR-V (Intel's backend, triton-xpu; `--native`: zebin for PVC
through `ocloc`). Nothing runs, so numbers are the parity suite's business; this checks that what
dispatch picks on an A100, H100, MI250, MI300, Max 1550 or B580 builds there, and what came out:
a binary, shared / local memory within the device's limit, matrix instructions (mma / mfma /
DPAS) where a 16-bit `tl.dot` is.

Every compiled specialisation is listed. A specialisation that differs from one already built
for the target only in Triton's own specialisations of runtime arguments (divisibility hints, an
int equal to 1) is compiled once (same dtypes, constexprs, warps and stages: the same program).
Intel targets whose TTGIR comes out the same share its LLVM IR and SPIR-V (PVC and BMG: Intel's
lowering after TTGIR does not read the device). An implementation that compiles nothing is
SKIPPED with the registry's reason, never ok. Targets run in one process (default) or one
process each (`-j N`). `--family-once` (CI's per-push set) lowers each NVIDIA / AMD program once
per vendor, for its oldest target (sm_80, gfx90a: where fp8 and shared memory refuse most); a
newer target lowers the programs its own launch choices make and lists the rest as lowered for
the older one. `--skip-fp32` (CI's per-push set, every vendor) leaves out an implementation's fp32
parity cases where its 16-bit ones launch kernels: GPUs serve in bf16 / fp16, the fp32 programs are
the same source at another dtype (their numbers are the interpreter parity suite's; GPU parity runs
compile them on the device), and they are about half of the CPU. The cases left out are listed in the row ("not_lowered", with the
reason) and counted in the summary; an implementation whose cases are all fp32 (or whose 16-bit
ones launch nothing) still lowers them, so nothing is SKIPPED that the full check builds. Without
either flag every target lowers everything (the full check).
Run it without TRITON_INTERPRET (the kernels must be JIT functions, not interpreted ones).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import platform
from .compile_stand_in import TARGETS, Spec, available, native_spec, ocloc, targeting


def triton_impls():
    """kernelgate's own Triton implementations (fla's kernels call torch.cuda themselves: not here)."""
    from .. import registry
    for op in registry.ops().values():
        for impl in op.impls.values():
            if impl.provider == "triton":
                yield op, impl


@contextlib.contextmanager
def _stderr_to(path: str):
    """Send fd 2 (where MLIR / LLVM print their diagnostics) to `path` inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _compiler_message(e: Exception, log: str) -> str:
    """The exception and the compiler's own diagnostics (MLIR / LLVM / ptxas print to stderr)."""
    text = f"{type(e).__name__}: {str(e).strip()}"
    diag = [line for line in log.splitlines() if re.search(r"error|Error|abort|LLVM ERROR", line)]
    return "\n".join([text, *diag[:20]])


SKIP_FP32 = "fp32: its 16-bit cases lowered instead (--skip-fp32; the full check lowers both)"


def compile_impl(name: str, op, impl, rec, skip_fp32: bool = False) -> dict:
    """Call `impl` on each parity case as dispatch on `name` would; the result row for it.
    skip_fp32: an implementation's fp32 cases are left out where its 16-bit cases launched a
    kernel (listed in the row's "not_lowered"); one with fp32 cases only still lowers them."""
    plat = platform.current()
    row = {"target": name, "impl": f"{op.name}/{impl.name}", "status": "ok", "reason": None,
           "cases": 0, "rejected": {}, "not_lowered": {}, "specs": [], "seconds": 0.0}
    t0 = time.perf_counter()
    if plat.name not in impl.platforms:
        row.update(status="SKIPPED", reason=impl.rejects(plat, None, {}))
        return row
    rec.begin(row)
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        try:
            with _stderr_to(log.name):
                fn = impl.callable()
                todo = [(case, dtype) for case in op.cases() for dtype in case.dtypes]
                if skip_fp32:                      # 16-bit cases first: they decide whether fp32 runs
                    todo.sort(key=lambda cd: cd[1] == torch.float32)
                for case, dtype in todo:
                    if skip_fp32 and dtype == torch.float32 and row["specs"]:   # (specs: the 16-bit ones)
                        row["not_lowered"].setdefault(SKIP_FP32, []).append(f"{case.id}-float32")
                        continue
                    args, kwargs = case.make("cpu", dtype, torch.Generator().manual_seed(0))
                    why = impl.rejects(plat, args, kwargs)      # the registry's own per-call check
                    if why is not None:
                        row["rejected"].setdefault(why, []).append(f"{case.id}-{str(dtype)[6:]}")
                        continue
                    row["cases"] += 1
                    fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            with open(log.name, errors="replace") as f:
                row.update(status="FAILED", reason=_compiler_message(e, f.read()))
    rec.end()
    bad = [s for s in row["specs"] if s["problem"]]
    if row["status"] == "ok" and bad:
        row.update(status="FAILED", reason="; ".join(f"{s['kernel']}: {s['problem']}" for s in bad[:5]))
    if row["status"] == "ok" and not row["specs"]:
        why = "; ".join(f"{r} ({len(c)} cases)" for r, c in row["rejected"].items())
        row.update(status="SKIPPED", reason=why or "no parity case launched a kernel")
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def compile_target(name: str, native: bool = False, family: dict | None = None, skip_fp32: bool = False) -> list[dict]:
    why = available(name)
    if why:
        return [{"target": name, "impl": "*", "status": "SKIPPED", "reason": why, "cases": 0,
                 "rejected": {}, "not_lowered": {}, "specs": [], "seconds": 0.0}]
    with targeting(name, native=native, family=family) as rec:
        rows = [compile_impl(name, op, impl, rec, skip_fp32) for op, impl in triton_impls()]
    if rec.native is not None:
        rows.append(compile_native(name, rec.native))
    return rows


def compile_native(name: str, spirv: dict) -> dict:
    """The row for native code: one specialisation per kernel through ocloc, in parallel."""
    row = {"target": name, "impl": "native", "status": "ok", "reason": None, "cases": len(spirv),
           "rejected": {}, "specs": [], "seconds": 0.0}
    t0 = time.perf_counter()
    if shutil.which("ocloc") is None:
        row.update(status="SKIPPED", reason="ocloc not found (Debian / Ubuntu: apt-get install intel-opencl-icd)")
        return row

    def build(item):
        spec, spv, flags = item
        try:
            return native_spec(spec, ocloc(spv, flags, device=name)), None
        except RuntimeError as e:
            return None, f"{spec['kernel']}[{spec['key']}]: {e}"
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        for spec, err in pool.map(build, spirv.values()):
            if err:
                row.update(status="FAILED", reason=err if row["reason"] is None else row["reason"])
            else:
                row["specs"].append(spec)
    bad = [s for s in row["specs"] if s["problem"]]
    if row["status"] == "ok" and bad:
        row.update(status="FAILED", reason="; ".join(f"{s['kernel']}: {s['problem']}" for s in bad[:5]))
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _in_subprocess(name: str, native: bool, skip_fp32: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kernelgate.tools.compile_targets", "--json", "-", name] + \
        (["--native"] if native else []) + (["--skip-fp32"] if skip_fp32 else [])
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def compile_all(names, jobs: int = 1, native: bool = False, family_once: bool = False,
                skip_fp32: bool = False) -> list[dict]:
    """One row per (target, implementation); `jobs` > 1 runs each target in its own process.
    family_once: NVIDIA and AMD targets lower a program (the same kernel, signature, constants,
    warps and stages: the same TTIR) once per vendor, for the vendor's first target in TARGETS
    order (the oldest: the one that refuses most, e.g. fp8 before sm_89); a later target lowers
    only the programs its own launch choices make. Intel targets already share lowering where
    their TTGIR is equal."""
    if family_once:
        assert jobs <= 1, "family_once shares one process's record of what each vendor lowered"
        names = sorted(names, key=list(TARGETS).index)
        seen: dict = {}
        return [row for name in names
                for row in compile_target(name, native, seen.setdefault(TARGETS[name].backend, {})
                                          if TARGETS[name].backend != "xpu" else None, skip_fp32)]
    if jobs <= 1:
        return [row for name in names for row in compile_target(name, native, None, skip_fp32)]
    rows, pending, running = [], list(names), {}
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            running[name] = _in_subprocess(name, native, skip_fp32)
        name, proc = next(iter(running.items()))
        out, err = proc.communicate()
        del running[name]
        try:
            rows += json.loads(out)
        except json.JSONDecodeError:   # the compiler took the process down (an LLVM abort)
            rows.append({"target": name, "impl": "*", "status": "FAILED", "cases": 0, "rejected": {},
                         "specs": [], "seconds": 0.0,
                         "reason": f"process exited {proc.returncode}: {err.strip()[-2000:]}"})
    return rows


def _spec_line(s: Spec) -> str:
    if s.get("same_as"):
        return f"    {s['kernel']}[{s['key']}] w{s['warps']} s{s['stages']}: the program lowered for {s['same_as']}"
    extra = f" {s['dot']}" if s["dot"] else ""
    extra += f" (lowered as for {s['lowered_for']}: same TTGIR)" if s.get("lowered_for") else ""
    return f"    {s['kernel']}[{s['key']}] w{s['warps']} s{s['stages']} {s['binary']} shared={s['shared']}{extra}"


def report(rows, verbose: bool = True, out=sys.stdout) -> int:
    bad = 0
    for r in rows:
        shared = [s["same_as"] for s in r["specs"] if s.get("same_as")]
        n, dup = len(r["specs"]) - len(shared), sum(s["reuses"] for s in r["specs"])
        head = f"{r['target']:7s} {r['impl']:45s} {r['seconds']:6.1f} s  {n:3d} compiled {dup:3d} reused  " + \
            (f"{len(shared):3d} lowered for {shared[0]}  " if shared else "")
        if r["status"] == "ok":
            rej = "".join(f"\n    (dispatch rejects {len(c)} cases: {why})" for why, c in r["rejected"].items())
            rej += "".join(f"\n    ({len(c)} cases not lowered: {why})" for why, c in r.get("not_lowered", {}).items())
            print(head + "ok" + rej, file=out)
        else:
            print(head + f"{r['status']}: {r['reason']}", file=out)
        if verbose:
            for s in r["specs"]:
                print(_spec_line(s), file=out)
        bad += r["status"] == "FAILED"
    by = {}
    for r in rows:
        t = by.setdefault(r["target"], {"specs": 0, "ok": 0, "SKIPPED": 0, "FAILED": 0, "native": "", "lowered": {},
                                        "same": {}, "not_lowered": {}})
        if r["impl"] == "native":
            t["native"] = f"; native code: {len(r['specs'])} zebin {r['status']}" + (f" ({r['reason']})" if r["reason"] else "")
            continue
        t["specs"] += len(r["specs"])
        t[r["status"]] += 1
        for why, cases in r.get("not_lowered", {}).items():
            t["not_lowered"][why] = t["not_lowered"].get(why, 0) + len(cases)
        for s in r["specs"]:
            if s.get("lowered_for"):
                t["lowered"][s["lowered_for"]] = t["lowered"].get(s["lowered_for"], 0) + 1
            if s.get("same_as"):
                t["same"][s["same_as"]] = t["same"].get(s["same_as"], 0) + 1
    for name, t in by.items():
        lowered = "".join(f" ({n} lowered as for {who}: same TTGIR)" for who, n in t["lowered"].items())
        lowered += "".join(f" ({n} the programs lowered for {who}: --family-once)" for who, n in t["same"].items())
        left = "".join(f"; {n} cases not lowered: {why}" for why, n in t["not_lowered"].items())
        print(f"compile_targets {name}: {t['specs']} specialisations{lowered}, {t['ok']} implementations ok, "
              f"{t['SKIPPED']} skipped, {t['FAILED']} failed{left}{t['native']}", file=out)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernelgate.tools.compile_targets", description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="*", help=f"default: every target this Triton can build ({', '.join(TARGETS)})")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="targets compiled in parallel processes")
    ap.add_argument("--native", action="store_true",
                    help="PVC: also build native code (zebin) through ocloc, one specialisation per kernel")
    ap.add_argument("--family-once", action="store_true",
                    help="NVIDIA / AMD: lower each program once per vendor, for its oldest target listed; "
                         "a newer target lowers only the programs its own launch choices make (CI's per-push set)")
    ap.add_argument("--skip-fp32", action="store_true",
                    help="leave out an implementation's fp32 cases where its 16-bit ones launch (an fp32-only "
                         "implementation still lowers them): CI's per-push set, about half the CPU")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON ('-': stdout, no text report)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-specialisation lines")
    a = ap.parse_args(argv)
    if platform.interpreting():
        print("compile_targets: unset TRITON_INTERPRET (kernels must be JIT functions)")
        return 2
    unknown = [t for t in a.targets if t not in TARGETS]
    if unknown:
        print(f"compile_targets: unknown target(s) {', '.join(unknown)} (known: {', '.join(TARGETS)})")
        return 2
    names = a.targets or [t for t in TARGETS if available(t) is None]
    t0 = time.perf_counter()
    if a.family_once and a.jobs > 1:
        print("compile_targets: --family-once compiles in one process (not with -j)")
        return 2
    rows = compile_all(names, a.jobs, a.native, a.family_once, a.skip_fp32)
    if a.json == "-":
        json.dump(rows, sys.stdout)
        return 1 if any(r["status"] == "FAILED" for r in rows) else 0
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)
    rc = report(rows, verbose=not a.quiet)
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    print(f"compile_targets {' '.join(names)}: {time.perf_counter() - t0:.0f} s, {cpu:.0f} CPU-s "
          f"(with ptxas / ocloc)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
