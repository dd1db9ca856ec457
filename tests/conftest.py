import os

import pytest
import torch

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
