"""Every KERNELGATE_* environment variable: its name, parser, default and meaning, in one place.

A variable is read (and checked) where it is used, through `get(name)`, never at import: a bad
value is one line naming the variable and what it takes, raised by the command that needs it
(`kernelgate --version` still answers with KERNELGATE_CHECKS=banana set).

    from kernelgate import envs
    if envs.get("KERNELGATE_GRAPHS"): ...
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import KernelgateError

_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _flag(raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError("expected 0 or 1")


def _graphs(raw: str) -> bool:
    if raw.strip() not in ("0", "1"):
        raise ValueError("must be 0 (eager decode) or 1 (device graphs)")
    return raw.strip() == "1"


def _seconds(raw: str) -> float:
    try:
        s = float(raw)
    except ValueError:
        s = -1.0
    if not (math.isfinite(s) and s > 0):
        raise ValueError("must be seconds > 0")
    return s


def _text(raw: str) -> str:
    return raw.strip()


@dataclass(frozen=True)
class Var:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str

    def get(self):
        raw = os.environ.get(self.name)
        if raw is None or not raw.strip():
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise KernelgateError(f"{self.name}={raw!r}: {e}") from None


VARS = {v.name: v for v in [
    Var("KERNELGATE_PLATFORM", _text, None,
        "decide dispatch as if on this platform (cuda, rocm, xpu, npu, mps, cpu); tensors stay on the real device"),
    Var("KERNELGATE_FORCE", _text, "", "force implementations: 'op=impl,op2=impl2' (unknown names are errors)"),
    Var("KERNELGATE_CHECKS", _flag, False,
        "1: every op call also checks its index values (slots, cu_seqlens, block ids) on the host"),
    Var("KERNELGATE_TRACE", _flag, False, "1: print each new dispatch choice (op -> implementation)"),
    Var("KERNELGATE_GRAPHS", _graphs, True, "0: decode eagerly instead of through captured device graphs"),
    Var("KERNELGATE_PDL", _flag, True,
        "0: launch the decode kernels without programmatic dependent launch (NVIDIA sm_90+ only)"),
    Var("KERNELGATE_CACHE_DIR", _text, None, "where compiled kernels persist (default ~/.cache/kernelgate)"),
    Var("KERNELGATE_DIST_TIMEOUT", _seconds, 300.0,
        "seconds a tensor-parallel collective waits for its peers before the job ends"),
    Var("KERNELGATE_DIST_FAULT", _text, "", "tests: 'RANK:COMMAND[:N]' makes that rank fail its N-th COMMAND"),
    Var("KERNELGATE_API_KEY", _text, None, "`kernelgate serve`'s API key when --api-key is not given"),
    Var("KERNELGATE_DEBUG", _flag, False, "1: the CLI shows the traceback of an unexpected error"),
]}


def get(name: str):
    """The parsed value of KERNELGATE_<...> (its default when unset or empty)."""
    return VARS[name].get()


def check_all() -> None:
    """Parse every variable that is set (the CLI does this first: one line per bad value)."""
    for v in VARS.values():
        v.get()
