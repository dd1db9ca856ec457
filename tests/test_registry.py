"""Registry behaviour on throwaway ops: priority, per-call `supports`, per-signature cache,
overrides (env, API, `forcing`), one-time fallback warnings, adapters, lazy imports."""
import warnings

import pytest
import torch

from kernelgate import KernelgateError, forcing, ops, platform, registry
from kernelgate.cli import ops as cli_ops
from kernelgate.registry import ALL_PLATFORMS, GPU_TRITON, FallbackWarning


@pytest.fixture
def make_op(monkeypatch):
    """Declare throwaway ops; they are removed from the registry (and its trace) afterwards.
    Dispatch decides as on a CPU machine (the platform CI runs on), so on a GPU machine these
    host-tensor calls are not refused by the kernels-take-device-tensors rule (tested below)."""
    made = []
    monkeypatch.setattr(registry, "_warned", set())
    sim = platform.simulate("cpu")
    sim.__enter__()

    def make(name, reference, **kw):
        op = registry.declare(f"_test_{name}", reference, **kw)
        made.append(op.name)
        return op
    yield make
    sim.__exit__(None, None, None)
    for name in made:
        registry.OPS.pop(name, None)
        registry._plan.pop(name, None)


def scale_ref(x, s=1.0):
    return x * s


def tagged(tag, log=None):
    """An implementation that returns (tag, result) and records each call."""
    def fn(x, s=1.0):
        if log is not None:
            log.append(tag)
        return tag, x * s
    return fn


def narrow_only(calls):
    def supports(x, s=1.0):
        calls.append(tuple(x.shape))
        return f"last dim {x.shape[-1]} > 8" if x.shape[-1] > 8 else None
    return supports


def two_impls(make_op, calls):
    op = make_op("two", scale_ref)
    op.implementation("low", tagged("low"), provider="test", platforms=ALL_PLATFORMS, priority=5)
    op.implementation("high", tagged("high"), provider="test", platforms=ALL_PLATFORMS, priority=10,
                      supports=narrow_only(calls))
    return op


def test_priority_then_supports_then_native(make_op):
    calls = []
    op = two_impls(make_op, calls)
    assert op(torch.ones(2, 4), 2.0)[0] == "high"
    with pytest.warns(FallbackWarning, match="falls back from high to low: last dim 16 > 8"):
        tag, y = op(torch.ones(2, 16), 2.0)
    assert tag == "low" and torch.equal(y, torch.full((2, 16), 2.0))
    rows = dict((i.name, r) for i, r in op.explain((torch.ones(2, 4),), {}))
    assert rows == {"high": None, "low": "lower priority than high", "native": "lower priority than high"}


def test_fallback_warns_once_per_reason(make_op):
    op = two_impls(make_op, [])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        op(torch.ones(1, 16))
        op(torch.ones(3, 16))          # new signature, same reason: no second warning
        op(torch.ones(3, 32))          # new reason: warns
    msgs = [str(x.message) for x in w if issubclass(x.category, FallbackWarning)]
    assert msgs == ["kernelgate: _test_two falls back from high to low: last dim 16 > 8",
                    "kernelgate: _test_two falls back from high to low: last dim 32 > 8"]


