"""Which platform we run on, and what it can do.

`current()` detects the real device (cuda, rocm, xpu, npu, mps, cpu) once. Setting
`KERNELGATE_PLATFORM=<name>` (or `simulate(name)`) makes dispatch decide as if it ran on
that platform while tensors stay on the real device: on a CPU machine with
`TRITON_INTERPRET=1` this exercises the XPU/ROCm choices through Triton's interpreter.
`simulate(Device(...))` goes further and stands in for one GPU model (capability and the
properties its runtime reports), which is how `compile_targets` builds kernels for GPUs
this machine does not have.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import os
from dataclasses import dataclass, field

import torch

from . import envs, kernel_cache
from .errors import KernelgateError

kernel_cache.configure()   # before anything compiles: kernels persist between runs

PLATFORMS = ("cuda", "rocm", "xpu", "npu", "mps", "cpu")
# Platforms whose devices Triton compiles for.
TRITON_PLATFORMS = frozenset({"cuda", "rocm", "xpu"})
# Why kernelgate compiles no Triton kernels for a platform (doctor shows it per implementation).
NO_TRITON = {
    "npu": "no Triton kernel is declared for Ascend NPU: triton-ascend lowers Triton only as far as HIVM IR "
           "without CANN (its final compiler, hivmc, ships with CANN), so none is compiled or tested for NPU",
    "mps": "Triton has no Apple MPS backend",
}
# Optional kernel libraries a provider may need: capability name -> import name.
LIBRARIES = {
    "triton": "triton",
    "fla": "fla",
    "sgl_kernel": "sgl_kernel",
    "vllm": "vllm",
    "torch_npu": "torch_npu",
}


# SYCL's `architecture` id (torch.xpu.get_device_capability()["architecture"]) -> the name Triton's
# Intel backend compiles for (and kernelgate's XPU capability string).
XPU_ARCHS = {
    0x030DC00800: "dg2",   # Arc A770 / A750 (ACM-G10, Xe-HPG)
    0x030E000500: "dg2",   # Arc A380 (ACM-G11)
    0x030F000700: "pvc",   # Data Center GPU Max 1100 / 1550 (Xe-HPC)
    0x030F400700: "pvc",   # Max 1100 VG
    0x0311C00400: "mtl",   # Meteor Lake H iGPU
    0x0500400400: "bmg",   # Arc B580 / B570 (BMG-G21, Xe2-HPG)
    0x0501000400: "lnl",   # Lunar Lake iGPU
}


@dataclass(frozen=True)
class Platform:
    name: str                     # what dispatch decides for
    device: str                   # torch device type tensors live on ("cuda", "cpu", ...)
    real: str                     # the platform actually detected
    capability: str | None        # e.g. "sm_90", "gfx942"
    device_name: str | None
    triton: str | None            # None if usable, else the reason it is not
    triton_mode: str | None       # "compiled" | "interpreter" | None
    streams: bool                 # side streams available on the real device
    libraries: dict = field(default_factory=dict)  # name -> version or "unavailable: reason"
    properties: dict = field(default_factory=dict)  # XPU: torch.xpu.get_device_capability()

    @property
    def simulated(self) -> bool:
        return self.name != self.real

    def library(self, name: str) -> str | None:
        """None if `name` imports, else why not (imported lazily, once)."""
        return library_reason(name)

    def as_dict(self) -> dict:
        return {
            "platform": self.name, "real": self.real, "simulated": self.simulated,
            "device": self.device, "device_name": self.device_name,
            "capability": self.capability, "triton": self.triton_mode or f"unavailable: {self.triton}",
            "streams": self.streams,
            "libraries": {n: library_version(n) or f"unavailable: {library_reason(n)}" for n in LIBRARIES},
        }


@functools.cache
def _import(name: str):
    """(module, None) or (None, reason). A broken library is a reason, never an import error."""
    modname = LIBRARIES.get(name, name)
    try:
        return importlib.import_module(modname), None
    except Exception as e:  # noqa: BLE001 - any failure of an optional library is a reason
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"{modname} does not import ({type(e).__name__}: {first})"


def library_reason(name: str) -> str | None:
    return _import(name)[1]


def library_version(name: str) -> str | None:
    if library_reason(name):
        return None
    mod = _import(name)[0]
    version = getattr(mod, "__version__", None)
    if version is None:
        for dist in (name, name.replace("_", "-"), "fla-core" if name == "fla" else name):
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
    return version or "installed"


def _detect_real() -> tuple[str, str, str | None, str | None]:
    """(platform, torch device type, capability, device name)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if getattr(torch.version, "hip", None):
            return "rocm", "cuda", getattr(props, "gcnArchName", None), props.name
        major, minor = torch.cuda.get_device_capability(0)
        return "cuda", "cuda", f"sm_{major}{minor}", props.name
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        arch = torch.xpu.get_device_capability(0).get("architecture")
        return "xpu", "xpu", XPU_ARCHS.get(arch), torch.xpu.get_device_name(0)
    if library_reason("torch_npu") is None and torch.npu.is_available():  # type: ignore[attr-defined]
        return "npu", "npu", None, None
    if torch.backends.mps.is_available():
        return "mps", "mps", None, "Apple MPS"
    return "cpu", "cpu", None, None


