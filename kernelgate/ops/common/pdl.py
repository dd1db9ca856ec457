"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A one-token decode step is a chain of small dependent kernels (~13 a layer, 2-15 µs each); between
two of them the device drains one grid and launches the next. On NVIDIA sm_90+ a kernel launched
with `launch_pdl=True` may be launched while its predecessor still runs: its programs start, and
wait at `griddepcontrol.wait` until the predecessor has finished and its writes are visible.

The contract of a kernel written for it (`PDL: tl.constexpr` among its parameters):
  - it calls `inputs_ready(PDL)` before it reads anything an earlier kernel wrote, and before it
    writes anything (an earlier kernel may still be reading the buffer); before the call it may
    read only what no kernel of the step writes (weights, parameters: a first weight tile
    loaded there overlaps the predecessor's tail);
  - `inputs_ready` lets the next PDL kernel launch (once every program of this one has reached
    the call), then waits: the next kernel's programs start while this one still waits or runs,
    read their own weights, and wait in turn. `griddepcontrol.wait` waits for the predecessor's
    completion and the visibility of its writes whenever the trigger came, and a kernel completes
    only after its own wait returned, so each kernel still runs after the whole chain before it.
    Trigger-then-wait measured against wait-then-trigger in the same device call (H200, Session 29,
    bench/RESULTS.md): Qwen3.5-MoE 40 layers B1 397.0 / 396.9 against 394.7 / 394.9 tok/s, Kimi
    27 layers bf16 B1 403.4 / 402.7 against 399.8 / 400.5, FP8 462.8 / 461.0 against 459.4 / 460.5,
    B64 unchanged; logits bitwise equal with PDL on and off (Qwen3.5-MoE, Kimi FP8).
  - it launches with `**pdl_args()`: {"PDL": True, "launch_pdl": True} on compiled CUDA of
    capability 9.0 or more with KERNELGATE_PDL on, else {"PDL": False} -- the call compiles away
    (AMD, Intel, sm_80, the interpreter) and the launch is an ordinary one.
Kernels without it (torch's, cuBLAS, other Triton kernels) launch as usual and wait for the whole
predecessor, PDL or not. Captured device graphs keep the programmatic edges.
Measured (H200, bench/RESULTS.md Session 27): a GEMV / RMSNorm chain in a CUDA graph
(bench/ops/variants/pdl_chain.py) 2.72 -> 2.32 µs a kernel with 8 MB GEMVs, 3.85 -> 3.02 with 16 MB;
Qwen3.5-MoE decode at batch 1, 40 layers, 342.5 -> 370.5 tok/s with the linear GEMV; logits bitwise
equal with PDL on and off (bench/probes/pdl_bitwise.py: Qwen3.5-MoE, Kimi, Kimi FP8; batch 1 and 5).
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from ... import envs, platform

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:      # a Triton without NVIDIA's extras: PDL is never on there (pdl_args)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def inputs_ready(PDL: tl.constexpr):
    """Let the next PDL kernel launch, then wait for the previous kernel (its writes visible)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def pdl_args() -> dict:
    """Launch arguments of a PDL kernel on the current platform (see the module docstring)."""
    p = platform.current()
    return _args(p.name, p.triton_mode, p.capability)


@functools.lru_cache(maxsize=None)
def _args(name, mode, capability) -> dict:
    return {"PDL": True, "launch_pdl": True} if enabled(name, mode, capability) else {"PDL": False}


platform._listeners.append(_args.cache_clear)   # KERNELGATE_PDL is re-read on platform.refresh()


def enabled(name: str, mode: str | None, capability: str | None) -> bool:
    """Whether kernels launch with PDL on a platform (its name, Triton mode and capability)."""
    cap = capability or ""
    return (name == "cuda" and mode == "compiled" and gdc_wait is not None
            and cap.startswith("sm_") and int(cap[3:]) >= 90 and envs.get("KERNELGATE_PDL"))


def line(plat) -> str:
    """`kernelgate doctor`'s line on it."""
    if enabled(plat.name, plat.triton_mode, plat.capability):
        return "launches  decode kernels as programmatic dependents (PDL; KERNELGATE_PDL=0 turns it off)"
    if plat.name == "cuda" and plat.triton_mode == "compiled" and envs.get("KERNELGATE_PDL") is False:
        why = "KERNELGATE_PDL=0"
    elif plat.name == "cuda" and plat.triton_mode == "compiled" and gdc_wait is None:
        why = "this Triton has no griddepcontrol"
    else:
        why = "NVIDIA sm_90 and newer, compiled Triton, only"
    return f"launches  one after another (no PDL: {why})"
