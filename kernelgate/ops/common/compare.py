"""How an implementation's output is compared with its op's native reference (the parity
contract): float tensors by relative error ||a - b|| / ||b|| with no NaN anywhere, integer and
bool tensors exactly."""
from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero); b is moved to a's device."""
    a, b = a.double(), b.double().to(a.device)
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def assert_close(out, ref, rtol: float, what: str = "output") -> None:
    """Recursive comparison: float tensors by relative error (no NaN anywhere), integer and
    bool tensors exactly, tuples/lists element-wise, other values by equality."""
    if isinstance(ref, (tuple, list)):
        assert isinstance(out, (tuple, list)) and len(out) == len(ref), \
            f"{what}: got {type(out).__name__} of {len(out) if hasattr(out, '__len__') else '?'}, want {len(ref)}"
        for i, (o, r) in enumerate(zip(out, ref)):
            assert_close(o, r, rtol, f"{what}[{i}]")
        return
    if ref is None:
        assert out is None, f"{what}: expected None"
        return
    if not isinstance(ref, torch.Tensor):
        assert out == ref, f"{what}: {out!r} != {ref!r}"
        return
    assert isinstance(out, torch.Tensor), f"{what}: not a tensor"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    if not ref.dtype.is_floating_point:
        bad = (out.cpu() != ref.cpu()).sum().item()
        assert bad == 0, f"{what}: {bad} of {ref.numel()} elements differ"
        return
    o, r = out.float().cpu(), ref.float().cpu()
    nan_o, nan_r = torch.isnan(o), torch.isnan(r)
    assert torch.equal(nan_o, nan_r), f"{what}: {int(nan_o.sum())} NaN (reference has {int(nan_r.sum())}): unwritten output?"
    fin = torch.isfinite(r)
    assert torch.equal(torch.isfinite(o), fin), f"{what}: infinities differ"
    assert torch.equal(o[~fin & ~nan_r], r[~fin & ~nan_r]), f"{what}: infinities differ in sign"
    err = rel_err(o[fin], r[fin])
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"
