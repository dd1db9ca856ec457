import os

# One intra-op thread per test process. The suite runs tiny tensors on 2 xdist workers beside
# .ci/run's background compiles: with OpenMP's default (a thread per core) every process spins for
# cores that are busy, and the engine tests burn ~20x the CPU they need. Set before torch loads;
# subprocesses the tests start (CLI, server, ranks) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Checked mode in the whole suite: every op call also checks its index values on the host
# (ranges, cu_seqlens) and raises a clear error instead of skipping rows silently.
os.environ.setdefault("KERNELGATE_CHECKS", "1")

import kernelgate.registry as registry  # noqa: E402


def pytest_report_header(config):
    from kernelgate import platform
    p = platform.current().as_dict()
    return [f"kernelgate platform: {p['platform']} (real {p['real']}), triton: {p['triton']}, "
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"]


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    registry.refresh()
    yield
    registry.refresh()


@pytest.fixture
def device():
    from kernelgate.platform import default_device
    return default_device()


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
