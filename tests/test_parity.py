"""Parity suite generated from the registry: every implementation that can run on this
machine against the op's native reference, over each op's cases and dtypes, with
NaN-poisoned outputs. Registering an implementation adds it here; nobody writes a test.
On a CPU machine, Triton implementations run under TRITON_INTERPRET=1."""
import pytest

from kernelgate import registry
from kernelgate.tools.testing import check_impl


def _params():
    out = []
    for op in registry.ops().values():
        for impl in op.impls.values():
            if impl.name == "native":
                continue
            for case in op.cases():
                for dtype in case.dtypes:
                    dt = str(dtype).replace("torch.", "")
                    out.append(pytest.param(op.name, impl.name, case, dtype,
                                            id=f"{op.name}-{impl.name}-{case.id}-{dt}"))
    return out


@pytest.mark.parametrize("op_name,impl_name,case,dtype", _params())
def test_parity(op_name, impl_name, case, dtype, device):
    op = registry.get(op_name)
    skip = check_impl(op, op.impls[impl_name], case, dtype, device)
    if skip:
        pytest.skip(skip)
