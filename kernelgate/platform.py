"""Which platform we run on, and what it can do.

`current()` detects the real device (cuda, rocm, xpu, npu, mps, cpu) once. Setting
`KERNELGATE_PLATFORM=<name>` (or `simulate(name)`) makes dispatch decide as if it ran on
that platform while tensors stay on the real device: on a CPU machine with
`TRITON_INTERPRET=1` this exercises the XPU/ROCm choices through Triton's interpreter.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import os
from dataclasses import dataclass, field

import torch

PLATFORMS = ("cuda", "rocm", "xpu", "npu", "mps", "cpu")
# Platforms whose devices Triton compiles for.
TRITON_PLATFORMS = frozenset({"cuda", "rocm", "xpu"})
# Optional kernel libraries a provider may need: capability name -> import name.
LIBRARIES = {
    "triton": "triton",
    "fla": "fla",
    "sgl_kernel": "sgl_kernel",
    "vllm": "vllm",
    "torch_npu": "torch_npu",
}


class KernelgateError(ValueError):
    """Bad input or configuration; the message names the op, the argument and the constraint."""


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
        return "xpu", "xpu", None, torch.xpu.get_device_name(0)
    if library_reason("torch_npu") is None and torch.npu.is_available():  # type: ignore[attr-defined]
        return "npu", "npu", None, None
    if torch.backends.mps.is_available():
        return "mps", "mps", None, "Apple MPS"
    return "cpu", "cpu", None, None


def fp8_hardware(capability: str | None) -> bool:
    """Whether a device of this capability converts fp8 in hardware, which Triton's fp8 casts need:
    NVIDIA from sm_89 (Ada, Hopper, Blackwell; Triton rejects float8e4nv below), AMD gfx94x / gfx95x
    (MI300 / MI350) and gfx12. Elsewhere kernels decode fp8 bytes with integer ops (exact)."""
    if not capability:
        return False
    if capability.startswith("sm_"):
        return int(capability[3:]) >= 89
    return capability.startswith(("gfx94", "gfx95", "gfx12"))


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
    return Platform(name=name, device=device, real=name, capability=cap, device_name=dev_name,
                    triton=reason, triton_mode=mode, streams=_streams(device))


_simulated: list[str] = []


@functools.cache
def _platform_for(name: str | None, interp: bool) -> Platform:
    real = _real_platform()
    if name is not None and name not in PLATFORMS:
        raise KernelgateError(f"platform: KERNELGATE_PLATFORM={name!r} is not one of {', '.join(PLATFORMS)}")
    # `interp` is part of the cache key, so TRITON_INTERPRET is re-read on every refresh().
    mode, reason = _triton_state(real.device)
    if (name is None or name == real.name) and (mode, reason) == (real.triton_mode, real.triton):
        return real
    # A simulated platform decides dispatch; the real device still runs the kernels.
    return Platform(name=name or real.name, device=real.device, real=real.name, capability=real.capability,
                    device_name=real.device_name, triton=reason, triton_mode=mode,
                    streams=real.streams)


_current: list[Platform] = []


def current() -> Platform:
    """The platform dispatch decides for (cheap: cached until `refresh()` or `simulate()`)."""
    if not _current:
        name = _simulated[-1] if _simulated else (os.environ.get("KERNELGATE_PLATFORM") or None)
        _current.append(_platform_for(name, interpreting()))
    return _current[0]


def refresh() -> None:
    """Re-read KERNELGATE_PLATFORM / TRITON_INTERPRET and drop every cached dispatch choice."""
    _current.clear()
    for listener in _listeners:
        listener()


_listeners: list = []  # callbacks run whenever the platform may have changed


@contextlib.contextmanager
def simulate(name: str):
    """Dispatch as if on platform `name` inside the block."""
    _platform_for(name, interpreting())  # validate the name now
    _simulated.append(name)
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
