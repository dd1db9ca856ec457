"""Flags shared by `run`, `serve` and `warmup`, each checked when parsed: a bad value is one line
and rc 2.

The engine flags are built from `EngineConfig`'s fields (kernelgate/config.py: vLLM's names,
meanings, defaults and bounds, written once there); a flag left unset keeps the default.
"""
from __future__ import annotations

import argparse
import math


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}


def apply_env() -> None:
    """The registry as KERNELGATE_PLATFORM / KERNELGATE_FORCE say (a command's own processes too)."""
    from .. import envs, registry
    registry.refresh()
    registry.parse_overrides(envs.get("KERNELGATE_FORCE"))  # unknown names fail now


def dtype(s: str) -> str:
    if s not in DTYPES:
        raise argparse.ArgumentTypeError(f"{s!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[s]


def quantization(s: str) -> str:
    from ..models.quant import QUANTIZATIONS
    if s not in QUANTIZATIONS:
        raise argparse.ArgumentTypeError(f"{s!r} is not one of {', '.join(QUANTIZATIONS)}")
    return s


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


def int_in(lo: int, hi: int):
    def parse(s: str) -> int:
        v = int_at_least(-2**63)(s)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
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


def add_model_args(p) -> None:
    p.add_argument("--model", help="checkpoint folder (default: the built-in small model, seeded weights, "
                                   "byte tokenizer)")
    p.add_argument("--device", type=device, help="torch device (default: the platform's)")
    p.add_argument("--dtype", type=dtype, help="float32 | bfloat16 | float16 (default: the checkpoint's; "
                                               "built-in: float32)")
    p.add_argument("--quantization", type=quantization, help="fp8: quantize the projections and experts to "
                   "128 x 128 block FP8 as the weights load (an FP8 checkpoint loads as FP8 without it)")


def add_engine_args(p, **defaults) -> None:
    """One flag per EngineConfig field (`--max-num-seqs`, ...); `defaults` override the config's
    defaults for this command (shown in --help)."""
    from ..config import knobs
    g = p.add_argument_group("engine")
    for f in knobs():
        m = f.metadata
        if not m["flag"]:
            continue
        flag = "--" + f.name.replace("_", "-")
        names = [flag, "--tp"] if f.name == "tensor_parallel_size" else [flag]
        default = defaults.get(f.name, f.default)
        shown = f" (default {default})" if default is not None and f.type != "bool" else ""
        if f.type == "bool":
            g.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=m["help"] + f" (default {'on' if default else 'off'})")
        elif f.type.startswith("int"):
            g.add_argument(*names, dest=f.name, type=int_at_least(m["lo"]), default=defaults.get(f.name),
                           metavar="N", help=m["help"] + shown)
        else:
            g.add_argument(*names, dest=f.name, type=float_in(m["lo"], m["hi"], lo_open=m["lo_open"]),
                           default=defaults.get(f.name), metavar="X", help=m["help"] + shown)


def engine_config(args, **defaults):
    """The EngineConfig the flags ask for (unset flags: `defaults`, then the config's defaults)."""
    from ..config import EngineConfig, names
    chosen = {**defaults, **{k: getattr(args, k) for k in names() if getattr(args, k, None) is not None}}
    return EngineConfig.of(None, **chosen)
