"""Request checks at the engine's public edge: one clear line naming the argument."""
from __future__ import annotations

import torch

from ..checks import is_int
from ..errors import KernelgateError


def check_prompt(prompt, vocab: int, who: str) -> list:
    """Token ids (list / tuple of ints, or a 1-D integer tensor) -> list of ints in [0, vocab)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise KernelgateError(f"engine: {who}: prompt tensor must be 1-D integer, got "
                                  f"{prompt.dtype} of shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise KernelgateError(f"engine: {who}: prompt must be a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise KernelgateError(f"engine: {who} has an empty prompt")
    exact = set(map(type, prompt)) == {int}            # (the common case first: one pass over the types)
    if not exact:
        bad = next((t for t in prompt if not is_int(t)), None)
        if bad is not None:
            raise KernelgateError(f"engine: {who}: token ids must be ints, got {type(bad).__name__} {bad!r}")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise KernelgateError(f"engine: {who} has token ids outside [0, {vocab})")
    return list(prompt) if exact else [int(t) for t in prompt]
