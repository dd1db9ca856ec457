"""Warm-up before the first real request: every op a step runs dispatches, compiles (Triton,
autotuning) and, where the device has graphs, the decode step is captured for the batch sizes
that will run. The first run on a machine pays for compiling; later runs load the kernels from
the cache folder (kernel_cache.py) and say so."""
from __future__ import annotations

import re
import time
from pathlib import Path

from .. import kernel_cache
from . import late_compiles
from ..version import __version__
from ..engine.engine import freeze_heap
from ..engine.params import SamplingParams
from ..executor.model_runner import padded_tokens
from .drive import drive


def marker(device_name: str) -> Path:
    """The file that says a warm-up finished for this device and these versions."""
    import torch

    from .. import platform
    triton = platform.library_version("triton") or "none"
    key = f"{device_name}-kg{__version__}-torch{torch.__version__}-triton{triton}"
    return kernel_cache.root() / "warm" / re.sub(r"[^A-Za-z0-9_.+-]+", "_", key)


def warm_up(engine, log=print, max_batch: int | None = None, every_shape: bool = False) -> float:
    """Run short requests through `engine` (one alone, then a full batch); returns seconds.
    every_shape: also meet the shapes a server's steps will (the server does, so no request
    waits for them): capture every decode graph (`DecodeGraphs.prepare`) and prefill one prompt
    step of each size eager steps are padded to (each power-of-two token count where they are
    not) up to the token budget, which compiles and autotunes the kernels keyed on it
    (fused_experts autotunes per bucket of token-expert pairs), one step of an odd token count,
    a mixed step (a prompt joining decodes) and one prompt several chunks long, alone and beside
    a decoding request."""
    model = engine.model
    name = getattr(getattr(model, "device", None), "type", "cpu")
    from ..platform import current
    device = current().device_name or name
    mark = marker(device)
    first = not mark.exists()
    if every_shape:
        late_compiles.watch()     # (the builds of the warm-up: what a later one is compared with)
    log(f"compiling kernels for {device} (first run only)..." if first else f"loading compiled kernels for {device}...")
    t0 = time.perf_counter()
    vocab = model.config.vocab_size
    batch = max(1, min(max_batch or engine.max_num_seqs, engine.max_num_seqs))
    with engine.prefix_cache_off():      # steps of the sizes asked for; nothing cached of made-up prompts
        for n in sorted({1, batch}):
            drive(engine, [(f"warmup-{n}-{i}", [(7 * i + j) % vocab for j in range(1, 4)],
                            SamplingParams(max_new_tokens=3)) for i in range(n)])
        if every_shape:
            _every_shape(engine, batch, log)
    secs = time.perf_counter() - t0
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(f"{secs:.1f} s\n")
    if getattr(engine, "_froze", False):
        freeze_heap()     # what the warm-up built (graphs, compiled kernels) is long-lived too
    log(f"kernels ready in {secs:.1f} s")
    if every_shape:
        late_compiles.serving()   # what a request still makes this process build is logged from here on
    return secs


