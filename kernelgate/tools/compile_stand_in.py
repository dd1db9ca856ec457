"""Stand-in GPUs for `compile_targets`: the devices, a Triton driver that reports one of them and
launches nothing, and the compile hooks that list (and dedupe) what Triton builds for it."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from .. import platform
from ..platform import Device


def _xpu(arch: int, name: str, eus: int, slices: int, mem_gib: int, **has) -> dict:
    """Device properties as torch.xpu.get_device_capability() reports them (the keys Triton reads)."""
    return {"architecture": arch, "name": name, "type": "gpu", "vendor": "Intel(R) Corporation",
            "platform_name": "Intel(R) oneAPI Unified Runtime over Level-Zero", "version": has.pop("version"),
            "gpu_eu_count": eus, "gpu_subslice_count": slices, "max_compute_units": eus,
            "max_work_group_size": 1024, "max_num_sub_groups": 64, "sub_group_sizes": [16, 32],
            "local_mem_size": 131072, "total_memory": mem_gib << 30, "has_fp16": True, "has_fp64": True,
            "has_atomic64": True, "has_bfloat16_conversions": True, **has}


PVC = _xpu(0x030F000700, "Intel(R) Data Center GPU Max 1550", 512, 64, 64, version="12.60.7",
           has_subgroup_matrix_multiply_accumulate=True, has_subgroup_matrix_multiply_accumulate_tensor_float32=True,
           has_subgroup_2d_block_io=True)
BMG = _xpu(0x0500400400, "Intel(R) Arc(TM) B580 Graphics", 160, 20, 12, version="20.1.0",
           has_subgroup_matrix_multiply_accumulate=True, has_subgroup_matrix_multiply_accumulate_tensor_float32=False,
           has_subgroup_2d_block_io=True)


@dataclass(frozen=True)
class Target:
    device: Device
    backend: str          # Triton's name for the target: cuda | hip | xpu
    arch: object          # GPUTarget.arch: 80, "gfx942", or the XPU properties
    warp: int
    shared: int           # shared / local memory per block, bytes
    matrix: str           # what a 16-bit tl.dot must become in the output ("" = no matrix units)


TARGETS = {
    "sm_80": Target(Device("cuda", "sm_80", "NVIDIA A100-SXM4-80GB"), "cuda", 80, 32, 166912, "mma"),
    "sm_90": Target(Device("cuda", "sm_90", "NVIDIA H100 80GB HBM3"), "cuda", 90, 32, 232448, "mma"),
    "gfx90a": Target(Device("rocm", "gfx90a", "AMD Instinct MI250X"), "hip", "gfx90a", 64, 65536, "mfma"),
    "gfx942": Target(Device("rocm", "gfx942", "AMD Instinct MI300X"), "hip", "gfx942", 64, 65536, "mfma"),
    "pvc": Target(Device("xpu", "pvc", PVC["name"], PVC), "xpu", PVC, 32, PVC["local_mem_size"], "dpas"),
    "bmg": Target(Device("xpu", "bmg", BMG["name"], BMG), "xpu", BMG, 32, BMG["local_mem_size"], "dpas"),
}
_BACKEND = {"cuda": "nvidia", "hip": "amd", "xpu": "intel"}   # Triton's backend package names


def available(name: str) -> str | None:
    """None if this Triton can build for `name`, else why not."""
    reason = platform.library_reason("triton")
    if reason:
        return reason
    import triton
    from triton.backends import backends
    need = _BACKEND[TARGETS[name].backend]
    if need not in backends:
        hint = " (Intel's backend is the triton-xpu package, in its own venv)" if need == "intel" else ""
        return f"Triton {triton.__version__} has no {need} backend{hint}"
    return None


class _Utils:
    def __init__(self, t: Target):
        self.t = t

    def get_device_properties(self, device):
        return {"max_shared_mem": self.t.shared, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": self.t.warp, **(self.t.arch if isinstance(self.t.arch, dict) else {})}

    def load_binary(self, *args):   # nvidia / amd: (name, kernel, shared, device); intel: + build_flags
        return (None, None, 0, 0, 1024) if len(args) == 4 else (None, None, 0, 0)

    def unload_module(self, module):
        pass


class StandInDriver:
    """Triton's active-driver interface, enough to compile and to 'launch' (a no-op). Each target
    is its own device index, so Triton's per-device kernel caches never hand one target's binaries
    (or its compile target) to another."""

    def __init__(self, name: str):
        from triton.backends.compiler import GPUTarget
        t = TARGETS[name]
        self.target = GPUTarget(t.backend, t.arch, t.warp)
        self.utils = _Utils(t)
        self.device = list(TARGETS).index(name)

    def is_active(self):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.device

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        raise RuntimeError("stand-in driver: no device to benchmark on")

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None

    def get_benchmarker(self):
        """Autotuning finds every config equally fast without running it, so it keeps the first one,
        which the launch then compiles (compiling them all would cost minutes per target)."""
        def bench(kernel_call, quantiles=None, **kwargs):
            return [1.0] * len(quantiles) if quantiles else 1.0
        return bench


# Intel lowering shared between the targets of one process: (stage, its input, options) -> (output,
# the metadata the stage set, the target that ran it). See StandInXPUBackend.add_stages.
_LOWERED: dict = {}
_reused: dict = {}   # stage -> the target whose output the compile in progress reused


def _lowered_once(stage: str, run, options, arch: str):
    opts = repr(sorted(vars(options).items()))

    def once(src, metadata):
        key = (stage, hashlib.sha256(str(src).encode()).hexdigest(), opts)
        hit = _LOWERED.get(key)
        if hit is None:
            before = dict(metadata)
            out = run(src, metadata)
            _LOWERED[key] = (out, {k: v for k, v in metadata.items() if k not in before or before[k] != v}, arch)
            return out
        out, set_, by = hit
        if by != arch:
            _reused[stage] = by
        metadata.update(set_)
        return out
    return once


def _stand_in_xpu_backend(base):
    """Intel's compiler backend, with its SYCL arch helper (a C++ build) replaced by the table."""
    import inspect

    from triton.backends.compiler import BaseBackend

    # make_llir / make_spv see only (TTGIR or LLVM IR, metadata, options): the device enters through
    # make_ttgir (its module annotation is in the TTGIR text). A second Intel target whose TTGIR
    # equals the first's gets the same LLVM IR and SPIR-V: lower it once.
    pure = all(list(inspect.signature(getattr(base, f)).parameters) == ["src", "metadata", "options"]
               for f in ("make_llir", "make_spv"))

    class StandInXPUBackend(base):
        def __init__(self, target):
            BaseBackend.__init__(self, target)
            self.device_arch = platform.XPU_ARCHS.get(target.arch.get("architecture"), "")
            self.properties = self.parse_target(target.arch)
            self.binary_ext = "spv"

        def add_stages(self, stages, options, *rest):
            super().add_stages(stages, options, *rest)
            if pure:
                for stage in ("llir", "spv"):
                    stages[stage] = _lowered_once(stage, stages[stage], options, self.device_arch)
    return StandInXPUBackend