def fp8_hardware(capability: str | None) -> bool:
    """Whether a device of this capability converts fp8 in hardware, which Triton's fp8 casts need:
    NVIDIA from sm_89 (Ada, Hopper, Blackwell; Triton rejects float8e4nv below), AMD gfx94x / gfx95x
    (MI300 / MI350) and gfx12. Intel PVC / BMG / DG2 have none (Triton's Intel backend converts in
    software). Elsewhere kernels decode fp8 bytes with integer ops (exact)."""
    if not capability:
        return False
    if capability.startswith("sm_"):
        return int(capability[3:]) >= 89
    return capability.startswith(("gfx94", "gfx95", "gfx12"))


def fp8_mma(capability: str | None) -> bool:
    """Whether a device of this capability multiplies fp8 x fp8 in its matrix units (what an fp8
    tl.dot lowers to): NVIDIA from sm_89, AMD gfx94x (MI300: e4m3fnuz) and gfx95x (MI350). gfx12's
    fp8 WMMA is left out (not compiled or measured here); Intel PVC / BMG have none."""
    if not capability:
        return False
    if capability.startswith("sm_"):
        return int(capability[3:]) >= 89
    return capability.startswith(("gfx94", "gfx95"))


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _triton_state(device: str) -> tuple[str | None, str | None]:
    """(mode, reason): Triton compiled for a GPU, interpreted on CPU tensors, or why not."""
    reason = library_reason("triton")
    if reason:
        return None, reason
    if interpreting():
        return "interpreter", None
    if device == "cpu":
        return None, "no GPU driver for Triton on a CPU device (set TRITON_INTERPRET=1 to interpret)"
    if device == "mps":
        return None, "Triton has no MPS backend"
    return "compiled", None


def _streams(device: str) -> bool:
    if device == "cpu":
        return False
    try:
        torch.Stream(device=device)
        return True
    except Exception:  # noqa: BLE001
        return False


@functools.cache
def _real_platform() -> Platform:
    name, device, cap, dev_name = _detect_real()
    mode, reason = _triton_state(device)
    props = torch.xpu.get_device_capability(0) if name == "xpu" else {}
    return Platform(name=name, device=device, real=name, capability=cap, device_name=dev_name,
                    triton=reason, triton_mode=mode, streams=_streams(device), properties=props)


@dataclass(frozen=True)
class Device:
    """One GPU model as its runtime reports it, to decide and compile for it without having it."""
    platform: str                 # "cuda" | "rocm" | "xpu"
    capability: str               # "sm_90", "gfx942", "pvc" (XPU: Triton's arch name, see XPU_ARCHS)
    name: str                     # as torch.<device>.get_device_name() reports it
    properties: dict = field(default_factory=dict, hash=False)  # XPU: torch.xpu.get_device_capability()


_simulated: list = []   # platform names or (Device, compiling)


