"""The op registry: declarations instead of platform branches.

An `Op` is declared once with its native PyTorch reference (the definition of the math).
Implementations declare where they run (platforms), what they need (Triton, a library),
which dtypes they take, a per-call `supports(...) -> None | reason`, an optional argument
adapter, and a priority. A call picks, per (platform, argument signature):

    forced override  >  highest priority implementation that accepts the call  >  native

and caches the choice, so the steady-state cost is one tuple build and one dict lookup.
Every rejection carries a human reason; falling back from an implementation declared for
this platform warns once per (op, implementation, reason).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import envs
from . import platform as _platform
from .errors import KernelgateError
from .platform import Platform

ALL_PLATFORMS = frozenset(_platform.PLATFORMS)
GPU_TRITON = frozenset({"cuda", "rocm", "xpu"})  # portable Triton: declare for all three


class FallbackWarning(UserWarning):
    """An implementation declared for this platform could not run; a slower one was used."""


# providers whose implementations are torch code, which runs on whatever device its tensors are on;
# every other one launches kernels on the platform's device: an op whose data (its first tensor
# argument) is elsewhere -- host tensors on a GPU machine -- goes to one that runs there (a Triton
# launch would fail on the pointer). Metadata tensors (lengths) may stay on the host by design.
HOST_PROVIDERS = frozenset({"native", "torch"})


def _off_device(device: str, args: tuple, kwargs: dict) -> str | None:
    """Where the call's first tensor argument lives, if not on `device` (None: there, or no tensor)."""
    for where, a in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if isinstance(a, torch.Tensor):
            return None if a.device.type == device else f"{where} is a {a.device.type} tensor"
    return None


@dataclass
class Impl:
    op: "Op"
    name: str
    provider: str
    fn: Callable | str                 # callable, or ".module:attr" beside the op's file, imported on first use
    platforms: frozenset
    dtypes: frozenset | None = None    # accepted dtypes of the op's dtype argument; None = any
    requires: tuple = ()               # "triton", "triton-compiled", or a library in platform.LIBRARIES
    supports: Callable | None = None   # (*args, **kwargs) -> None | reason
    adapt: Callable | None = None      # (args, kwargs) -> (args, kwargs), e.g. upcast a bias at the call
    priority: int = 0
    doc: str = ""
    rtol: dict | None = None           # per-dtype parity bound where it must differ from the op's (e.g. TF32)
    _resolved: Any = field(default=None, repr=False)
    _resolve_error: str | None = field(default=None, repr=False)

    def resolve(self) -> Callable | None:
        if self._resolved is None and self._resolve_error is None:
            if callable(self.fn):
                self._resolved = self.fn
            else:
                module, _, attr = self.fn.partition(":")
                try:
                    self._resolved = getattr(importlib.import_module(module, self.op.package), attr)
                except Exception as e:  # noqa: BLE001 - a broken optional module is a reason
                    self._resolve_error = f"{module} does not import ({type(e).__name__}: {e})"
        return self._resolved

    def unavailable(self, plat: Platform) -> str | None:
        """Why this implementation cannot run on this machine at all (None if it can)."""
        for req in self.requires:
            if req == "triton":
                if plat.triton:
                    return f"Triton unusable: {plat.triton}"
            elif req == "triton-compiled":
                if plat.triton:
                    return f"Triton unusable: {plat.triton}"
                if plat.triton_mode != "compiled":
                    return "needs compiled Triton on a GPU (its kernels autotune, which the interpreter cannot)"
            else:
                reason = _platform.library_reason(req)
                if reason:
                    return reason
        if self.resolve() is None:
            return self._resolve_error
        return None

    def rejects(self, plat: Platform, args: tuple, kwargs: dict, forced: bool = False) -> str | None:
        """Why this implementation is not used for this call (None if it can be)."""
        if not forced and plat.name not in self.platforms:
            why = f"not declared for {plat.name} (declared: {', '.join(sorted(self.platforms))})"
            no_triton = _platform.NO_TRITON.get(plat.name) if self.provider == "triton" else None
            return f"{why}: {no_triton}" if no_triton else why
        reason = self.unavailable(plat)
        if reason:
            return reason
        if args is not None and self.provider not in HOST_PROVIDERS and plat.device != "cpu" \
                and plat.triton_mode != "interpreter":      # (the interpreter runs on host tensors)
            elsewhere = _off_device(plat.device, args, kwargs)
            if elsewhere:
                return f"{elsewhere}: its kernels take {plat.device} tensors"
        if self.dtypes is not None and args is not None:  # doctor (no args) checks static facts only
            dt = self.op.dtype_of(args, kwargs)
            if dt is not None and dt not in self.dtypes:
                names = ", ".join(sorted(str(d).replace("torch.", "") for d in self.dtypes))
                return f"dtype {str(dt).replace('torch.', '')} not supported (takes {names})"
        if self.supports is not None and args is not None:
            return self.supports(*args, **kwargs)
        return None

    def callable(self) -> Callable:
        fn = self.resolve()
        if self.adapt is None:
            return fn
        adapt = self.adapt

        def adapted(*args, **kwargs):
            args, kwargs = adapt(args, kwargs)
            return fn(*args, **kwargs)
        return adapted


