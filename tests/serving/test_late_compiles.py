"""late_compiles: after warm-up, each Triton kernel the process builds is logged once with its
time, through Triton's own compile hooks (called here as Triton calls them: keyword arguments of
its JITHook protocol), and hooks installed before keep running."""
import logging

import pytest

from kernelgate.serving import late_compiles

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(late_compiles, "_state", {"count": 0, "started": {}, "installed": False})
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)


class Fn:
    name = "_gate_up_kernel"


def build(key, seconds_apart=0.0):
    """What JITFunction._do_compile does around one compile: the cache hook, then the post hook."""
    kw = dict(key=key, repr="_gate_up_kernel[num_warps=8](...)", fn=Fn(), is_manual_warmup=False,
              already_compiled=False,
              compile={"key": key, "constants": {(3,): 0.5, "BLOCK_M": 128, "BLOCK_N": 64, "IEEE": False},
                       "num_warps": 8, "num_stages": 3})
    for hook in (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook):
        if hook:                                            # (Triton skips a hook that is not set)
            assert hook(**kw) is None                       # None: go on and compile


def test_each_build_after_watch_is_logged_with_its_constants(fresh, caplog):
    build("before-watch")                                   # no hooks yet: Triton would skip them
    assert late_compiles.count() == 0
    assert late_compiles.watch() and late_compiles.watch()   # idempotent
    with caplog.at_level(logging.WARNING, logger="kernelgate.engine"):
        build("k1")
        build("k2")
    assert late_compiles.count() == 2
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2
    assert msgs[0].startswith("kernelgate: kernel _gate_up_kernel built during serving in 0.")
    assert "BLOCK_M=128, BLOCK_N=64, IEEE=False, num_warps=8, num_stages=3" in msgs[0]


def test_hooks_installed_before_keep_running(fresh, caplog):
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("cache", kw["key"]))
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["key"]))
    late_compiles.watch()
    with caplog.at_level(logging.WARNING, logger="kernelgate.engine"):
        build("k")
    assert seen == [("cache", "k"), ("post", "k")] and late_compiles.count() == 1
