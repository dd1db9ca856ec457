"""Parity-check helpers (`kernelgate check`, the test suite) and the independent reference of the
model tests (transformers' Kimi Linear without fla)."""
from __future__ import annotations

import contextlib
import importlib
import sys

import torch

from ..ops.common.compare import assert_close, rel_err  # noqa: F401 - the tests' comparison


def _run(op, fn, case, dtype, device):
    from .. import alloc
    g = torch.Generator().manual_seed(1234)
    args, kwargs = case.make(device, dtype, g)
    with alloc.poisoned():
        out = fn(*args, **kwargs)
    bound = op.bind(args, kwargs)
    return out, {name: bound[name] for name in op.mutates}, (args, kwargs)


def check_impl(op, impl, case, dtype, device) -> str | None:
    """Run `impl` and the native reference on the same fresh inputs (outputs NaN-poisoned)
    and compare outputs and in-place updates. Returns a reason if the implementation cannot
    run this case here; raises AssertionError on a mismatch."""
    from .. import platform
    why = impl.unavailable(platform.current())
    if why:
        return f"{impl.name} cannot run here: {why}"
    args, kwargs = case.make(device, dtype, torch.Generator().manual_seed(1234))
    if impl.dtypes is not None and op.dtype_of(args, kwargs) not in impl.dtypes:
        return f"{impl.name} does not take {dtype}"
    reason = impl.supports(*args, **kwargs) if impl.supports else None
    if reason:
        return f"{impl.name} does not support this case: {reason}"
    ref, ref_mut, inputs = _run(op, op.reference, case, dtype, device)
    out, out_mut, _ = _run(op, impl.callable(), case, dtype, device)
    rtol = (impl.rtol or {}).get(dtype, op.rtol[dtype])
    if op.compare is not None:
        op.compare(out, ref, dtype, inputs)
    else:
        assert_close(out, ref, rtol)
    for name in op.mutates:
        if op.compare_mutated is not None:
            op.compare_mutated(name, out_mut[name], ref_mut[name], dtype)
        else:
            assert_close(out_mut[name], ref_mut[name], rtol, what=f"{name} (updated in place)")
    return None


@contextlib.contextmanager
def hf_modeling_masked(model_type: str):
    """transformers' `models/<model_type>/modeling_<model_type>` module imported while `import fla`
    fails, so it binds its own PyTorch fallbacks (fla's Triton kernels crash on CPU tensors --
    transformers up to 5.24 binds them at import whenever fla imports on a machine with a GPU -- and
    use TF32 / bf16 internally). The masked copy stays registered in sys.modules while the block
    runs, so that a model whose constructor builds parts through AutoModel (Qwen3.5-MoE's multimodal
    model builds its text model so) gets the masked classes too; the modules imported before are
    put back afterwards."""
    prefix = f"transformers.models.{model_type}"
    saved = {n: sys.modules.pop(n) for n in [n for n in sys.modules if n.startswith(prefix)]}
    saved_fla = sys.modules.get("fla", False)
    sys.modules["fla"] = None                      # `import fla` raises ImportError
    try:
        mod = importlib.import_module(f"{prefix}.modeling_{model_type}")
    finally:
        if saved_fla is False:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved_fla
    try:
        yield mod
    finally:
        for n in [n for n in sys.modules if n.startswith(prefix)]:
            del sys.modules[n]
        sys.modules.update(saved)


def hf_modeling_module(model_type: str, mask_fla: bool = True):
    """transformers' modeling module of `model_type`, an independent reference of the model tests and
    benchmarks: with mask_fla, the private copy of hf_modeling_masked (its classes keep working after
    the block); else the module as transformers imports it."""
    if not mask_fla:
        return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    with hf_modeling_masked(model_type) as mod:
        return mod


def hf_kimi_linear_module(mask_fla: bool = True):
    """transformers' kimi_linear modeling module (hf_modeling_module), checked to have bound its own
    PyTorch KDA where mask_fla."""
    mod = hf_modeling_module("kimi_linear", mask_fla)
    if not mask_fla:
        return mod
    assert "fla" not in mod.chunk_kimi_delta_attention.__module__, "transformers still bound fla kernels"
    return mod
