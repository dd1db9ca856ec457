"""Op families, one folder each (norm, conv, kda, moe, indexer, mla; shared helpers in common/).

Importing this package declares every op. An op file `<family>/<op>.py` holds the native
reference, validation, parity / bench cases and the declaration; its kernels sit beside it
(`<family>/<op>_triton.py`), referenced relatively and imported on first use, so a missing
Triton is a dispatch reason. `kernelgate.ops.<op>(...)` is the registry op of that name."""
from __future__ import annotations

import importlib
import pkgutil

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.ispkg and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

# Op names win over any module of the same name (`__getattr__` only sees missing names).
from ..registry import OPS as _OPS  # noqa: E402

globals().update(_OPS)


def __getattr__(name: str):
    # `kernelgate.ops.gated_rms_norm(...)` is the registry op of that name.
    from ..registry import OPS
    if name in OPS:
        return OPS[name]
    raise AttributeError(name)