@dataclass
class Case:
    """A parity/bench input: `make(device, dtype, generator) -> (args, kwargs)`."""
    id: str
    make: Callable
    dtypes: tuple = (torch.float32, torch.bfloat16)
    bytes: Callable | None = None      # (args, kwargs) -> bytes the op must move (bench)


DEFAULT_RTOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


class Op:
    def __init__(self, name: str, reference: Callable, *, validate: Callable | None = None,
                 dtype_arg: str | None = None, mutates: tuple = (), rtol: dict | None = None,
                 compare: Callable | None = None, compare_mutated: Callable | None = None,
                 cases: Callable | None = None, check_values: Callable | None = None,
                 bench_cases: Callable | None = None, doc: str = "", note: Callable | None = None):
        self.name = name
        self.reference = reference
        self.signature = inspect.signature(reference)
        self.params = list(self.signature.parameters)
        # relative implementation references (".gated_rms_norm_triton:fn") resolve from here
        self.package = reference.__module__.rpartition(".")[0]
        self.validate = validate
        # Host checks of index VALUES (ranges, cu_seqlens monotone...): they read device data, so
        # they run only in checked mode (KERNELGATE_CHECKS=1), on every call. Kernels skip
        # out-of-range rows on their own either way; this turns them into a clear error.
        self.check_values = check_values
        self.dtype_arg = dtype_arg or self.params[0]
        self._dtype_pos = self.params.index(self.dtype_arg)
        self.mutates = mutates
        self.rtol = {**DEFAULT_RTOL, **(rtol or {})}
        self.compare = compare                  # (out, ref, dtype, inputs) -> None, raises AssertionError
        self.compare_mutated = compare_mutated  # (name, out, ref, dtype) -> None, for in-place arguments
        self.cases = cases or (lambda: [])
        self.bench_cases = bench_cases or (lambda: [])
        # (Platform) -> None | a line for `kernelgate doctor` on what the chosen implementations do
        # there that their names do not say (the fp8 ops: w8a8 or w8a16 by GPU capability)
        self.note = note
        self.doc = doc or (reference.__doc__ or "").strip().splitlines()[0] if (doc or reference.__doc__) else ""
        self.impls: dict[str, Impl] = {}
        self._cache: dict = {}
        self.implementation("native", reference, provider="native", platforms=ALL_PLATFORMS,
                            priority=-1_000_000, doc="PyTorch reference (definition of the op)")

    def __repr__(self):
        return f"Op({self.name}: {', '.join(self.impls)})"

    # -- declaration ---------------------------------------------------------------
    def implementation(self, name: str, fn: Callable | str, *, provider: str, platforms,
                       dtypes=None, requires=(), supports=None, adapt=None, priority: int = 0,
                       doc: str = "", rtol: dict | None = None) -> Impl:
        if name in self.impls:
            raise KernelgateError(f"{self.name}: implementation {name!r} registered twice")
        impl = Impl(self, name, provider, fn, frozenset(platforms),
                    frozenset(dtypes) if dtypes is not None else None, tuple(requires),
                    supports, adapt, priority, doc, rtol)
        self.impls[name] = impl
        self._cache.clear()
        return impl

    def dtype_of(self, args: tuple, kwargs: dict):
        a = args[self._dtype_pos] if len(args) > self._dtype_pos else kwargs.get(self.dtype_arg)
        return a.dtype if isinstance(a, torch.Tensor) else None

    def bind(self, args: tuple, kwargs: dict) -> dict:
        """Arguments by name, defaults applied (for checks, tests and adapters)."""
        try:
            ba = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise KernelgateError(f"{self.name}: {e}") from None
        ba.apply_defaults()
        return dict(ba.arguments)

    # -- selection -----------------------------------------------------------------
    def ranked(self) -> list[Impl]:
        return sorted(self.impls.values(), key=lambda i: -i.priority)

    def explain(self, args: tuple | None = None, kwargs: dict | None = None,
                plat: Platform | None = None) -> list[tuple[Impl, str | None]]:
        """Every implementation with the reason it is not chosen; the chosen one has None.

        Without arguments only the static facts (platform, libraries, Triton) are checked.
        """
        plat = plat or _platform.current()
        kwargs = kwargs or {}
        forced = _forced().get(self.name)
        rows, chosen = [], None
        for impl in self.ranked():
            if forced is not None and impl.name != forced:
                rows.append((impl, f"override forces {forced}"))
                continue
            reason = impl.rejects(plat, args, kwargs, forced=forced is not None)
            if reason is None and chosen is not None:
                reason = f"lower priority than {chosen.name}"
            if reason is None:
                chosen = impl
            rows.append((impl, reason))
        return rows

    def select(self, args: tuple, kwargs: dict, plat: Platform | None = None) -> Impl:
        plat = plat or _platform.current()
        self.bind(args, kwargs)   # a wrong argument count names the op, not validate()
        for name, a in zip(self.params, args):
            if isinstance(a, torch.Tensor) and a.device.type == "meta":
                raise KernelgateError(f"{self.name}: {name} is a meta tensor (no data to compute on)")
        if self.validate is not None:
            self.validate(*args, **kwargs)
        forced = _forced().get(self.name)
        if forced is not None:
            impl = self.impls[forced]
            reason = impl.rejects(plat, args, kwargs, forced=True)
            if reason:
                raise KernelgateError(f"{self.name}: forced implementation {forced!r} cannot run this call: {reason}")
            return impl
        skipped = []
        for impl in self.ranked():
            reason = impl.rejects(plat, args, kwargs)
            if reason is None:
                for other, why in skipped:
                    if plat.name in other.platforms:
                        _warn_once(self.name, other.name, impl.name, why)
                return impl
            skipped.append((impl, reason))
        raise KernelgateError(f"{self.name}: no implementation accepts this call: "
                              + "; ".join(f"{i.name}: {r}" for i, r in skipped))

    def _miss(self, key, args, kwargs):
        if _env_error:
            raise _env_error[0]
        impl = self.select(args, kwargs)
        fn = impl.callable()
        if key is not None:
            self._cache[key] = fn
        _trace(self.name, impl)
        return fn

    def __call__(self, *args, **kwargs):
        # The key holds everything validate() and supports() may read: per tensor its device,
        # dtype, shape, strides and 16-byte alignment; every other argument by type and value
        # (2.0 is not 2). A cache hit therefore means the checks would pass again, and the
        # checks run on a miss only. Index VALUES are not in the key: see KERNELGATE_CHECKS.
        key = [len(args)]
        for a in args:
            if type(a) is torch.Tensor:
                key.append((a.device, a.dtype, a.shape, a.stride(), a.data_ptr() & 15))
            else:
                key.append((type(a), a))
        if kwargs:
            for k, a in kwargs.items():
                key.append(k)
                if type(a) is torch.Tensor:
                    key.append((a.device, a.dtype, a.shape, a.stride(), a.data_ptr() & 15))
                else:
                    key.append((type(a), a))
        key = tuple(key)
        try:
            fn = self._cache[key]
        except KeyError:
            fn = self._miss(key, args, kwargs)
        except TypeError:  # an unhashable argument: decide every call
            fn = self._miss(None, args, kwargs)
        if _checks_on[0] and self.check_values is not None:
            self.check_values(*args, **kwargs)
        return fn(*args, **kwargs)

    def impl(self, name: str) -> Impl:
        try:
            return self.impls[name]
        except KeyError:
            raise KernelgateError(f"{self.name}: unknown implementation {name!r} "
                                  f"(registered: {', '.join(self.impls)})") from None