@functools.cache
def _platform_for(name: str | None, interp: bool) -> Platform:
    real = _real_platform()
    if name is not None and name not in PLATFORMS:
        raise KernelgateError(f"platform: KERNELGATE_PLATFORM={name!r} is not one of {', '.join(PLATFORMS)}")
    # `interp` is part of the cache key, so TRITON_INTERPRET is re-read on every refresh().
    mode, reason = _triton_state(real.device)
    if (name is None or name == real.name) and (mode, reason) == (real.triton_mode, real.triton):
        return real
    if name == "cpu":   # as on a CPU machine: host tensors, Triton only through the interpreter
        mode, reason = _triton_state("cpu")
        return Platform(name="cpu", device="cpu", real=real.name, capability=None, device_name=None,
                        triton=reason, triton_mode=mode, streams=False)
    # A simulated GPU platform decides dispatch; the real device still runs the kernels.
    return Platform(name=name or real.name, device=real.device, real=real.name, capability=real.capability,
                    device_name=real.device_name, triton=reason, triton_mode=mode,
                    streams=real.streams)


_current: list[Platform] = []


def current() -> Platform:
    """The platform dispatch decides for (cheap: cached until `refresh()` or `simulate()`)."""
    if not _current:
        sim = _simulated[-1] if _simulated else None
        if isinstance(sim, tuple):
            _current.append(_platform_of_device(*sim))
        else:
            name = sim or envs.get("KERNELGATE_PLATFORM")
            _current.append(_platform_for(name, interpreting()))
    return _current[0]


def _platform_of_device(dev: Device, compiling: bool) -> Platform:
    base = _platform_for(dev.platform, interpreting())
    if compiling:  # a stand-in Triton driver compiles for `dev`; launches take this machine's tensors
        base = dataclasses.replace(base, triton=None, triton_mode="compiled")
    return dataclasses.replace(base, capability=dev.capability, device_name=dev.name,
                               properties=dict(dev.properties))


def refresh() -> None:
    """Re-read KERNELGATE_PLATFORM / TRITON_INTERPRET and drop every cached dispatch choice."""
    _current.clear()
    for listener in _listeners:
        listener()


_listeners: list = []  # callbacks run whenever the platform may have changed


@contextlib.contextmanager
def simulate(name: str | Device, *, compiling: bool = False):
    """Dispatch as if on platform `name` inside the block; given a `Device`, as if on that GPU
    (its platform, capability and properties). `compiling=True` (compile_targets): Triton, driven
    by a stand-in for that device, compiles real binaries for it from this machine's tensors."""
    dev = name if isinstance(name, Device) else None
    _platform_for(dev.platform if dev else name, interpreting())  # validate the name now
    _simulated.append((dev, compiling) if dev else name)
    refresh()
    try:
        yield current()
    finally:
        _simulated.pop()
        refresh()


def default_device() -> torch.device:
    return torch.device(_real_platform().device)


# torch.distributed backend each platform's devices talk through (tensor / expert parallel)
COLLECTIVE_BACKENDS = {
    "cuda": ("nccl", "NCCL: NVLink / PCIe / InfiniBand collectives on device memory, capturable in CUDA graphs"),
    "rocm": ("nccl", "RCCL, which ROCm builds of torch register as the 'nccl' backend"),
    "xpu": ("xccl", "oneCCL through torch's built-in XCCL backend (torch >= 2.8)"),
    "npu": ("hccl", "HCCL, registered by torch_npu for Ascend devices"),
    "mps": ("gloo", "no collective library for Apple GPUs: Gloo over host memory"),
    "cpu": ("gloo", "no accelerator: Gloo collectives over TCP on host memory"),
}


def collective_backend(p: Platform | None = None) -> tuple[str, str]:
    """(torch.distributed backend, reason) declared for platform `p` (default: current())."""
    p = p or current()
    return COLLECTIVE_BACKENDS[p.name]


def collective_line(p: Platform | None = None) -> str:
    """The line `kernelgate doctor` shows for the collective backend."""
    p = p or current()
    backend, reason = collective_backend(p)
    line = f"collectives: {backend} ({reason})"
    if p.simulated and COLLECTIVE_BACKENDS[p.real][0] != backend:
        line += f"; simulated: runs use {COLLECTIVE_BACKENDS[p.real][0]}, the {p.real} device's backend"
    return line
