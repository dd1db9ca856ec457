"""Flags shared by `run` and `serve`, each checked when parsed: a bad value is one line and rc 2.

The engine flags have vLLM's names and meanings and go to `Engine(...)` as keyword
arguments; a flag left unset keeps the engine's default.
"""
from __future__ import annotations

import argparse
import math
import os

from ..platform import KernelgateError

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}

ENGINE_FLAGS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization",
                "block_size", "num_cache_blocks", "tensor_parallel_size", "enable_expert_parallel",
                "scheduler_delay_factor")


def dtype(s: str) -> str:
    if s not in DTYPES:
        raise argparse.ArgumentTypeError(f"{s!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[s]


def device(s: str) -> str:
    """A torch device this machine has ('cuda:1' needs two CUDA devices)."""
    import torch
    try:
        dev = torch.device(s)
    except (RuntimeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{s!r} is not a torch device ({str(e).splitlines()[0]})") from None
    if dev.type in ("cpu", "meta"):
        return s
    mod = getattr(torch, dev.type, None)
    available = getattr(mod, "is_available", lambda: False)
    if mod is None or not available():
        raise argparse.ArgumentTypeError(f"{s!r}: this machine (torch {torch.__version__}) has no {dev.type} device")
    count = getattr(mod, "device_count", lambda: 1)()
    if dev.index is not None and dev.index >= count:
        raise argparse.ArgumentTypeError(f"{s!r}: only {count} {dev.type} device(s) here")
    return s


def int_at_least(lo: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
        if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"must be a finite number in {'(' if lo_open else '['}{lo}, {hi}], got {s}")
        return v
    return parse


def check_env() -> None:
    """Environment knobs the engine reads, checked up front."""
    g = os.environ.get("KERNELGATE_GRAPHS")
    if g is not None and g not in ("0", "1"):
        raise KernelgateError(f"KERNELGATE_GRAPHS={g!r}: must be 0 (eager decode) or 1 (device graphs)")


def add_model_args(p) -> None:
    p.add_argument("--model", help="checkpoint folder (default: the built-in small model, seeded weights, "
                                   "byte tokenizer)")
    p.add_argument("--device", type=device, help="torch device (default: the platform's)")
    p.add_argument("--dtype", type=dtype, help="float32 | bfloat16 | float16 (default: the checkpoint's; "
                                               "built-in: float32)")


def add_engine_args(p, max_num_seqs_default: int | None = None) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int_at_least(1), default=max_num_seqs_default,
                   help="sequences in flight at once")
    g.add_argument("--max-model-len", type=int_at_least(2), default=4096,
                   help="longest prompt + output, in tokens (default 4096)")
    g.add_argument("--max-num-batched-tokens", type=int_at_least(1), help="tokens per engine step")
    g.add_argument("--gpu-memory-utilization", type=float_in(0.0, 1.0, lo_open=True),
                   help="share of device memory to use (0, 1]")
    g.add_argument("--block-size", type=int_at_least(1), help="cache block size in tokens")
    g.add_argument("--num-cache-blocks", type=int_at_least(1), help="pin the number of cache blocks")
    g.add_argument("--tensor-parallel-size", "--tp", type=int_at_least(1), dest="tensor_parallel_size",
                   help="run the model sharded over N processes, one per device (default 1)")
    g.add_argument("--scheduler-delay-factor", type=float_in(0.0, 1000.0),
                   help="while requests run, admit new prompts once the oldest waiting one has waited this many "
                        "times the last admitting step (0: at once; default 0, serve: see its help)")
    g.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="with --tp N: each rank holds E/N routed experts instead of a slice of every expert")


def engine_kwargs(args) -> dict:
    return {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k, None) is not None}