# -- the registry ------------------------------------------------------------------
OPS: dict[str, Op] = {}


def declare(name: str, reference: Callable, **kw) -> Op:
    if name in OPS:
        raise KernelgateError(f"op {name!r} declared twice")
    op = Op(name, reference, **kw)
    OPS[name] = op
    return op


def ops() -> dict[str, Op]:
    from . import ops as _ops  # noqa: F401 - importing declares every op
    return OPS


def preload() -> threading.Thread:
    """Import, in a background thread, every implementation declared for this platform and the
    libraries it needs (fla's ops take seconds to import, Triton kernels a second or two): `kernelgate
    run` / `serve` start it before a checkpoint loads, so the imports overlap its reading instead of
    delaying the first step.
    Dispatch is unchanged (the same checks resolve the same modules, once)."""
    plat = _platform.current()

    def run():
        for op in list(ops().values()):
            for impl in list(op.impls.values()):
                if plat.name in impl.platforms:
                    impl.unavailable(plat)
    t = threading.Thread(target=run, name="kernelgate-preload", daemon=True)
    t.start()
    return t


def get(name: str) -> Op:
    all_ops = ops()
    if name not in all_ops:
        raise KernelgateError(f"unknown op {name!r} (registered: {', '.join(sorted(all_ops))})")
    return all_ops[name]


