"""Run one registered implementation directly, outputs NaN-poisoned; skip where it can't run.
Run a function on the dispatch platform's device with host-built arguments (the tests build
their problems on the host, the interpreter's tensors; on a GPU machine kernels take device ones)."""
import pytest
import torch

from kernelgate import alloc, platform, registry


def poisoned_impl(op: str, name: str):
    impl = registry.get(op).impls[name]
    why = impl.unavailable(platform.current())
    if why:
        pytest.skip(why)
    fn = impl.callable()
    host = impl.provider in registry.HOST_PROVIDERS

    def call(*args, **kwargs):
        with alloc.poisoned():
            return fn(*args, **kwargs) if host else on_device(fn, *args, **kwargs)
    return call


def on_device(fn, *args, **kwargs):
    """fn(*args, **kwargs) with every host tensor replaced by one on the platform's device with the
    same shape, strides and storage offset (its whole storage copied), written back into the host
    storage afterwards (state updated in place); tensor results come back to the host. Host hints
    (`cu_seqlens_cpu` and the like) stay on the host. On the CPU, and under the interpreter, fn
    gets the host tensors as they are."""
    plat = platform.current()                  # (a platform simulated as the CPU keeps the host)
    if plat.device == "cpu" or plat.triton_mode == "interpreter":
        return fn(*args, **kwargs)
    pairs = []

    def move(t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        n = t.untyped_storage().nbytes() // t.element_size()
        whole = t.new_empty(0).set_(t.untyped_storage(), 0, (n,), (1,))
        dev = whole.to(plat.device)
        pairs.append((whole, dev))
        return dev.as_strided(t.shape, t.stride(), t.storage_offset())
    try:
        out = fn(*map(move, args), **{k: v if k.endswith("_cpu") else move(v) for k, v in kwargs.items()})
    finally:
        for whole, dev in pairs:
            whole.copy_(dev)
    if isinstance(out, tuple):   # (a named tuple keeps its type)
        back = [o.cpu() if isinstance(o, torch.Tensor) else o for o in out]
        return type(out)(*back) if hasattr(out, "_fields") else tuple(back)
    return out.cpu() if isinstance(out, torch.Tensor) else out


def on_platform(args):
    """The tensors of `args` (a tuple / list / dict) on the dispatch platform's device (a GPU machine's
    device when a GPU platform is simulated there, the host on the CPU): for tests of what dispatch
    chooses, which a host tensor would turn away from every kernel on a GPU machine."""
    dev = platform.current().device
    to = lambda a: a.to(dev) if isinstance(a, torch.Tensor) else a  # noqa: E731
    if isinstance(args, dict):
        return {k: to(v) for k, v in args.items()}
    return type(args)(to(a) for a in args)
