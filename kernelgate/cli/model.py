"""The model a command runs: a checkpoint folder, or the built-in one.

The built-in model is the small Kimi-Linear-shaped config (`models.tiny()`) with seeded
weights and the byte tokenizer (`kernelgate.tokenizer`), whose two end tokens are its EOS
ids, so text in / text out and chat work with no checkpoint.
"""
from __future__ import annotations

BUILTIN = "kernelgate-builtin"


def builtin_model(device=None, dtype=None, seed: int = 0, quantization=None):
    import torch

    from ..models import build, tiny
    from ..platform import default_device
    from ..text.byte_tokenizer import ByteTokenizer
    tok = ByteTokenizer()
    config = tiny(vocab_size=tok.vocab_size, eos_token_ids=list(tok.eos_token_ids))
    model = build(config, device=device or default_device(), dtype=getattr(torch, dtype or "float32"), seed=seed,
                  quantization=quantization)
    model.tokenizer = tok
    return model


def load(args):
    """(model, description) from --model / --device / --dtype / --quantization."""
    from .. import load_model, registry
    q = getattr(args, "quantization", None)
    if args.model:
        registry.preload()     # kernel modules and libraries (fla: seconds) import while the weights are read
        tp = dict(tensor_parallel_size=getattr(args, "tensor_parallel_size", None) or 1,
                  enable_expert_parallel=bool(getattr(args, "enable_expert_parallel", None)))
        return load_model(args.model, device=args.device, dtype=args.dtype, quantization=q, **tp), args.model
    return builtin_model(args.device, args.dtype, quantization=q), "built-in tiny Kimi Linear (seeded) + byte tokenizer"


def load_tokenizer(args):
    """The tokenizer `load(args)` gives its model, without loading the model."""
    if args.model:
        from pathlib import Path

        from ..models.loader import load_tokenizer as from_folder
        return from_folder(Path(args.model))
    from ..text.byte_tokenizer import ByteTokenizer
    return ByteTokenizer()
