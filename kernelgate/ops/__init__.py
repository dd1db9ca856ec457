"""Op families. Importing this package declares every op: each public module here declares
its op(s) with `registry.declare` and registers implementations. Triton kernels live in
`kernelgate/ops/triton/` and are imported lazily, so a missing Triton is a dispatch reason."""
from __future__ import annotations

import importlib
import pkgutil

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _m.name.startswith("_") and not _m.ispkg:
        importlib.import_module(f"{__name__}.{_m.name}")


def __getattr__(name: str):
    # `kernelgate.ops.gated_rms_norm(...)` is the registry op of that name.
    from ..registry import OPS
    if name in OPS:
        return OPS[name]
    raise AttributeError(name)
