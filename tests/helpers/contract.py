"""Shared by tests/ops/test_bad_inputs.py and tests/ops/test_fuzz.py: which implementations
run on CPU (native; Triton under TRITON_INTERPRET=1 with the platform simulated as cuda and
xpu), a call through the registry pinned to one of them, and views with other strides."""
import warnings

import pytest
import torch

from kernelgate import platform, registry

from .impls import on_device

# (simulated platform, implementation) per op; the CPU-runnable ones only.
TRITON = [("cuda", "triton"), ("xpu", "triton")]
IMPLS = {
    "gated_rms_norm": [("cpu", "native")] + TRITON,
    "short_conv": [("cpu", "native")] + TRITON,
    "short_conv_update": [("cpu", "native")] + TRITON,
    "kda_gate": [("cpu", "native")] + TRITON,
    "kda_prefill": [("cpu", "native")],
    "kda_decode": [("cpu", "native")] + TRITON,
    "kda_packed_decode": [("cpu", "native"), ("cpu", "chain"), ("cuda", "chain")] + TRITON,
    "gdn_gate": [("cpu", "native")],
    "gdn_prefill": [("cpu", "native")] + TRITON + [("xpu", "triton_recurrent")],
    "gdn_decode": [("cpu", "native")] + TRITON,
    "gdn_packed_decode": [("cpu", "native"), ("cpu", "chain")] + TRITON,
    "biased_grouped_topk": [("cpu", "native")] + TRITON,
    "fused_experts": [("cpu", "native"), ("cpu", "grouped_mm")] + TRITON + [("cuda", "triton_gemv"), ("xpu", "triton_gemv")],
    "silu_and_mul_clamp": [("cpu", "native")] + TRITON,
    "fused_q_indexer_rope_hadamard_quant": [("cpu", "native"), ("cuda", "triton_tok")] + TRITON,
    "indexer_k_quant_and_cache": [("cpu", "native")] + TRITON,
    "fp8_paged_mqa_logits": [("cpu", "native"), ("cuda", "triton_kq")] + TRITON,
    # w8a8 is dispatched only where the capability has fp8 MMA (sm_89+, gfx942, gfx950); a platform
    # simulated by name has no capability, so it runs forced, on the exact fp16 of the codes
    "fp8_linear": [("cpu", "native")] + TRITON + [("cuda", "triton_w8a8")],
    "fused_experts_fp8": [("cpu", "native")] + TRITON + [("cuda", "triton_gemv"), ("xpu", "triton_gemv")],
}


def compare(op_name, out, ref, rtol, what):
    """The op's own output comparison where it has one (fp8 codes), else assert_close."""
    from kernelgate.tools.testing import assert_close
    op = registry.get(op_name)
    if op.compare is not None:
        op.compare(out, ref, torch.float32, None)
    else:
        assert_close(out, ref, rtol, what=what)


def compare_state(op_name, name, out, ref, rtol, what):
    from kernelgate.tools.testing import assert_close
    op = registry.get(op_name)
    if op.compare_mutated is not None:
        op.compare_mutated(name, out, ref, torch.float32)
    else:
        assert_close(out, ref, rtol, what=what)


def params(op):
    return [pytest.param(op, plat, impl, id=f"{op}-{impl}-{plat}") for plat, impl in IMPLS[op]]


def all_params(ops=None):
    return [p for op in (ops or IMPLS) for p in params(op)]


def run(op_name, plat, impl, args, kwargs=None, layout_fallback=False):
    """One call pinned to (plat, impl). With `layout_fallback`, an implementation whose
    supports() declines these arguments (a declared layout) is not forced: dispatch picks.
    On a GPU machine a kernel implementation gets the arguments on the device, in the same
    layouts (`helpers.impls.on_device`), and what it writes comes back into the host tensors; on
    the CPU (Triton interpreted) the host tensors go in as they are."""
    kwargs = kwargs or {}
    with platform.simulate(plat):
        op = registry.get(op_name)
        chosen = op.impls[impl]
        plat_now = platform.current()
        why = chosen.unavailable(plat_now)
        if why:
            pytest.skip(f"{impl} on {plat}: {why}")
        if chosen.provider in registry.HOST_PROVIDERS:
            return _call(op, op_name, impl, args, kwargs, layout_fallback)
        return on_device(lambda *a, **k: _call(op, op_name, impl, a, k, layout_fallback), *args, **kwargs)


def _call(op, op_name, impl, args, kwargs, layout_fallback):
    if layout_fallback and op.impls[impl].rejects(platform.current(), args, kwargs, forced=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", registry.FallbackWarning)
            return op(*args, **kwargs)
    with registry.forcing({op_name: impl}):
        return op(*args, **kwargs)


def clone(args, kwargs=None):
    c = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
    return [c(a) for a in args], {k: c(v) for k, v in (kwargs or {}).items()}


# -- views with the same values and other strides --------------------------------------
LAYOUTS = ("dense", "offset", "rows2", "inner2", "colmajor")


def restride(t, layout):
    """A view holding t's values with another memory layout (a copy into a bigger buffer)."""
    if t is None or not isinstance(t, torch.Tensor) or t.dim() == 0 or layout == "dense":
        return t
    if layout == "offset":        # storage offset of 3 elements (also breaks 16-byte alignment)
        buf = torch.empty(t.numel() + 3, dtype=t.dtype, device=t.device)
        out = buf[3:].view(t.shape)
    elif layout == "rows2":       # every other row of a taller buffer
        buf = torch.empty(2 * t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
        out = buf[::2]
    elif layout == "inner2":      # every other element of the last dim
        buf = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        out = buf[..., ::2]
    elif layout == "colmajor":    # dims reversed in memory
        if t.dim() < 2:
            return restride(t, "rows2")
        out = t.permute(*reversed(range(t.dim()))).contiguous().permute(*reversed(range(t.dim())))
        return out
    else:
        raise ValueError(layout)
    out.copy_(t)
    return out