Spec = dict   # one compiled specialisation: kernel, key, warps, stages, binary, shared, dot, problem, reuses,
#              lowered_for (the target whose LLVM IR and SPIR-V it reused: the same TTGIR, see _lowered_once),
#              target; same_as (--family-once: the earlier target that lowered this program, not lowered here)

_DOT = re.compile(r"tt\.dot .*?: tensor<[0-9x]+x(\w+)>")


def _binary(t: Target, kernel) -> tuple[str, bytes]:
    asm = kernel.asm
    for kind in ("cubin", "hsaco", "spv"):
        if asm.get(kind):
            b = asm[kind]
            b = b if isinstance(b, bytes) else b.encode()
            return ("zebin" if b[:4] == b"\x7fELF" and kind == "spv" else kind), b
    return "", b""


_GLOBAL_WRITE = re.compile(r"^\s*(@!?%p\w+\s+)?(st\.global|red\.global|atom\.global|cp\.async\.bulk\.global)", re.M)


def pdl_problem(ptx: str, launch_pdl: bool) -> str:
    """'' or what breaks ops/common/pdl.py's contract in a kernel launched as a programmatic dependent:
    it must wait (griddepcontrol.wait) and write no global memory before the wait -- an earlier
    kernel may still read it (loads before the wait can be weights: not checked here)."""
    if not launch_pdl:
        return ""
    at = ptx.find("griddepcontrol.wait")
    if at < 0:
        return "launched as a programmatic dependent (launch_pdl) without griddepcontrol.wait"
    if _GLOBAL_WRITE.search(ptx[:at]):
        return "writes global memory before griddepcontrol.wait (launch_pdl)"
    return ""


