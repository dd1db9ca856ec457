"""Kernels built after warm-up: each one is a first-use cost that a request paid.

The server warms up every shape its steps may meet (warmup.py), so that no request waits for a
compile, an autotune or a load from the kernel cache. What the warm-up missed shows up here:
after `watch()`, every Triton kernel specialization this process builds (compiled, or loaded
from the disk cache) is logged once at WARNING on `kernelgate.engine`, with the time it took:

    kernelgate: kernel _gate_up_kernel built during serving in 1.82 s (after warm-up): BLOCK_M=128, ...

`count()` is how many there were (0 in a server whose warm-up covers its traffic).
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("kernelgate.engine")

_state = {"count": 0, "started": {}, "installed": False}


def _constants(compile: dict) -> str:
    """The kernel's constexpr values (BLOCK sizes and flags), as Triton hands them to the hook."""
    consts = compile.get("constants") or {}
    items = [(k[-1] if isinstance(k, tuple) else k, v) for k, v in consts.items()]
    named = [f"{k}={v}" for k, v in items if isinstance(k, str) and k.isupper()]
    return ", ".join(named[:8]) + (f", num_warps={compile.get('num_warps')}, num_stages={compile.get('num_stages')}"
                                   if "num_warps" in compile else "")


def _before(*, key, fn=None, **kw):
    _state["started"][str(key)] = time.perf_counter()


def _after(*, key, repr=None, fn=None, compile=None, **kw):
    t0 = _state["started"].pop(str(key), None)
    secs = time.perf_counter() - t0 if t0 is not None else float("nan")
    _state["count"] += 1
    name = getattr(fn, "name", None) or (repr or "?").split("[")[0]
    log.warning("kernelgate: kernel %s built during serving in %.2f s (after warm-up): %s",
                name, secs, _constants(compile or {}))


def _chain(first, second):
    if first is None:
        return second

    def both(**kw):
        r = first(**kw)
        second(**kw)
        return r
    return both


def watch() -> bool:
    """From now on, log every Triton kernel this process builds. False where Triton (or its
    compile hooks, triton >= 3.3) is missing; hooks already installed keep running first."""
    if _state["installed"]:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = knobs.runtime
    rt.jit_cache_hook = _chain(rt.jit_cache_hook, _before)
    rt.jit_post_compile_hook = _chain(rt.jit_post_compile_hook, _after)
    _state["installed"] = True
    return True


def count() -> int:
    return _state["count"]
