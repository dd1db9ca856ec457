"""The platform layer's stand-in GPUs (what compile_targets decides and compiles for) and the
reasons doctor gives where kernelgate compiles no Triton kernel. No compiling here: fast."""
import pytest
import torch

from kernelgate import platform, registry
from kernelgate.cli.ops import doctor_report
from kernelgate.tools.compile_stand_in import TARGETS

# Imported under this run's TRITON_INTERPRET: Triton picks interpreted or JIT functions at import,
# and the tests below unset the variable for a while.
pytest.importorskip("triton")


def test_simulated_device_reports_its_capability_and_properties(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = platform.current()
    with platform.simulate(TARGETS["pvc"].device, compiling=True) as p:
        assert (p.name, p.capability, p.device) == ("xpu", "pvc", "cpu")
        assert p.device_name == "Intel(R) Data Center GPU Max 1550"
        assert p.properties["architecture"] == 0x030F000700 and p.properties["sub_group_sizes"] == [16, 32]
        assert (p.triton, p.triton_mode) == (None, "compiled")
        assert platform.current() is p
        assert not platform.fp8_hardware(p.capability)   # PVC converts fp8 in software
    assert platform.current() == before
    with platform.simulate(TARGETS["sm_90"].device) as p:   # not compiling: Triton state of this machine
        assert (p.name, p.capability, p.triton_mode) == ("cuda", "sm_90", before.triton_mode)


def test_xpu_architecture_ids_name_the_targets():
    for name in ("pvc", "bmg"):
        assert platform.XPU_ARCHS[TARGETS[name].arch["architecture"]] == name


def _gated_args():
    x = torch.randn(3, 64)
    return (x, torch.randn(64), torch.randn(3, 64)), {}


def test_gated_rms_norm_triton_is_chosen_for_a_stand_in_gpu(monkeypatch):
    """The hole compile_targets had: CPU tensors made supports() refuse the Triton kernel, so it was
    never compiled for any target (and still reported ok)."""
    op = registry.get("gated_rms_norm")
    for impl in op.impls.values():   # import the kernels as this run has them (interpreted or not) first
        impl.resolve()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, kwargs = _gated_args()
    for name in ("sm_90", "gfx942", "pvc"):
        with platform.simulate(TARGETS[name].device, compiling=True):
            rows = {impl.name: why for impl, why in op.explain(args, kwargs)}
            assert rows["triton"] is None, rows
    with platform.simulate("cuda"):   # a GPU platform on this CPU machine, nothing compiles: refused
        rows = {impl.name: why for impl, why in op.explain(args, kwargs)}
        assert rows["triton"] is not None


def test_doctor_says_why_npu_has_no_triton_kernels(monkeypatch):
    monkeypatch.setenv("KERNELGATE_PLATFORM", "npu")
    registry.refresh()
    rows = [i for op in doctor_report()["ops"].values() for i in op["implementations"] if i["provider"] == "triton"]
    assert rows and all("triton-ascend" in i["reason"] and "hivmc" in i["reason"] for i in rows)


def test_launch_choices_follow_the_simulated_device(monkeypatch):
    """compile_targets needs no monkeypatch: the launchers read only platform.current()."""
    from kernelgate.ops.moe import fused_experts_triton as fe
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seen = {}
    for name in ("sm_80", "sm_90", "gfx90a", "gfx942", "pvc", "bmg"):
        with platform.simulate(TARGETS[name].device, compiling=True) as p:
            seen[name] = (p.name == "cuda" and not platform.interpreting(), p.capability,
                          platform.fp8_hardware(p.capability), fe.launch_config(p)["num_stages"])
    assert seen == {"sm_80": (True, "sm_80", False, 3), "sm_90": (True, "sm_90", True, 3),
                    "gfx90a": (False, "gfx90a", False, 2), "gfx942": (False, "gfx942", True, 2),
                    "pvc": (False, "pvc", False, 3), "bmg": (False, "bmg", False, 3)}


def test_mla_decode_declares_what_intel_cannot_build(monkeypatch):
    """compile_targets pvc / bmg: fp32 at the real latent width needs 144 KiB of local memory (128 on
    Intel): the registry refuses that call on XPU with the reason, so dispatch runs the native form."""
    op = registry.get("mla_decode")
    impl = op.impl("triton")
    impl.resolve()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    wide = [(c, dt) for c in op.cases() for dt in c.dtypes
            if c.make("cpu", dt, torch.Generator().manual_seed(0))[0][5] > 256]
    assert wide
    for case, dtype in wide:
        args, kwargs = case.make("cpu", dtype, torch.Generator().manual_seed(0))
        for name in ("pvc", "sm_90"):
            with platform.simulate(TARGETS[name].device, compiling=True):
                why = impl.rejects(platform.current(), args, kwargs)
            refused = name == "pvc" and dtype == torch.float32
            assert (why is not None and "128 KiB" in why) if refused else why is None, (name, dtype, why)
