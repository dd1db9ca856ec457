"""Compile every Triton implementation for GPUs this machine does not have.

    python -m kernelgate.compile_targets [sm_80 sm_90 gfx90a gfx942 ...]

For each target, every registry implementation that needs Triton is called on each of its
op's parity cases (CPU tensors) while Triton's active driver is a stand-in that reports that
target and launches nothing: the launch code takes the choices it would take on that GPU
(CONFIG vs portable forms, fp8 hardware or integer decode, TMA on sm_90) and Triton compiles
them all the way to the target's binary (cubin through ptxas, hsaco through LLVM's AMDGPU
backend -- both ship with Triton). Nothing is executed, so outputs are not checked here:
the parity suite checks numbers (GPU, or CPU under the interpreter); this checks that a
kernel the dispatch would pick on an A100, H100, MI250 or MI300 compiles there at all
(Triton rejects fp8 casts before sm_89; LLVM aborts on fp8 conversions for gfx90a).

Run it without TRITON_INTERPRET (the kernels must be JIT functions, not interpreted ones);
`tests/test_compile_targets.py` runs it in a subprocess. Prints one line per (target,
implementation) and exits non-zero if any failed.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback

import torch

# target name -> (Triton backend, arch, warp size, shared memory per block in bytes)
TARGETS = {
    "sm_80": ("cuda", 80, 32, 166912),       # A100
    "sm_90": ("cuda", 90, 32, 232448),       # H100 / H200
    "gfx90a": ("hip", "gfx90a", 64, 65536),  # MI250
    "gfx942": ("hip", "gfx942", 64, 65536),  # MI300
}


class _Utils:
    def __init__(self, shared: int):
        self.shared = shared

    def get_device_properties(self, device):
        return {"max_shared_mem": self.shared, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        return None, None, 0, 0, 1024        # module, function, regs, spills, max threads

    def unload_module(self, module):
        pass


class StandInDriver:
    """Triton's active-driver interface, enough to compile and to 'launch' (a no-op)."""

    def __init__(self, name: str):
        from triton.backends.compiler import GPUTarget
        backend, arch, warp, shared = TARGETS[name]
        self.target = GPUTarget(backend, arch, warp)
        self.utils = _Utils(shared)

    def is_active(self):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None

    def get_benchmarker(self):
        """Autotuning finds every config equally fast without running it, so it keeps the first one,
        which the launch then compiles (compiling them all would cost minutes per target)."""
        def bench(kernel_call, quantiles=None, **kwargs):
            return [1.0] * len(quantiles) if quantiles else 1.0
        return bench


@contextlib.contextmanager
def targeting(name: str):
    """Dispatch and compile as on `name`: the platform reports that GPU, Triton's driver is the
    stand-in, and the launchers' vendor check sees CPU tensors as that vendor's."""
    import dataclasses

    from triton.runtime import driver

    from . import platform, triton_utils
    backend = TARGETS[name][0]
    plat = dataclasses.replace(platform.current(), name="cuda" if backend == "cuda" else "rocm",
                               real="cuda" if backend == "cuda" else "rocm", capability=name,
                               triton=None, triton_mode="compiled", device_name=f"stand-in {name}")
    saved = platform.current, triton_utils.nvidia, torch.version.hip, driver._active
    platform.current = lambda: plat
    triton_utils.nvidia = lambda device: backend == "cuda"
    torch.version.hip = None if backend == "cuda" else "6.0"
    driver.set_active(StandInDriver(name))
    try:
        yield plat
    finally:   # (not reset_active: on a machine without a GPU Triton cannot create its default driver)
        platform.current, triton_utils.nvidia, torch.version.hip, driver._active = saved


def triton_impls():
    """kernelgate's own Triton implementations (fla's kernels call torch.cuda themselves: not here)."""
    from . import registry
    for op in registry.ops().values():
        for impl in op.impls.values():
            if impl.provider == "triton":
                yield op, impl


def compile_all(names) -> list:
    """[(target, 'op/impl', error or None, seconds)] for every Triton implementation and target."""
    results = []
    for name in names:
        with targeting(name) as plat:
            for op, impl in triton_impls():
                if plat.name not in impl.platforms:
                    continue
                err, t0 = None, time.perf_counter()
                try:
                    fn = impl.callable()
                    for case in op.cases():
                        for dtype in case.dtypes:
                            args, kwargs = case.make("cpu", dtype, torch.Generator().manual_seed(0))
                            if impl.supports is None or impl.supports(*args, **kwargs) is None:
                                fn(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - report every failure, keep going
                    err = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
                    if os.environ.get("KERNELGATE_COMPILE_TRACE"):
                        traceback.print_exc()
                results.append((name, f"{op.name}/{impl.name}", err, time.perf_counter() - t0))
    return results


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(TARGETS)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_targets: unset TRITON_INTERPRET (kernels must be JIT functions)")
        return 2
    bad = 0
    for name, what, err, secs in compile_all(names):
        print(f"{name:7s} {what:45s} {secs:5.1f} s  {'ok' if err is None else 'FAILED ' + err}", flush=True)
        bad += err is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