def inspect_kernel(t: Target, kernel) -> tuple[str, int, str, str]:
    """(binary kind and size, shared bytes, dot summary, problem or '') of one compiled kernel."""
    kind, b = _binary(t, kernel)
    shared = int(kernel.metadata.shared or 0)
    problems = [] if b else [f"no {t.backend} binary produced"]
    if shared > t.shared:
        problems.append(f"needs {shared} bytes of shared memory, the device has {t.shared}")
    pdl = pdl_problem(kernel.asm.get("ptx", ""), bool(getattr(kernel.metadata, "launch_pdl", False)))
    if pdl:
        problems.append(pdl)
    dots = sorted(set(_DOT.findall(kernel.asm.get("ttir", ""))))
    dot = ""
    if dots:
        text = kernel.asm.get("ptx") or kernel.asm.get("amdgcn") or kernel.asm.get("llir") or ""
        if t.backend == "xpu":   # the DPAS layout, lowered to the sub-group matrix multiply-add builtins
            used = bool(re.search(r"#(triton_intel_gpu|ttig)\.dpas<", kernel.asm.get("ttgir", ""))) and (
                b"has_dpas: true" in b if kind == "zebin" else b"matrix_mad" in b)
        else:
            used = t.matrix in text
        dot = f"dot {'/'.join(dots)} -> {t.matrix if used else 'fma'}"
        if t.matrix and not used and any(d in ("bf16", "f16") for d in dots):
            problems.append(f"16-bit tl.dot compiled without {t.matrix}")
    return f"{kind} {len(b)} B", shared, dot, "; ".join(problems)


def ocloc(spirv: bytes, build_flags: str = "", device: str = "pvc") -> bytes:
    """Native code (zebin) for an Intel GPU from Triton's SPIR-V, as the driver would build it at
    load time; RuntimeError with ocloc's own log if it cannot."""
    exe = shutil.which("ocloc")
    if exe is None:
        raise RuntimeError("ocloc not found (Debian / Ubuntu: apt-get install intel-opencl-icd)")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.spv"), "wb") as f:
            f.write(spirv)
        cmd = [exe, "compile", "-file", "k.spv", "-spirv_input", "-device", device, "-output", "k",
               "-output_no_suffix", "-exclude_ir", "--format", "zebin"] + (["-options", build_flags] if build_flags else [])
        run = subprocess.run(cmd, cwd=d, capture_output=True, text=True, check=False)
        if run.returncode != 0 or not os.path.exists(os.path.join(d, "k")):
            raise RuntimeError(f"ocloc exited {run.returncode}: {(run.stdout + run.stderr).strip()[-3000:]}")
        with open(os.path.join(d, "k"), "rb") as f:
            return f.read()


def native_spec(spec: Spec, zebin: bytes) -> Spec:
    """`spec` rebuilt as native code: DPAS must survive where the SPIR-V had it."""
    dpas = re.search(rb"has_dpas:\s+true", zebin) is not None
    want = spec["dot"].endswith("-> dpas")
    dot = spec["dot"].rsplit("->", 1)[0] + ("-> dpas" if dpas else "-> fma") if spec["dot"] else ""
    return {**spec, "binary": f"zebin {len(zebin)} B", "dot": dot, "reuses": 0, "lowered_for": "",
            "problem": "zebin has no DPAS" if want and not dpas else ""}


