"""Platform detection, capabilities, and KERNELGATE_PLATFORM / simulate() for dispatch."""
import pytest
import torch

from kernelgate import KernelgateError, platform, registry


def test_detects_the_real_device():
    p = platform.current()
    assert p.real in platform.PLATFORMS
    assert p.device == platform.default_device().type
    if torch.cuda.is_available():
        assert p.real in ("cuda", "rocm") and p.device == "cuda" and p.capability
    elif not (hasattr(torch, "xpu") and torch.xpu.is_available()) and not torch.backends.mps.is_available():
        assert (p.real, p.device, p.capability, p.streams) == ("cpu", "cpu", None, False)


def test_capabilities_report():
    d = platform.current().as_dict()
    assert set(d) >= {"platform", "real", "simulated", "device", "capability", "triton", "streams", "libraries"}
    assert set(d["libraries"]) == set(platform.LIBRARIES)
    for name, state in d["libraries"].items():
        assert state.startswith("unavailable: ") == (platform.library_reason(name) is not None)


def test_missing_library_is_a_reason():
    reason = platform.library_reason("no_such_library_kg")
    assert reason.startswith("no_such_library_kg does not import (ModuleNotFoundError")
    assert platform.library_version("no_such_library_kg") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: Triton state depends on TRITON_INTERPRET")
def test_triton_state_follows_triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    platform.refresh()
    p = platform.current()
    assert (p.triton, p.triton_mode) == (None, "interpreter")
    monkeypatch.delenv("TRITON_INTERPRET")
    platform.refresh()
    p = platform.current()
    assert p.triton_mode is None and "TRITON_INTERPRET=1" in p.triton


@pytest.mark.parametrize("name", ["xpu", "rocm", "npu", "cuda", "cpu", "mps"])
def test_env_simulates_a_platform(name, monkeypatch):
    monkeypatch.setenv("KERNELGATE_PLATFORM", name)
    registry.refresh()
    p = platform.current()
    real = platform._real_platform()
    assert p.name == name and p.real == real.name and p.device == real.device
    assert p.simulated == (name != real.name)
    assert p.as_dict()["platform"] == name


def test_bad_platform_name_is_an_error(monkeypatch):
    monkeypatch.setenv("KERNELGATE_PLATFORM", "tpu")
    registry.refresh()
    with pytest.raises(KernelgateError, match="KERNELGATE_PLATFORM='tpu' is not one of cuda, rocm, xpu"):
        platform.current()
    with pytest.raises(KernelgateError, match="'tpu' is not one of"):
        with platform.simulate("tpu"):
            pass


def test_simulate_nests_and_restores(monkeypatch):
    monkeypatch.delenv("KERNELGATE_PLATFORM", raising=False)
    registry.refresh()
    real = platform.current().name
    with platform.simulate("xpu") as p:
        assert p.name == "xpu" and platform.current().name == "xpu"
        with platform.simulate("npu"):
            assert platform.current().name == "npu"
        assert platform.current().name == "xpu"
    assert platform.current().name == real


def test_simulated_platform_changes_dispatch(monkeypatch):
    # The same call picks per platform: Triton where it is declared and runs, native on CPU/NPU.
    dev = platform.default_device()
    if dev.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    op = registry.get("gated_rms_norm")
    x, w, g = (torch.randn(*s, device=dev) for s in ((2, 64), (64,), (2, 64)))
    chosen = {}
    for name in ("xpu", "rocm", "cpu", "npu"):
        with platform.simulate(name):
            chosen[name] = op.select((x, w, g), {}).name
    if dev.type == "cpu":
        assert chosen == {"xpu": "triton", "rocm": "triton", "cpu": "native", "npu": "native"}
    else:
        assert chosen["cpu"] == chosen["npu"] == "native" and chosen["xpu"] == "triton"


@pytest.mark.parametrize("capability,has", [
    ("sm_80", False), ("sm_86", False), ("sm_89", True), ("sm_90", True), ("sm_100", True),
    ("gfx90a", False), ("gfx942:sramecc+:xnack-", True), ("gfx950", True), ("gfx1201", True),
    ("gfx1100", False), (None, False)])
def test_fp8_hardware_by_capability(capability, has):
    # what decides between fp8 casts and the integer fp8 decode in the indexer kernels
    assert platform.fp8_hardware(capability) is has


@pytest.mark.parametrize("capability,has", [
    ("sm_80", False), ("sm_86", False), ("sm_89", True), ("sm_90", True), ("sm_100", True),
    ("gfx90a", False), ("gfx942:sramecc+:xnack-", True), ("gfx950", True), ("gfx1201", False),
    ("pvc", False), ("bmg", False), (None, False)])
def test_fp8_mma_by_capability(capability, has):
    # what decides whether fp8_linear's w8a8 form (fp8 x fp8 tl.dot) is taken
    assert platform.fp8_mma(capability) is has
