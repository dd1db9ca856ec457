"""Every kernelgate Triton implementation, as dispatch launches it on each GPU family, compiles
for that GPU's architecture (kernelgate/compile_targets.py: a stand-in Triton driver, no GPU
needed). This is what catches a kernel that only an H100 can build: fp8 casts Triton refuses
before sm_89, fp8 conversions LLVM cannot lower for gfx90a, tiles that overflow AMD's 64 KiB
of LDS. One subprocess per target (the kernels must be JIT functions, not the interpreter's)."""
import os
import subprocess
import sys

import pytest

from kernelgate.compile_targets import TARGETS

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("target", list(TARGETS))
def test_triton_implementations_compile_for(target):
    from triton.backends import backends
    need = "nvidia" if TARGETS[target][0] == "cuda" else "amd"
    if need not in backends:
        pytest.skip(f"this Triton has no {need} backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "kernelgate.compile_targets", target], env=env,
                         capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith(target)]
    assert run.returncode == 0, "\n".join(lines) + "\n" + run.stderr[-3000:]
    # every implementation declared for the target's platform was compiled
    assert len(lines) >= 8 and all(line.endswith("ok") for line in lines), "\n".join(lines)
