"""Kernels built after warm-up: each one is a first-use cost that a request paid.

The server warms up every shape its steps may meet (warmup.py), so that no request waits for a
compile, an autotune or a load from the kernel cache. What the warm-up missed shows up here.
`watch()` (at the start of the warm-up) records every Triton kernel specialization this process
builds; after `serving()` (at its end) each new one is logged once at WARNING on
`kernelgate.engine`, with the time it took and how it differs from the nearest specialization
the warm-up built -- the argument whose value, alignment or constant was not met:

    kernelgate: kernel _kda_step_kernel built during serving in 1.82 s (after warm-up); the warm-up's
    nearest build differs in: slots *i32 16-aligned -> *i32, N 64 -> i32

Triton specializes integer arguments on divisibility by 16 (and on being 1) and pointers on
16-byte alignment, besides the constexprs: those are what the difference names.
`count()` is how many kernels were built after `serving()` (0 where the warm-up covered the traffic).
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("kernelgate.engine")

_state: dict = {"count": 0, "started": {}, "installed": False, "serving": False, "seen": {}}


def _spec(compile: dict, arg_names: list) -> dict:
    """{argument: how this build specialized it}: its type, '16-aligned' / '%16' where Triton
    assumed divisibility by 16, the value of a constexpr."""
    sig = compile.get("signature") or {}
    consts = {k[0] if isinstance(k, tuple) and len(k) == 1 else k: v
              for k, v in (compile.get("constants") or {}).items()}
    attrs = (compile.get("configs") or [{}])[0] or {}
    divisible = {k[0] for k, v in attrs.items() if isinstance(k, tuple) and len(k) == 1 and "divisibility" in str(v)}
    out = {}
    for i, name in enumerate(arg_names):
        ty = sig.get(name, "?")
        if ty == "constexpr":
            out[name] = f"={consts.get(i)!r}"
        else:
            out[name] = ty + ((" 16-aligned" if ty.startswith("*") else " %16") if i in divisible else "")
    out["(launch)"] = f"warps {compile.get('num_warps')} stages {compile.get('num_stages')}"
    return out


def _before(*, key, **kw):
    _state["started"][str(key)] = time.perf_counter()


def _after(*, key, repr=None, fn=None, compile=None, **kw):
    t0 = _state["started"].pop(str(key), None)
    secs = time.perf_counter() - t0 if t0 is not None else float("nan")
    name = getattr(fn, "name", None) or (repr or "?").split("[")[0]
    jf = getattr(fn, "jit_function", None)
    spec = _spec(compile or {}, list(getattr(jf, "arg_names", None) or (compile or {}).get("signature", {})))
    seen = _state["seen"].setdefault(name, [])
    if _state["serving"]:
        _state["count"] += 1
        log.warning("kernelgate: kernel %s built during serving in %.2f s (after warm-up); %s",
                    name, secs, _difference(spec, seen))
    seen.append(spec)


def _difference(spec: dict, seen: list) -> str:
    if not seen:
        return "the warm-up never built it"
    diffs = [[f"{a} {old.get(a, '-')} -> {v}" for a, v in spec.items() if old.get(a) != v] for old in seen]
    best = min(diffs, key=len)
    return "the warm-up's nearest build differs in: " + (", ".join(best) or "nothing (a rebuild)")


def _chain(first, second):
    if first is None:
        return second

    def both(**kw):
        r = first(**kw)
        second(**kw)
        return r
    return both


def watch() -> bool:
    """Record every Triton kernel this process builds from now on. False where Triton (or its
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


def serving() -> None:
    """The warm-up is over: from now on each build is logged."""
    _state["serving"] = True


def count() -> int:
    return _state["count"]
