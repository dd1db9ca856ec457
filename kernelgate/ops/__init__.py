"""Op families. Importing this package declares every op: each public module here declares
its op(s) with `registry.declare` and registers implementations. Triton kernels live in
`kernelgate/ops/triton/` and are imported lazily, so a missing Triton is a dispatch reason."""
from __future__ import annotations

import importlib
import pkgutil

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _m.name.startswith("_") and _m.name != "triton":
        importlib.import_module(f"{__name__}.{_m.name}")

# Importing `ops/gated_rms_norm.py` binds the *module* as `ops.gated_rms_norm`, which would
# shadow the op of the same name (`__getattr__` only sees missing names): rebind the ops.
from ..registry import OPS as _OPS  # noqa: E402

globals().update(_OPS)


def __getattr__(name: str):
    # `kernelgate.ops.gated_rms_norm(...)` is the registry op of that name.
    from ..registry import OPS
    if name in OPS:
        return OPS[name]
    raise AttributeError(name)
