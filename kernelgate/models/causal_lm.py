"""What every model family's causal LM is to the engine: a backbone that turns a step's packed
tokens into hidden states, and a vocabulary-parallel LM head.

A family (kimi_linear.py, qwen3_next.py) subclasses `CausalLM` with its layers (`hidden`) and its
cache (`new_cache`, `block_bytes`, `slot_bytes`); the engine, the loader and tensor parallel use
only this interface, so the family is a model detail, not an engine branch.

    logits = model.step(tokens, batch, cache)   # one engine step: each sequence's last token [N, V] fp32
    logits = model(token_ids)                   # a plain forward [B, T] -> [B, T, V] in the model dtype
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import KernelgateError
from . import quant
from .batch import StepBatch
from .parallel import SINGLE, Parallel, column, materialize


class CausalLM(nn.Module):
    """A family's subclass defines hidden(tokens [T], batch, cache) -> final normed hidden states
    [T, D], new_cache(num_slots, num_blocks, block_size, num_snapshots=0), block_bytes(block_size)
    (one cache block over all attention layers) and slot_bytes() (one sequence's recurrent and
    conv states over all linear-attention layers, this rank's heads)."""

    def __init__(self, config, backbone: nn.Module, par: Parallel = SINGLE):
        """par: this process's rank of a tensor-parallel group (kernelgate.models.parallel); the
        vocabulary-parallel logits are gathered, so step() / forward() return all of V."""
        super().__init__()
        self.config, self.par = config, par
        self.model = backbone
        self.lm_head = column(config.hidden_size, config.vocab_size, par, "vocab_size", quantize=False)
        self.tokenizer = None
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def tp_size(self) -> int:
        return self.par.size

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, batch: StepBatch, cache) -> torch.Tensor:
        """One engine step -> fp32 logits of each sequence's last new token [N, V]."""
        h = self.hidden(tokens, batch, cache)
        if not batch.decode:          # a decode step's rows are its sequences' last tokens already
            h = h[batch.last_token_index]
        return self.par.gather_last(self.lm_head(h).float())

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, T] (each row one sequence, no padding) -> logits [B, T, V] in model dtype."""
        if token_ids.dim() != 2 or token_ids.shape[1] == 0:
            raise KernelgateError(f"{type(self).__name__}: token_ids must be [B, T] with T >= 1, "
                                  f"got shape {tuple(token_ids.shape)}")
        B, T = token_ids.shape
        cache = self.new_cache(B, B, T)          # one block of exactly T positions per sequence
        batch = StepBatch.build([T] * B, list(range(B)), [0] * B, self.device, [[i] for i in range(B)], T)
        batch.decode = False                     # a one-token forward is a prefill, not a decode step
        h = self.hidden(token_ids.to(self.device).reshape(-1), batch, cache)
        return self.par.gather_last(self.lm_head(h)).view(B, T, -1)


def build_model(cls, config, device, dtype, seed: int | None, par: Parallel, quantization, fp32_params: tuple,
                random_weights):
    """A family's `build`: cls(config, par) with every parameter allocated once, in its final dtype,
    on `device` (fp32_params in fp32): no fp32 or host copy of the model is ever made; seeded
    random_weights(model, seed) unless seed is None (then uninitialised). quantization: "fp8" (or a
    quant.Fp8): projections and experts as FP8 codes + scales, activations in `dtype` (quant.py)."""
    fp8 = quant.scheme(quantization)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise KernelgateError(f"build: dtype must be a floating point torch.dtype, got {dtype!r}")
    device = torch.device(device or "cpu")
    with torch.device("meta"):
        model = cls(config, par)
    if fp8 is not None:
        quant.convert(model, fp8)
    materialize(model, dtype, device, fp32_params)
    if seed is not None:
        with torch.no_grad():
            random_weights(model, seed)
    return model.eval()


def shared_recipes(name: str, shape: tuple, c, expert_leaf) -> list:
    """The checkpoint recipes (models/loader.py's format) every family ends with: stacked experts
    ([E, 2I, D] gate | up, [E, D, I] down) from one tensor per expert and projection, named by
    expert_leaf(e, "gate" | "up" | "down"); a dense MLP's gate | up from its gate and up; a tied LM
    head from the embeddings; else the parameter's own name."""
    if name.endswith("experts.gate_up_proj"):
        base, I = name[: -len("gate_up_proj")], shape[1] // 2
        return [[(name, ())], [(base + expert_leaf(e, w), (e, slice(j * I, (j + 1) * I)))
                               for e in range(c.num_experts) for j, w in enumerate(("gate", "up"))]]
    if name.endswith("experts.down_proj"):
        base = name[: -len("down_proj")]
        return [[(name, ())], [(base + expert_leaf(e, "down"), (e,)) for e in range(c.num_experts)]]
    if name.endswith("gate_up_proj.weight"):
        base, I = name[: -len("gate_up_proj.weight")], shape[0] // 2
        return [[(name, ())], [(base + "gate_proj.weight", (slice(0, I),)), (base + "up_proj.weight", (slice(I, 2 * I),))]]
    if name == "lm_head.weight" and c.tie_word_embeddings:
        return [[(name, ())], [("model.embed_tokens.weight", ())]]
    return [[(name, ())]]