def _riding_sizes(engine, budget: int, longest: int) -> list:
    """Decode counts d whose full-chunk steps (budget + d tokens, padded to multiples of 64) the
    warm-up meets: one per padded size past the budget; none where decodes count against the
    budget, steps are not padded (the CPU) or a full chunk does not fit max_model_len."""
    cfg = engine.config
    runner = getattr(engine, "runner", None)
    if cfg.decode_tokens_in_budget or not getattr(runner, "pad_steps", False) or longest < budget \
            or engine.max_num_seqs < 2:
        return []
    top = engine.max_num_seqs - 1                     # one slot for the chunk's request
    return sorted({min(64 * j, top) for j in range(1, -(-top // 64) + 1)})


def _every_shape(engine, batch: int, log) -> None:
    graphs = getattr(getattr(engine, "runner", None), "graphs", None)
    if graphs is not None and graphs.enabled:
        t0 = time.perf_counter()
        n = graphs.prepare(batch)
        log(f"{n} decode graphs captured in {time.perf_counter() - t0:.1f} s")
    # every power-of-two step size up to the token budget, as one step of several prompts where
    # max_model_len is shorter (a wave of new requests fills the budget: c64 x 128 = 8192 tokens)
    t0 = time.perf_counter()
    vocab = engine.model.config.vocab_size
    budget = engine.scheduler.max_num_batched_tokens
    cap = engine.capacity
    longest = min(cap.max_model_len, cap.num_blocks * cap.block_size if cap.block_bytes else cap.max_model_len) - 1
    # (from 16 tokens: above the decode GEMV's 8; below, mixed steps of a few prompt tokens);
    # where eager steps are padded to a few sizes (model_runner.padded_tokens), every one of them
    runner = getattr(engine, "runner", None)
    if getattr(runner, "pad_steps", False):
        ladder = sorted({padded_tokens(n, budget) for n in range(1, budget + 1)})
    else:
        ladder = [1 << i for i in range(4, budget.bit_length()) if 1 << i <= budget] or [budget]
    sizes = [n for n in ladder if -(-n // max(longest, 1)) <= engine.max_num_seqs]
    # and one odd count: Triton compiles integer arguments divisible by 16 apart from the others
    odd = [sizes[-1] // 2 + 1] if len(sizes) > 1 else []
    biggest = 0
    for n in (sizes + odd if longest > 0 else []):
        # the power-of-two steps as a server meets them: prompts of a few hundred tokens (several
        # sequences per step: attention's varlen runs); the odd one as few prompts as fit
        k = -(-n // longest) if n in odd else max(-(-n // longest), min(engine.max_num_seqs, n // 256))
        drive(engine, [(f"warmup-prefill-{n}-{i}", [(5 * j + i + 1) % vocab for j in range(n // k + (i < n % k))],
                         SamplingParams(max_new_tokens=1)) for i in range(k)])
        biggest = max(biggest, n)
    # a mixed step: a prompt joining requests that decode (their tokens take the prefill path)
    if longest > 40 and engine.max_num_seqs >= 3:
        joined = []

        def join(out):             # after the first output of the decoding pair, a prompt arrives
            if not joined:
                joined.append(out)
                return [("warmup-mixed-2", [(13 * j + 1) % vocab for j in range(37)], SamplingParams(max_new_tokens=2))]
        drive(engine, [(f"warmup-mixed-{i}", [(11 * j + i + 3) % vocab for j in range(5)],
                        SamplingParams(max_new_tokens=4)) for i in range(2)], on_output=join)
    # where decodes ride on top of the budget (decode_tokens_in_budget off), the steps past it: a
    # full chunk beside d decoding requests, for each padded size budget + 64 j (model_runner.padded_tokens)
    riding = _riding_sizes(engine, budget, longest)
    for d in riding:
        joined = []

        def join(out, d=d):
            if not joined and out.request_id == f"warmup-ride-{d}-0":
                joined.append(out)
                return [(f"warmup-ride-{d}-chunk", [(17 * j + d) % vocab for j in range(budget)],
                         SamplingParams(max_new_tokens=1))]
        drive(engine, [(f"warmup-ride-{d}-{i}", [(13 * i + 5) % vocab, 3, 4], SamplingParams(max_new_tokens=4))
                       for i in range(d)], on_output=join)
    # one prompt several chunks long, so a chunk meets a cached prefix longer than itself: attention
    # kernels that plan per shape (cuDNN's) plan now, not in a request
    long = min(longest, 4 * budget)
    if long > budget:
        prompt = [(3 * j + 2) % vocab for j in range(long)]
        drive(engine, [("warmup-long", prompt, SamplingParams(max_new_tokens=1))])
        # and beside a decoding request, as a served long prompt meets them: its chunks are the
        # budget minus the decode (queries padded to a planned length), the prefixes they leave
        # no planned length (keys padded, masked) -- other attention plans than the ones above
        if engine.max_num_seqs >= 2:
            drive(engine, [("warmup-long-decode", [7, 8, 9, 10, 11], SamplingParams(max_new_tokens=long // budget + 8)),
                           ("warmup-long-mixed", prompt[::-1], SamplingParams(max_new_tokens=1))])
    log(f"prefill steps of up to {biggest} tokens" + (f" and a {long}-token prompt" if long > budget else "")
        + f" met in {time.perf_counter() - t0:.1f} s")
