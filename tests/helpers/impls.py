"""Run one registered implementation directly, outputs NaN-poisoned; skip where it can't run.
Run a function on this machine's device with host-built arguments."""
import pytest
import torch

from kernelgate import alloc, platform, registry


def poisoned_impl(op: str, name: str):
    impl = registry.get(op).impls[name]
    why = impl.unavailable(platform.current())
    if why:
        pytest.skip(why)
    fn = impl.callable()

    def call(*args, **kwargs):
        with alloc.poisoned():
            return fn(*args, **kwargs)
    return call


def on_device(fn, *args, **kwargs):
    """fn on this machine's device (problems are built on the host, the interpreter's tensors; on a
    GPU its kernels take device tensors), tensor results back on the host."""
    dev = platform.default_device()

    def to(a):
        return a.to(dev) if isinstance(a, torch.Tensor) else a
    out = fn(*map(to, args), **{k: to(v) for k, v in kwargs.items()})
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()
