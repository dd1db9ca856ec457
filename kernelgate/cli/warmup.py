"""`kernelgate warmup`: prepare a machine ahead of time. Loads the model (default: the built-in
one) with the engine flags `run` / `serve` will use, runs the warm-up (every op compiled and
autotuned for every step size up to the token budget, decode graphs captured) and exits; the kernels stay in the cache folder
(KERNELGATE_CACHE_DIR, default ~/.cache/kernelgate), so the next `run` / `serve` only loads them."""
from __future__ import annotations

import time

from . import args as flags


def add_parser(sub, common) -> None:
    p = sub.add_parser("warmup", help="compile and autotune every kernel a model needs, ahead of time")
    common(p)
    flags.add_model_args(p)
    flags.add_engine_args(p)
    p.set_defaults(fn=main)


def main(args) -> int:
    from .. import kernel_cache
    from ..engine.engine import Engine
    from ..serving.warmup import warm_up
    from .model import load
    t0 = time.perf_counter()
    model, source = load(args)
    print(f"model {source} loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    engine = Engine(model, flags.engine_config(args))
    warm_up(engine, log=lambda m: print(m, flush=True), every_shape=model.device.type != "cpu")
    print(f"kernel cache: {kernel_cache.root()}")
    return 0