def test_no_warning_for_impls_not_declared_here(make_op):
    op = make_op("elsewhere", scale_ref)
    op.implementation("gpu", tagged("gpu"), provider="test", platforms={"npu"}, priority=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = op(torch.ones(3), 2.0)
    assert torch.equal(y, torch.full((3,), 2.0))


def test_choice_cached_per_signature(make_op):
    calls = []
    op = two_impls(make_op, calls)
    x = torch.ones(2, 4)
    op(x, 2.0)
    op(torch.zeros(2, 4), 2.0)                      # same dtype/shape/args: cached
    assert calls == [(2, 4)]
    op(torch.ones(3, 4), 2.0)                       # new shape
    op(torch.ones(3, 4, dtype=torch.float64), 2.0)  # new dtype
    op(x, 3.0)                                      # new non-tensor argument
    op(x, s=3.0)                                    # passed by keyword: its own key
    assert len(calls) == 5 and len(op._cache) == 5
    registry.refresh()
    op(x, 2.0)
    assert len(calls) == 6                          # refresh drops cached choices


def test_unhashable_argument_decides_every_call(make_op):
    calls = []
    op = make_op("lists", lambda x, s=1.0: x)
    op.implementation("impl", lambda x, s=1.0: x, provider="test", platforms=ALL_PLATFORMS,
                      priority=1, supports=lambda x, s=1.0: calls.append(1))
    op(torch.ones(2), [1])
    op(torch.ones(2), [1])
    assert len(calls) == 2 and not op._cache


def test_force_by_env_api_and_context(make_op, monkeypatch):
    op = two_impls(make_op, [])
    x = torch.ones(2, 4)
    monkeypatch.setenv("KERNELGATE_FORCE", "_test_two=low")
    registry.refresh()
    assert op(x)[0] == "low"
    assert dict((i.name, r) for i, r in op.explain())["high"] == "override forces low"
    monkeypatch.delenv("KERNELGATE_FORCE")
    registry.refresh()
    assert op(x)[0] == "high"

    registry.force("_test_two", "native")
    try:
        assert torch.equal(op(x, 3.0), 3 * x)
    finally:
        registry.force("_test_two", None)
    assert op(x)[0] == "high"

    with forcing({"_test_two": "low"}):
        assert op(x)[0] == "low"
        with forcing("_test_two=native"):
            assert not isinstance(op(x), tuple)
        assert op(x)[0] == "low"
    assert op(x)[0] == "high"


@pytest.mark.parametrize("text,message", [
    ("no_such_op=native", "unknown op 'no_such_op'"),
    ("gated_rms_norm=no_such_impl", "gated_rms_norm: unknown implementation 'no_such_impl'"),
    ("gated_rms_norm", "override 'gated_rms_norm': expected 'op=implementation'"),
])
def test_bad_overrides_are_errors(text, message, monkeypatch):
    with pytest.raises(KernelgateError, match=message):
        registry.parse_overrides(text)
    with pytest.raises(KernelgateError, match=message):
        with forcing(text):
            pass
    monkeypatch.setenv("KERNELGATE_FORCE", text)
    registry.refresh()
    with pytest.raises(KernelgateError, match=message):   # at the first call, not silently ignored
        ops.gated_rms_norm(torch.ones(2, 4), torch.ones(4))


def test_bad_api_force_is_an_error():
    with pytest.raises(KernelgateError, match="unknown op 'nope'"):
        registry.force("nope", "native")
    with pytest.raises(KernelgateError, match="unknown implementation 'nope'"):
        registry.force("gated_rms_norm", "nope")


def test_forced_impl_that_cannot_run_says_why(make_op):
    op = two_impls(make_op, [])
    with forcing({"_test_two": "high"}):
        assert op(torch.ones(2, 4))[0] == "high"
        with pytest.raises(KernelgateError,
                           match="_test_two: forced implementation 'high' cannot run this call: last dim 16 > 8"):
            op(torch.ones(2, 16))


def test_forced_impl_declared_elsewhere_runs(make_op):
    # A forced implementation skips the platform list (testing an XPU kernel on CUDA), not its needs.
    op = make_op("forced_platform", scale_ref)
    op.implementation("npu_only", tagged("npu_only"), provider="test", platforms={"npu"}, priority=10)
    assert not isinstance(op(torch.ones(2)), tuple)
    with forcing({op.name: "npu_only"}):
        assert op(torch.ones(2))[0] == "npu_only"


def test_adapter_upcasts_at_the_call_without_touching_the_caller(make_op):
    seen = []

    def add_bias(x, bias):
        return (x.float() + bias.float()).to(x.dtype)

    def needs_fp32_bias(x, bias):
        seen.append(bias.dtype)
        assert bias.dtype == torch.float32
        return (x.float() + bias).to(x.dtype)

    def upcast_bias(args, kwargs):
        x, bias = args
        return (x, bias.float()), kwargs

    op = make_op("adapt", add_bias)
    op.implementation("fp32bias", needs_fp32_bias, provider="test", platforms=ALL_PLATFORMS,
                      adapt=upcast_bias, priority=10)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    bias = torch.randn(4, dtype=torch.bfloat16)
    before = bias.clone()
    y = op(x, bias)
    assert seen == [torch.float32]
    assert bias.dtype == torch.bfloat16 and torch.equal(bias, before)   # the caller's tensor is untouched
    assert torch.equal(y, add_bias(x, bias))


def test_missing_module_is_a_reason_not_an_import_error(make_op):
    op = make_op("lazy", scale_ref)
    op.implementation("ghost", "no_such_module:f", provider="test", platforms=ALL_PLATFORMS,
                      priority=10)
    with pytest.warns(FallbackWarning, match="no_such_module does not import"):
        y = op(torch.ones(2), 2.0)
    assert torch.equal(y, torch.full((2,), 2.0))
    reason = dict((i.name, r) for i, r in op.explain())["ghost"]
    assert reason.startswith("no_such_module does not import (ModuleNotFoundError")
    entry = cli_ops.doctor_report()["ops"][op.name]
    assert entry["chosen"] == "native"
    assert [i["reason"] for i in entry["implementations"] if i["name"] == "ghost"] == [reason]


def test_supports_reason_shows_in_doctor(make_op):
    op = make_op("declared_reason", scale_ref)
    op.implementation("libless", tagged("libless"), provider="test", platforms=ALL_PLATFORMS,
                      requires=("no_such_library",), priority=10)
    entry = cli_ops.doctor_report()["ops"][op.name]
    ghost = next(i for i in entry["implementations"] if i["name"] == "libless")
    assert "no_such_library does not import" in ghost["reason"] and not ghost["chosen"]


def test_duplicate_declarations_are_errors(make_op):
    op = make_op("dup", scale_ref)
    with pytest.raises(KernelgateError, match="op '_test_dup' declared twice"):
        registry.declare("_test_dup", scale_ref)
    with pytest.raises(KernelgateError, match="implementation 'native' registered twice"):
        op.implementation("native", scale_ref, provider="native", platforms=ALL_PLATFORMS)


def test_gated_rms_norm_falls_back_on_xpu_without_triton(monkeypatch):
    # Simulated XPU where Triton cannot run (CPU tensors, no interpreter): native, with a warning.
    if torch.cuda.is_available():
        pytest.skip("needs a CPU-only machine: on a GPU, Triton compiles")
    monkeypatch.setattr(registry, "_warned", set())
    monkeypatch.setenv("KERNELGATE_PLATFORM", "xpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    registry.refresh()
    x, w, g = torch.randn(3, 64), torch.randn(64), torch.randn(3, 64)
    with pytest.warns(FallbackWarning, match="gated_rms_norm falls back from triton to native: Triton unusable"):
        y = ops.gated_rms_norm(x, w, g)
    torch.testing.assert_close(y, registry.get("gated_rms_norm").reference(x, w, g))
    assert GPU_TRITON <= registry.get("gated_rms_norm").impl("triton").platforms


def test_cache_hit_never_skips_checks_strides_devices_scalar_types(make_op):
    """A call that differs from a cached one only in strides, alignment, another tensor's device
    or a scalar's type gets its own checks (issue: a transposed tensor reached a dense-only kernel)."""
    seen = []

    def dense_only(x, y, s=1):
        seen.append((x.stride(), y.stride(), type(s)))
        return None if x.is_contiguous() and y.is_contiguous() else "needs contiguous x and y"
    op = make_op("dense", lambda x, y, s=1: x + y * s)
    op.implementation("dense", lambda x, y, s=1: ("dense", x + y * s), provider="test",
                      platforms=ALL_PLATFORMS, priority=1, supports=lambda x, y, s=1: dense_only(x, y, s))
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    assert op(a, b)[0] == "dense"
    out = op(a, b.t())                      # same shapes and dtypes, other strides
    assert not isinstance(out, tuple) and torch.equal(out, a + b.t())
    assert op(a, b, 2)[0] == "dense" and op(a, b, 2.0)[0] == "dense"
    assert [s for *_, s in seen[-2:]] == [int, float]   # 2.0 is not a cached 2
    unaligned = torch.ones(17)[1:].view(4, 4)                   # 4-byte offset: other alignment
    op(unaligned, b)
    assert len(seen) == 5 and len(op._cache) == 5


def test_wrong_argument_count_and_meta_tensors_name_the_op(make_op):
    op = make_op("arity", lambda x, y: x + y, validate=lambda x, y: None)
    with pytest.raises(KernelgateError, match="_test_arity: missing a required argument: 'y'"):
        op(torch.ones(2))
    with pytest.raises(KernelgateError, match="_test_arity: too many positional arguments"):
        op(torch.ones(2), torch.ones(2), torch.ones(2))
    with pytest.raises(KernelgateError, match="_test_arity: x is a meta tensor"):
        op(torch.ones(2, device="meta"), torch.ones(2))


def test_checked_mode_runs_value_checks_on_every_call(make_op):
    runs = []

    def check_values(x, idx):
        runs.append(1)
        bad = idx[(idx < 0) | (idx >= x.shape[0])]
        if bad.numel():
            raise KernelgateError(f"_test_gather: idx value {int(bad[0])} outside [0, {x.shape[0]})")
    op = make_op("gather", lambda x, idx: x[idx], check_values=check_values)
    x = torch.arange(4.0)
    with registry.checked(True):
        assert torch.equal(op(x, torch.tensor([3, 0])), torch.tensor([3.0, 0.0]))
        with pytest.raises(KernelgateError, match="idx value 7 outside"):
            op(x, torch.tensor([7, 0]))                  # a cache hit: still checked
    assert len(runs) == 2
    with registry.checked(False):
        op(x, torch.tensor([1, 0]))
    assert len(runs) == 2


def test_preload_imports_this_platforms_implementations_in_the_background():
    """`kernelgate run / serve --model` start registry.preload(): afterwards every string-referenced implementation
    declared for this platform whose requirements hold is imported (resolved), on another thread."""
    from kernelgate import platform as plat_mod
    plat = plat_mod.current()
    lazy = [impl for op in registry.ops().values() for impl in op.impls.values()
            if plat.name in impl.platforms and isinstance(impl.fn, str)]
    assert lazy, "no string-referenced implementation on this platform: the test checks nothing"
    for impl in lazy:                      # as before any dispatch (the modules stay imported: the
        impl._resolved = impl._resolve_error = None   # thread re-resolves the same attributes)
    t = registry.preload()
    assert t.daemon and t.name == "kernelgate-preload"
    t.join(120)
    assert not t.is_alive()
    for impl in lazy:
        ok = all(plat_mod.library_reason(r) is None for r in impl.requires if r not in ("triton", "triton-compiled"))
        if ok and not (set(impl.requires) & {"triton", "triton-compiled"} and plat.triton):
            assert impl._resolved is not None or impl._resolve_error, f"{impl.op.name}/{impl.name} not imported"


def test_device_kernels_refuse_data_on_another_device(make_op):
    # on a GPU machine an op handed host data goes to an implementation that runs on the host
    # (a Triton launch would fail on the pointer); torch code takes tensors anywhere; lengths
    # that stay on the host (metadata after the data) are no reason
    import dataclasses

    from kernelgate import platform
    op = make_op("dev", scale_ref)
    kern = op.implementation("kern", tagged("kern"), provider="triton", platforms=ALL_PLATFORMS, priority=10)
    torch_impl = op.implementation("eager", tagged("eager"), provider="torch", platforms=ALL_PLATFORMS, priority=5)
    gpu = dataclasses.replace(platform.current(), device="cuda", triton_mode="compiled")
    x = torch.ones(2, 4)
    assert kern.rejects(gpu, (x,), {}) == "argument 0 is a cpu tensor: its kernels take cuda tensors"
    assert kern.rejects(gpu, (), {"x": x}) == "x is a cpu tensor: its kernels take cuda tensors"
    assert kern.rejects(gpu, (2.0, torch.empty(2, device="meta"), x), {}).startswith("argument 1 is a meta tensor")
    assert torch_impl.rejects(gpu, (x,), {}) is None and op.impls["native"].rejects(gpu, (x,), {}) is None
    assert kern.rejects(gpu, (x.to("meta"),), {}).startswith("argument 0 is a meta") and kern.rejects(gpu, (), {}) is None
    assert kern.rejects(dataclasses.replace(gpu, device="cpu"), (x,), {}) is None        # a CPU machine
    assert kern.rejects(dataclasses.replace(gpu, triton_mode="interpreter"), (x,), {}) is None   # TRITON_INTERPRET=1
