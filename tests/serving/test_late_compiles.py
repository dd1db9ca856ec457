"""late_compiles: after warm-up, each Triton kernel the process builds is logged once with its
time and with what differs from the nearest build of the warm-up, through Triton's own compile
hooks (called here as Triton calls them: keyword arguments of its JITHook protocol, the
specialization in Triton's form), and hooks installed before keep running."""
import logging

import pytest

from kernelgate.serving import late_compiles

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(late_compiles, "_state",
                        {"count": 0, "started": {}, "installed": False, "serving": False, "seen": {}})
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)


class Jit:
    arg_names = ["x", "slots", "N", "BLOCK"]


class Fn:
    name, jit_function = "_step_kernel", Jit()


def build(key, aligned=True, n16=True, block=64, name="_step_kernel"):
    """What JITFunction._do_compile does around one compile: the cache hook, then the post hook."""
    attrs = {(0,): [["tt.divisibility", 16]]}
    if aligned:
        attrs[(1,)] = [["tt.divisibility", 16]]
    if n16:
        attrs[(2,)] = [["tt.divisibility", 16]]
    fn = Fn()
    fn.name = name
    kw = dict(key=key, repr=f"{name}[num_warps=4](...)", fn=fn, is_manual_warmup=False, already_compiled=False,
              compile={"key": key, "signature": {"x": "*bf16", "slots": "*i32", "N": "i32", "BLOCK": "constexpr"},
                       "constants": {(3,): block}, "configs": [attrs], "num_warps": 4, "num_stages": 3})
    for hook in (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook):
        if hook:                                            # (Triton skips a hook that is not set)
            assert hook(**kw) is None                       # None: go on and compile


def test_builds_after_warm_up_name_what_the_warm_up_did_not_meet(fresh, caplog):
    build("before-watch")                                   # no hooks yet: not recorded
    assert late_compiles.watch() and late_compiles.watch()   # idempotent
    with caplog.at_level(logging.WARNING, logger="kernelgate.engine"):
        build("warm-1")                                      # the warm-up's builds: recorded, not logged
        build("warm-2", block=128)
        assert late_compiles.count() == 0 and not caplog.records
        late_compiles.serving()
        build("late-1", aligned=False)                       # a slots slice at an odd offset
        build("late-2", n16=False, block=128)
        build("late-3", name="_other_kernel")
    assert late_compiles.count() == 3
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0].startswith("kernelgate: kernel _step_kernel built during serving in 0.")
    assert msgs[0].endswith("nearest build differs in: slots *i32 16-aligned -> *i32"), msgs[0]
    assert msgs[1].endswith("nearest build differs in: N i32 %16 -> i32"), msgs[1]
    assert msgs[2].startswith("kernelgate: kernel _other_kernel built") and msgs[2].endswith("the warm-up never built it")


def test_hooks_installed_before_keep_running(fresh, caplog):
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("cache", kw["key"]))
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["key"]))
    late_compiles.watch()
    late_compiles.serving()
    with caplog.at_level(logging.WARNING, logger="kernelgate.engine"):
        build("k")
    assert seen == [("cache", "k"), ("post", "k")] and late_compiles.count() == 1
