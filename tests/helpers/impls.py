"""Run one registered implementation directly, outputs NaN-poisoned; skip where it can't run."""
import pytest

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
