"""Independent KDA references for the tests: fla-core's naive code and HF transformers'
kimi_linear torch fallbacks (the undecorated functions, so no fla kernel is routed in)."""
import functools

import pytest
import torch

from kernelgate import platform, registry

from .impls import on_device


@functools.cache
def hf():
    mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

    def raw(f):
        return getattr(f, "__wrapped__", f)
    return dict(chunk=raw(mod.chunk_kimi_delta_attention), recurrent=raw(mod.recurrent_kimi_delta_attention),
                conv_fn=raw(mod.causal_conv1d_fn), conv_update=raw(mod.causal_conv1d_update),
                l2norm=mod.l2norm)


def fla_naive():
    return pytest.importorskip("fla.ops.kda.naive")


def fla_gate():
    return pytest.importorskip("fla.ops.kda.gate")


def runnable(op_name):
    """Implementations of an op that can run on this machine (platform declaration aside:
    Triton kernels run on CPU tensors under TRITON_INTERPRET=1)."""
    op = registry.get(op_name)
    return [pytest.param(name, id=name) for name in op.impls]


def need(op_name, impl_name):
    impl = registry.get(op_name).impls[impl_name]
    why = impl.unavailable(platform.current())
    if why:
        pytest.skip(f"{impl_name}: {why}")
    return impl


def call(op_name, impl_name, *args, **kwargs):
    """The implementation on this machine's device (helpers.impls.on_device: in-place state comes
    back into the host tensors); a host implementation on the host tensors."""
    impl = need(op_name, impl_name)
    if impl.provider in registry.HOST_PROVIDERS:
        return impl.callable()(*args, **kwargs)
    return on_device(impl.callable(), *args, **kwargs)


def tol(dtype, op_name=None, impl_name=None):
    """The parity bound at dtype; an implementation's own where the registry declares one (fla's
    chunk kernels run fp32 through TF32 dots on a GPU)."""
    base = 1e-4 if dtype == torch.float32 else 2e-2
    if op_name is None:
        return base
    return (registry.get(op_name).impls[impl_name].rtol or {}).get(dtype, base)