class Recorder:
    """Compile hooks: list every specialisation Triton builds for the row being compiled, and skip
    one that differs from an earlier one only in Triton's specialisations of runtime arguments
    (divisibility hints, an int equal to 1): the same program, constants folded differently."""

    def __init__(self, t: Target, native: bool = False, family: dict | None = None):
        self.t, self.row, self.seen = t, None, {}
        self.native = {} if native else None   # kernel -> (spec, SPIR-V, build flags)
        # family: program key -> the spec an earlier target of this vendor built for it; such a
        # program is listed for this target (same_as) and not lowered again (compile_targets --family-once)
        self.family = family

    def begin(self, row):
        self.row, self.seen = row, {}

    def end(self):
        self.row = None

    @staticmethod
    def _key(fn, compile) -> tuple:
        """The program Triton builds, less its own specialisations of runtime arguments: divisibility
        hints (not in the key at all) and an int argument equal to 1 folded in as a constant (keyed
        as the i32 it otherwise is). None for an optional pointer stays: that drops code."""
        params = fn.jit_function.params
        folded = {params[k[0]].name for k, v in compile["constants"].items()
                  if isinstance(k, tuple) and len(k) == 1 and not params[k[0]].is_constexpr
                  and type(v) is int and v == 1}
        sig = tuple((k, "i32" if k in folded else str(v)) for k, v in compile["signature"].items())
        consts = tuple(sorted((str(k), repr(v)) for k, v in compile["constants"].items()
                              if not (isinstance(k, tuple) and params[k[0]].name in folded)))
        return fn.name, sig, consts, compile["num_warps"], compile["num_stages"]

    def before(self, *, key, repr, fn, compile, **kw):
        if self.row is None:
            return False
        k = self._key(fn, compile)
        spec = self.seen.get(k)
        if spec is not None:
            spec["reuses"] += 1
            return True      # Triton skips the compile and the (stand-in) launch
        first = self.family.get(k) if self.family is not None else None
        if first is not None and first["target"] != self.t.device.capability:
            spec = {**first, "reuses": 0, "same_as": first["target"], "target": self.t.device.capability}
            self.seen[k] = spec
            self.row["specs"].append(spec)
            return True
        _reused.clear()
        return False

    def after(self, *, key, repr, fn, compile, **kw):
        if self.row is None:
            return False
        kernel = fn.jit_function.device_caches[compile["device"]][0][key]
        binary, shared, dot, problem = inspect_kernel(self.t, kernel)
        consts = ",".join(f"{fn.jit_function.arg_names[k[0]] if isinstance(k, tuple) else k}={v}"
                          for k, v in compile["constants"].items() if not _is_dtype(v))
        ptrs = ",".join(str(v)[1:] for v in compile["signature"].values() if str(v).startswith("*"))
        spec = {"kernel": fn.name.rpartition(".")[2], "key": f"{ptrs}|{consts}", "warps": compile["num_warps"],
                "stages": compile["num_stages"], "binary": binary, "shared": shared, "dot": dot,
                "problem": problem, "reuses": 0, "lowered_for": _reused.get("llir", ""),
                "target": self.t.device.capability}
        self.seen[self._key(fn, compile)] = spec
        if self.family is not None:
            self.family.setdefault(self._key(fn, compile), spec)
        self.row["specs"].append(spec)
        if self.native is not None and binary.startswith("spv"):
            # one per kernel, preferring a specialisation that should reach DPAS
            had = self.native.get(spec["kernel"])
            if had is None or (spec["dot"].endswith("-> dpas") and not had[0]["dot"].endswith("-> dpas")):
                self.native[spec["kernel"]] = (spec, kernel.asm["spv"], kernel.metadata.build_flags)
        return False


def _is_dtype(v) -> bool:
    return "dtype" in type(v).__name__


@contextlib.contextmanager
def _hooks(pre, post):
    try:
        from triton import knobs  # Triton >= 3.4
        rt = knobs.runtime
        saved = rt.jit_cache_hook, rt.jit_post_compile_hook
        rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
        try:
            yield
        finally:
            rt.jit_cache_hook, rt.jit_post_compile_hook = saved
    except ImportError:
        from triton.runtime.jit import JITFunction  # Triton 3.3 (triton-xpu)
        saved = JITFunction.cache_hook, JITFunction.compiled_hook
        JITFunction.cache_hook, JITFunction.compiled_hook = pre, post
        try:
            yield
        finally:
            JITFunction.cache_hook, JITFunction.compiled_hook = saved


def _forget_autotuning():
    """Autotuners cache their pick per key, not per device: start each target afresh."""
    import gc

    from triton.runtime.autotuner import Autotuner
    for obj in gc.get_objects():
        if issubclass(type(obj), Autotuner):   # (type(): isinstance would touch deprecated proxies)
            obj.cache.clear()


@contextlib.contextmanager
def targeting(name: str, native: bool = False, family: dict | None = None):
    """Dispatch and compile as on `name`; yields the Recorder of what gets compiled (`family`: see
    Recorder)."""
    from triton.backends import backends
    from triton.runtime import driver

    t = TARGETS[name]
    rec = Recorder(t, native=native and name == "pvc", family=family)   # (Debian's ocloc predates BMG)
    attr = "_active" if "_active" in vars(driver) else "active"   # Triton 3.3 spells it `active`
    saved_driver, saved_backends = getattr(driver, attr), dict(backends)
    if t.backend == "xpu":
        backends["intel"] = dataclasses.replace(backends["intel"],
                                                compiler=_stand_in_xpu_backend(backends["intel"].compiler))
    driver.set_active(StandInDriver(name))
    _forget_autotuning()
    try:
        with platform.simulate(t.device, compiling=True), _hooks(rec.before, rec.after):
            yield rec
    finally:   # (not reset_active: on a machine without a GPU Triton cannot create its default driver)
        setattr(driver, attr, saved_driver)
        backends.clear()
        backends.update(saved_backends)
