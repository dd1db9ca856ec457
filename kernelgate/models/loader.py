"""Load a Kimi Linear checkpoint: config.json + safetensors (one file, or shards with an index).

Two layouts are read, by name:
  released (moonshotai; also HF `save_pretrained`'s default "original format"):
      self_attn.{q,k,v}_proj / {q,k,v}_conv1d [C, 1, W] / f_a_proj / f_b_proj / A_log [1,1,H,1] /
      dt_bias, block_sparse_moe.experts.<e>.w1|w2|w3, block_sparse_moe.gate, ...
  HF transformers internal (`save_pretrained(save_original_format=False)`):
      self_attn.conv1d [3C, 1, W], self_attn.forget_gate.*, mlp.experts.gate_up_proj [E, 2I, D], ...
Both are mapped onto this package's parameters (fused q|k|v, gate|up; A_log [H]; conv [3C, W]).
Anything missing, unexpected or mis-shaped is reported in one error.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch

from ..platform import KernelgateError, default_device
from .config import KimiLinearConfig
from .kimi_linear import FP32_PARAMS, KimiLinearForCausalLM, build

_RENAMES = [(re.compile(r"\.block_sparse_moe\."), ".mlp."),
            (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn.")]
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.num_batches_tracked)$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


def _normalise(key: str) -> str:
    for pat, rep in _RENAMES:
        key = pat.sub(rep, key)
    return key


class _Tensors:
    """In-memory tensors (e.g. an HF model's state_dict), names normalised like a checkpoint's."""

    def __init__(self, tensors: dict):
        self.where = {_normalise(k): v for k, v in tensors.items()}

    def __contains__(self, name):
        return name in self.where

    def get(self, name) -> torch.Tensor:
        return self.where[name]


class _Checkpoint:
    """Tensor names (normalised) -> lazily read tensors across safetensors files."""

    def __init__(self, folder: Path):
        from safetensors import safe_open
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise KernelgateError(f"load_model: no *.safetensors in {folder}")
        self.where, self._handles = {}, []
        for fname in files:
            path = folder / fname
            if not path.exists():
                raise KernelgateError(f"load_model: shard {fname} listed in the index is missing from {folder}")
            h = safe_open(str(path), framework="pt")
            self._handles.append(h)
            for key in h.keys():
                self.where[_normalise(key)] = (h, key)

    def __contains__(self, name):
        return name in self.where

    def get(self, name) -> torch.Tensor:
        h, key = self.where[name]
        return h.get_tensor(key)


def _recipes(name: str, c: KimiLinearConfig):
    """Ways to build parameter `name` from checkpoint tensors: [(sources, combine)], first match wins."""
    W = c.conv_kernel_size
    if name.endswith("self_attn.qkv_proj.weight"):
        base = name[: -len("qkv_proj.weight")]
        return [([base + f"{x}_proj.weight" for x in "qkv"], lambda ts: torch.cat(ts, 0))]
    if name.endswith("self_attn.conv1d.weight"):
        base = name[: -len("conv1d.weight")]
        return [([name], lambda ts: ts[0].reshape(-1, W)),
                ([base + f"{x}_conv1d.weight" for x in "qkv"], lambda ts: torch.cat(ts, 0).reshape(-1, W))]
    if name.endswith("A_log"):
        return [([name], lambda ts: ts[0].reshape(-1))]
    if name.endswith("experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        w13 = [base + f"{e}.w{i}.weight" for e in range(c.num_experts) for i in (1, 3)]
        return [([name], lambda ts: ts[0]),
                (w13, lambda ts: torch.stack([torch.cat(ts[i:i + 2], 0) for i in range(0, len(ts), 2)]))]
    if name.endswith("experts.down_proj"):
        base = name[: -len("down_proj")]
        return [([name], lambda ts: ts[0]),
                ([base + f"{e}.w2.weight" for e in range(c.num_experts)], torch.stack)]
    if name.endswith("gate_up_proj.weight"):
        base = name[: -len("gate_up_proj.weight")]
        return [([base + "gate_proj.weight", base + "up_proj.weight"], lambda ts: torch.cat(ts, 0))]
    if name == "lm_head.weight" and c.tie_word_embeddings:
        return [([name], lambda ts: ts[0]), (["model.embed_tokens.weight"], lambda ts: ts[0])]
    return [([name], lambda ts: ts[0])]


def load_weights(model: KimiLinearForCausalLM, source) -> None:
    """Copy weights from a checkpoint folder, or from a dict of tensors in either layout."""
    ckpt = _Tensors(source) if isinstance(source, dict) else _Checkpoint(Path(source))
    folder = "tensors" if isinstance(source, dict) else source
    used, missing, misshaped = set(), [], []
    for name, p in model.named_parameters():
        recipes = _recipes(name, model.config)
        found = next((r for r in recipes if all(s in ckpt for s in r[0])), None)
        if found is None:
            # report against the layout the checkpoint is closest to; its present parts are not "unexpected"
            best = max(recipes, key=lambda r: sum(s in ckpt for s in r[0]))
            absent = [s for s in best[0] if s not in ckpt]
            used.update(s for s in best[0] if s in ckpt)
            missing.append(name if best[0] == [name] else f"{name} (needs {', '.join(absent[:8])}"
                           + (f" and {len(absent) - 8} more" if len(absent) > 8 else "") + ")")
            continue
        sources, combine = found
        t = combine([ckpt.get(s) for s in sources])
        used.update(sources)
        if tuple(t.shape) != tuple(p.shape):
            misshaped.append(f"{name}: checkpoint {tuple(t.shape)} != model {tuple(p.shape)}")
            continue
        p.copy_(t.to(device=p.device, dtype=p.dtype))
    unexpected = sorted(n for n in ckpt.where if n not in used and not _IGNORED.search(n))
    if missing or unexpected or misshaped:
        def lst(title, items):
            more = f" ... and {len(items) - 20} more" if len(items) > 20 else ""
            return f"\n  {title} ({len(items)}): " + "; ".join(items[:20]) + more if items else ""
        raise KernelgateError(f"load_model: checkpoint {folder} does not match the Kimi Linear config"
                              + lst("missing", missing) + lst("unexpected", unexpected)
                              + lst("mis-shaped", misshaped))


def _dtype(dtype, config: KimiLinearConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or config.dtype or "float32"
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise KernelgateError(f"load_model: dtype {name!r} is not a floating point torch dtype")
    return dt


def load_tokenizer(folder: Path):
    if not any((folder / f).exists() for f in _TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - text in/out is optional; token ids still work
        warnings.warn(f"kernelgate: tokenizer in {folder} not loaded ({type(e).__name__}: {e}); "
                      "use token ids", stacklevel=3)
        return None


def load_model(path, device=None, dtype=None) -> KimiLinearForCausalLM:
    """Load a Kimi Linear checkpoint folder. dtype: None = the checkpoint's (config "dtype")."""
    folder = Path(path)
    if not folder.is_dir():
        raise KernelgateError(f"load_model: {path} is not a folder")
    config = KimiLinearConfig.from_file(folder)
    dt = _dtype(dtype, config)
    model = build(config, device=torch.device(device) if device else default_device(), dtype=dt, seed=None)
    with torch.no_grad():
        load_weights(model, folder)
    model.tokenizer = load_tokenizer(folder)
    return model


__all__ = ["load_model", "load_weights", "FP32_PARAMS"]