def clear_caches() -> None:
    for op in OPS.values():
        op._cache.clear()


_platform._listeners.append(clear_caches)


# -- overrides ---------------------------------------------------------------------
_api_forced: dict[str, str] = {}
_forced_cache: list[dict] = []


def parse_overrides(text: str) -> dict[str, str]:
    """'op=impl,op2=impl2' -> dict; an unknown op or implementation is an error."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        op_name, eq, impl_name = item.partition("=")
        if not eq or not op_name.strip() or not impl_name.strip():
            raise KernelgateError(f"override {item!r}: expected 'op=implementation'")
        op = get(op_name.strip())
        out[op.name] = op.impl(impl_name.strip()).name
    return out


def _forced() -> dict[str, str]:
    if not _forced_cache:
        env = parse_overrides(envs.get("KERNELGATE_FORCE"))
        _forced_cache.append({**env, **_api_forced})
    return _forced_cache[0]


def force(op_name: str, impl_name: str | None) -> None:
    """Force `op_name` to `impl_name` (None removes the override)."""
    if impl_name is None:
        _api_forced.pop(op_name, None)
    else:
        op = get(op_name)
        _api_forced[op.name] = op.impl(impl_name).name
    refresh()


@contextlib.contextmanager
def forcing(overrides: dict[str, str] | str):
    """Temporarily force implementations: `with forcing({"gated_rms_norm": "triton"}): ...`."""
    if isinstance(overrides, str):
        overrides = parse_overrides(overrides)
    saved = dict(_api_forced)
    try:
        for k, v in overrides.items():
            force(k, v)
        yield
    finally:
        _api_forced.clear()
        _api_forced.update(saved)
        refresh()


def refresh() -> None:
    """Re-read overrides, KERNELGATE_CHECKS and the platform; drop cached choices."""
    _forced_cache.clear()
    _env_error.clear()
    _checks_on[0] = _checked_blocks[-1] if _checked_blocks else _env_checks()   # a checked() block wins
    _platform.refresh()


def _env_checks() -> bool:
    return envs.get("KERNELGATE_CHECKS")


def _env_checks_at_import() -> bool:
    """At import a bad value is not raised (`kernelgate --version` must answer): the first op
    call that dispatches raises it instead (see Op._miss)."""
    try:
        return _env_checks()
    except KernelgateError as e:
        _env_error.append(e)
        return False


_env_error: list = []
_checks_on = [_env_checks_at_import()]
_checked_blocks: list[bool] = []   # innermost checked() block last; refresh() keeps its choice


@contextlib.contextmanager
def checked(on: bool = True):
    """Check index values on every op call inside the block (what KERNELGATE_CHECKS=1 does)."""
    saved = _checks_on[0]
    _checked_blocks.append(on)
    _checks_on[0] = on
    try:
        yield
    finally:
        _checked_blocks.pop()
        _checks_on[0] = saved


# -- warnings and trace -------------------------------------------------------------
_warned: set = set()


def _warn_once(op: str, skipped: str, used: str, reason: str) -> None:
    key = (op, skipped, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"kernelgate: {op} falls back from {skipped} to {used}: {reason}",
                      FallbackWarning, stacklevel=5)  # the caller of the op


_plan: dict[str, dict[str, int]] = {}


def _trace(op: str, impl: Impl) -> None:
    counts = _plan.setdefault(op, {})
    counts[impl.name] = counts.get(impl.name, 0) + 1
    if envs.get("KERNELGATE_TRACE"):
        print(f"[kernelgate] {op} -> {impl.name} ({impl.provider}) on {_platform.current().name}")


def plan() -> dict[str, list[str]]:
    """Which implementations each op dispatched to so far (distinct signatures counted)."""
    return {op: sorted(c) for op, c in sorted(_plan.items())}
