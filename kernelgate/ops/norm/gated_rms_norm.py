"""Gated RMSNorm (KDA output gate, Mamba2 / Zamba2 / FalconH1 gated norm, plain RMSNorm).

    norm_before_gate=True : y = rms(x) * w (+ b) * act(gate)
    norm_before_gate=False: y = rms(x * act(gate)) * w (+ b)

rms over groups of `group_size` channels (None = the whole row), math in fp32, output in
x's dtype. With `residual`, x' = x + residual (fp32) is normalised; `prenorm=True` returns
(y, x') with x' in residual's dtype (x's if no residual), or fp32 if `residual_in_fp32`.
`gate=None` is a plain RMSNorm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks
from ...triton_utils import compiled_needs_gpu
from ...registry import GPU_TRITON, Case, declare

ACTIVATIONS = ("sigmoid", "silu", "swish")
OP = "gated_rms_norm"


def _act(g: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.sigmoid(g) if activation == "sigmoid" else F.silu(g)


def gated_rms_norm_native(x, weight, gate=None, eps=1e-6, group_size=None, norm_before_gate=True,
                          activation="sigmoid", bias=None, residual=None, prenorm=False,
                          residual_in_fp32=False):
    """Gated RMSNorm reference: fp32 math, output in x.dtype."""
    D = x.shape[-1]
    G = D if group_size is None else group_size
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
    res_dtype = torch.float32 if residual_in_fp32 else (residual.dtype if residual is not None else x.dtype)
    residual_out = xf.to(res_dtype) if prenorm else None
    if gate is not None and not norm_before_gate:
        xf = xf * _act(gate.float(), activation)
    xg = xf.reshape(*xf.shape[:-1], D // G, G)
    y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).reshape(xf.shape)
    y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    if gate is not None and norm_before_gate:
        y = y * _act(gate.float(), activation)
    y = y.to(x.dtype)
    return (y, residual_out) if prenorm else y


def validate(x, weight, gate=None, eps=1e-6, group_size=None, norm_before_gate=True,
             activation="sigmoid", bias=None, residual=None, prenorm=False, residual_in_fp32=False):
    checks.tensor(OP, "x", x, dtype=checks.FLOATS)
    checks.require(x.dim() >= 1, OP, f"x must have at least 1 dim, got shape {tuple(x.shape)}")
    D = x.shape[-1]
    # an empty row has no RMS (0/0): a clear error rather than a division by zero inside the op
    checks.require(D > 0, OP, f"x last dim (channels) must be > 0, got shape {tuple(x.shape)}")
    checks.tensor(OP, "weight", weight, shape=(D,), dtype=checks.FLOATS, device=x.device)
    checks.tensor(OP, "bias", bias, shape=(D,), dtype=checks.FLOATS, device=x.device, optional=True)
    if gate is not None:
        checks.tensor(OP, "gate", gate, dtype=checks.FLOATS, device=x.device)
        checks.same_shape(OP, "gate", gate, "x", x)
    if residual is not None:
        checks.tensor(OP, "residual", residual, dtype=checks.FLOATS, device=x.device)
        checks.same_shape(OP, "residual", residual, "x", x)
    checks.require(activation in ACTIVATIONS, OP, f"activation {activation!r} not in {ACTIVATIONS}")
    checks.require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0, OP,
                   f"eps must be a number > 0, got {eps!r}")
    for name, flag in (("norm_before_gate", norm_before_gate), ("prenorm", prenorm),
                       ("residual_in_fp32", residual_in_fp32)):
        checks.require(isinstance(flag, bool), OP, f"{name} must be a bool, got {flag!r}")
    if group_size is not None:
        checks.require(isinstance(group_size, int) and not isinstance(group_size, bool) and group_size > 0
                       and D % group_size == 0, OP,
                       f"group_size {group_size} must be a positive divisor of the last dim {D}")


# -- parity cases: odd sizes, every contract switch ------------------------------------
def _case(rows, D, *, gate=True, group_size=None, nbg=True, act="sigmoid", bias=False,
          residual=False, prenorm=False, rfp32=False):
    def make(device, dtype, gen):
        r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
        shape = rows + (D,)
        x = r(*shape)
        w = (1 + 0.1 * torch.randn(D, generator=gen)).to(device=device, dtype=dtype)
        kw = dict(eps=1e-6, group_size=group_size, norm_before_gate=nbg, activation=act,
                  bias=r(D) if bias else None, residual=r(*shape) if residual else None,
                  prenorm=prenorm, residual_in_fp32=rfp32)
        return (x, w, r(*shape) if gate else None), kw
    parts = ["x".join(map(str, rows + (D,))), f"G{group_size}" if group_size else "",
             "nogate" if not gate else ("nbg" if nbg else "gbn") + f"-{act}",
             "bias" if bias else "", "res" if residual else "", "prenorm" if prenorm else "",
             "resfp32" if rfp32 else ""]
    return Case("-".join(p for p in parts if p), make)


def cases():
    return [
        _case((1,), 64),
        _case((63,), 60),
        _case((65,), 128, act="silu", nbg=False),
        _case((3, 5), 256, group_size=64),
        _case((17,), 96, group_size=32, nbg=False, act="silu", bias=True),
        _case((33,), 128, residual=True, prenorm=True),
        _case((7,), 128, residual=True, prenorm=True, rfp32=True, act="silu"),
        _case((9,), 60, prenorm=True),
        _case((31,), 200, gate=False),
        _case((2,), 4096),
        _case((3,), 9000, residual=True, prenorm=True, nbg=False, act="silu"),  # wider than one block
    ]


def _bytes(args, kwargs):
    x, w, gate = args
    n = x.numel() * x.element_size()
    return 2 * n + (gate.numel() * gate.element_size() if gate is not None else 0) + w.numel() * w.element_size()


def bench_cases():
    """The issue's target shapes (1M x 128: KDA output norm per head; 65536 x 4096: a wide hidden norm)
    and the batch-1 decode shape 32 x 128 (32 KDA heads), which is launch-bound on a GPU and
    small enough for `kernelgate bench gated_rms_norm --case 32x128` on a CPU (interpreter)."""
    def make(rows, D):
        def f(device, dtype, gen):
            x = torch.randn(rows, D, device=device, dtype=dtype)
            g = torch.randn(rows, D, device=device, dtype=dtype)
            w = torch.randn(D, device=device, dtype=dtype)
            return (x, w, g), dict(eps=1e-6)
        return f
    return [Case(f"{r}x{d}", make(r, d), dtypes=(torch.bfloat16,), bytes=_bytes)
            for r, d in ((1 << 20, 128), (65536, 4096), (32, 128))]


gated_rms_norm = declare(OP, gated_rms_norm_native, validate=validate, cases=cases,
                         bench_cases=bench_cases)


# -- implementations ---------------------------------------------------------------------
gated_rms_norm.implementation(
    "triton", ".gated_rms_norm_triton:gated_rms_norm_triton", provider="triton",
    platforms=GPU_TRITON, dtypes=checks.FLOATS, requires=("triton",), supports=compiled_needs_gpu,
    priority=10, doc="portable Triton kernel, full contract (groups, both gate orders, prenorm)")


# fla's rms_norm_gated reads each row as one block of at most 64 KB.
_FLA_MAX_ROW_BYTES = 65536


def _fla_supports(x, weight, gate=None, eps=1e-6, group_size=None, norm_before_gate=True,
                  activation="sigmoid", bias=None, residual=None, prenorm=False, residual_in_fp32=False):
    """Where fla-core 0.6's rms_norm_gated computes something else than this op (or cannot run)."""
    D = x.shape[-1]
    if gate is None:
        return "gate=None (plain RMSNorm): fla's rms_norm_gated always reads a gate"
    if group_size is not None and group_size != D:
        return f"group_size={group_size}: fla normalises whole rows only"
    if not norm_before_gate:
        return "norm_before_gate=False: fla gates after the norm only"
    if prenorm and residual is not None and residual_in_fp32 and residual.dtype != torch.float32:
        return (f"residual_in_fp32 with a {str(residual.dtype)[6:]} residual: fla returns the residual "
                "in the residual's dtype")
    if D * x.element_size() > _FLA_MAX_ROW_BYTES:
        return f"row of {D} x {x.element_size()} bytes exceeds fla's 64 KB per-row block"
    if x.device.type == "cpu":
        return "x is a CPU tensor: fla's kernels autotune and need a GPU"
    return None


def gated_rms_norm_fla(x, weight, gate=None, eps=1e-6, group_size=None, norm_before_gate=True,
                       activation="sigmoid", bias=None, residual=None, prenorm=False,
                       residual_in_fp32=False):
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    # fla's argument order is (x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps);
    # it takes "sigmoid", "silu" and "swish" like this op.
    out = rms_norm_gated(x, gate, weight, bias, activation=activation, residual=residual,
                         prenorm=prenorm, residual_in_fp32=residual_in_fp32, eps=eps)
    if prenorm and out[1].untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        # Without residual fla hands back x (a view of it: found on the H200) as the residual
        # stream; return a copy so the output never aliases an input.
        out = (out[0], x.clone())
    return out


gated_rms_norm.implementation(
    "fla", gated_rms_norm_fla, provider="fla", platforms=GPU_TRITON, dtypes=checks.FLOATS,
    requires=("fla", "triton-compiled"), supports=_fla_supports, priority=5,
    doc="fla-core rms_norm_gated (whole-row norm, then gate)")
