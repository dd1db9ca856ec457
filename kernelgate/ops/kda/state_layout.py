"""The layout the KDA Triton decode kernels address (their declarations check it per call)."""
from __future__ import annotations


def layout_reason(state, *tensors) -> str | None:
    """Rows may be strided (views into a packed buffer); heads and channels must be dense."""
    if not state.is_contiguous():
        return "state pool is not contiguous"
    for name, t, inner in tensors:
        if t is not None and (t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != inner)):
            return f"{name} has a non-dense inner layout (strides {tuple(t.stride())})"
    return None
