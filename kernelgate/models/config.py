"""Kimi Linear configuration: one dataclass read from either spelling of `config.json`.

The released checkpoints (moonshotai/Kimi-Linear-*) and HF transformers' `KimiLinearConfig`
name the same fields differently (`num_experts` / `num_local_experts`, ...); both are read.
Layer kinds come from `layer_types` (HF) or `linear_attn_config.kda_layers` /
`full_attn_layers` (released, 1-indexed); MLP kinds from `mlp_layer_types` (HF) or
`first_k_dense_replace` (+ `moe_layer_freq`). `to_checkpoint()` writes the released names
(with HF's per-layer lists), which `from_dict` reads back to the same config, field for field.

Sizes are checked when the config is made, with upper bounds (`MAX_SIZE`, `MAX_LAYERS`) so
that a config meant for nothing real fails at once rather than after minutes of building.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import KernelgateError

SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")   # what ops.biased_grouped_topk computes
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "linear_num_heads",
                  "linear_head_dim", "conv_kernel_size", "num_experts", "num_experts_per_token", "n_group",
                  "topk_group")


MAX_SIZE = 2**31 - 1           # any one dimension (kernels index with int32)
MAX_LAYERS = 100_000           # far past any model; per-layer lists stay small


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)

# (our field, names it may have in config.json, first found wins)
_ALIASES = {
    "num_experts": ("num_experts", "num_local_experts"),
    "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "n_group": ("num_expert_group", "n_group"),
    "moe_renormalize": ("moe_renormalize", "norm_topk_prob"),
    "scoring": ("moe_router_activation_func",),
}


@dataclass
class KimiLinearConfig:
    vocab_size: int = 163840
    hidden_size: int = 2304
    intermediate_size: int = 9216          # dense MLP of the first layer(s)
    moe_intermediate_size: int = 1024
    num_hidden_layers: int = 27
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # MLA (NoPE: the "rope" part of the key is shared across heads, no rotary applied)
    num_attention_heads: int = 32
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # KDA
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    conv_kernel_size: int = 4
    # MoE
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 2.446
    scoring: str = "sigmoid"
    # per layer: "kda" | "mla", and "dense" | "moe"
    layer_types: list = field(default_factory=list)
    mlp_types: list = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list = field(default_factory=list)
    dtype: str | None = None               # dtype the checkpoint was saved in

    def __post_init__(self):
        self._check_types()
        n = self.num_hidden_layers
        if not self.layer_types:   # Kimi Linear's 3:1 pattern, MLA every 4th layer
            self.layer_types = ["mla" if (i + 1) % 4 == 0 else "kda" for i in range(n)]
        if not self.mlp_types:
            self.mlp_types = ["dense" if i < 1 else "moe" for i in range(n)]
        for name, kinds in (("layer_types", ("kda", "mla")), ("mlp_types", ("dense", "moe"))):
            v = getattr(self, name)
            bad = [(i, t) for i, t in enumerate(v) if t not in kinds]
            if len(v) != n or bad:
                raise KernelgateError(f"config: {name} must be {n} entries of {'/'.join(map(repr, kinds))}, "
                                      f"got {_short(v, bad)}")
        if self.num_experts % self.n_group:
            raise KernelgateError(f"config: num_experts {self.num_experts} not divisible by n_group {self.n_group}")
        # values that would otherwise fail only at an op's first call
        if self.num_experts_per_token > self.num_experts:
            raise KernelgateError(f"config: num_experts_per_token {self.num_experts_per_token} > num_experts "
                                  f"{self.num_experts}")
        if self.topk_group > self.n_group:
            raise KernelgateError(f"config: topk_group {self.topk_group} > n_group {self.n_group}")
        if self.num_experts_per_token > self.topk_group * (self.num_experts // self.n_group):
            raise KernelgateError(f"config: num_experts_per_token {self.num_experts_per_token} > the "
                                  f"{self.topk_group * (self.num_experts // self.n_group)} experts of topk_group "
                                  f"{self.topk_group} groups")
        if self.scoring not in SCORINGS:
            raise KernelgateError(f"config: moe_router_activation_func {self.scoring!r} not in {SCORINGS}")
        if self.hidden_act != "silu":
            raise KernelgateError(f"config: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.conv_kernel_size < 2:
            raise KernelgateError(f"config: short_conv_kernel_size must be >= 2, got {self.conv_kernel_size}")
        check_eos(self)

    def _check_types(self) -> None:
        check_ints(self, _POSITIVE_INTS)
        _check_layers(self.num_hidden_layers)
        check_ints(self, ("qk_rope_head_dim", "num_shared_experts"), low=0)
        if self.q_lora_rank is not None and (not _is_int(self.q_lora_rank) or not 1 <= self.q_lora_rank <= MAX_SIZE):
            raise KernelgateError(f"config: q_lora_rank must be null or an int in [1, {MAX_SIZE}], "
                                  f"got {self.q_lora_rank!r}")
        check_common(self, numbers=("rms_norm_eps", "routed_scaling_factor"),
                     bools=("tie_word_embeddings", "moe_renormalize"), strings=("hidden_act", "scoring"))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, d: dict) -> "KimiLinearConfig":
        if not isinstance(d, dict):
            raise KernelgateError(f"config: config.json must hold a JSON object, got {type(d).__name__}")
        kw = {}
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
                     "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "topk_group", "routed_scaling_factor",
                     "bos_token_id"):
            if d.get(name) is not None or (name == "q_lora_rank" and name in d):
                kw[name] = d[name]
        for ours, names in _ALIASES.items():
            for nm in names:
                if d.get(nm) is not None:
                    kw[ours] = d[nm]
                    break
        n = kw.get("num_hidden_layers", cls.num_hidden_layers)
        _check_layers(n)
        lin = d.get("linear_attn_config") or {}
        if not isinstance(lin, dict):
            raise KernelgateError(f"config: linear_attn_config must be an object, got {lin!r}")
        kw["linear_num_heads"] = lin.get("num_heads", d.get("linear_num_heads", cls.linear_num_heads))
        kw["linear_head_dim"] = lin.get("head_dim", d.get("linear_head_dim", cls.linear_head_dim))
        kw["conv_kernel_size"] = lin.get("short_conv_kernel_size",
                                         d.get("linear_conv_kernel_dim", cls.conv_kernel_size))
        for name in ("layer_types", "mlp_layer_types"):
            if d.get(name) is not None and not isinstance(d[name], list):
                raise KernelgateError(f"config: {name} must be a list, got {d[name]!r}")
        if d.get("layer_types"):
            kw["layer_types"] = [{"linear_attention": "kda", "full_attention": "mla"}.get(t, t)
                                 for t in d["layer_types"]]
        elif "kda_layers" in lin and "full_attn_layers" in lin:
            types = [None] * n
            for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
                for i in lin[key]:        # 1-indexed in the checkpoint
                    if not _is_int(i) or not 1 <= i <= n:
                        raise KernelgateError(f"config: linear_attn_config.{key} entry {i!r} is not a layer "
                                              f"number in [1, {n}]")
                    types[i - 1] = kind
            kw["layer_types"] = types
        if d.get("mlp_layer_types"):
            kw["mlp_types"] = [{"sparse": "moe"}.get(t, t) for t in d["mlp_layer_types"]]
        else:
            first_dense = d.get("first_k_dense_replace", 1)
            freq = d.get("moe_layer_freq", 1) or 1
            for name, v in (("first_k_dense_replace", first_dense), ("moe_layer_freq", freq)):
                if not _is_int(v) or v < 0:
                    raise KernelgateError(f"config: {name} must be an int >= 0, got {type(v).__name__} {v!r}")
            kw["mlp_types"] = ["moe" if i >= first_dense and i % freq == 0 else "dense" for i in range(n)]
        eos = d.get("eos_token_id")
        kw["eos_token_ids"] = [] if eos is None else ([eos] if not isinstance(eos, list) else list(eos))
        kw["dtype"] = d.get("dtype") or d.get("torch_dtype")
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | Path) -> "KimiLinearConfig":
        return cls.from_dict(config_json(path)[1])

    def to_dict(self) -> dict:
        return asdict(self)

    def to_checkpoint(self) -> dict:
        """config.json for this config: the released names (`moe_router_activation_func`,
        `linear_attn_config`, ...) and HF's per-layer lists; `from_dict` reads it back equal."""
        d = {"model_type": "kimi_linear"}
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "rms_norm_eps", "hidden_act", "tie_word_embeddings", "num_attention_heads", "kv_lora_rank",
                     "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "topk_group",
                     "routed_scaling_factor", "bos_token_id"):
            d[name] = getattr(self, name)
        for ours, names in _ALIASES.items():
            d[names[0]] = getattr(self, ours)
        d["linear_attn_config"] = {"num_heads": self.linear_num_heads, "head_dim": self.linear_head_dim,
                                   "short_conv_kernel_size": self.conv_kernel_size}
        d["layer_types"] = [{"kda": "linear_attention", "mla": "full_attention"}[t] for t in self.layer_types]
        d["mlp_layer_types"] = [{"moe": "sparse"}.get(t, t) for t in self.mlp_types]
        d["eos_token_id"] = list(self.eos_token_ids)
        d["dtype"] = self.dtype
        return d


def _short(v: list, bad: list) -> str:
    """A list for an error message: whole when short, else its length and first wrong entries."""
    if len(v) <= 8:
        return repr(v)
    shown = ", ".join(f"[{i}]={t!r:.40}" for i, t in bad[:3])
    return f"{len(v)} entries" + (f" ({shown}{' ...' if len(bad) > 3 else ''})" if bad else "")


def _check_layers(n) -> None:
    if not _is_int(n) or not 1 <= n <= MAX_LAYERS:
        raise KernelgateError(f"config: num_hidden_layers must be an int in [1, {MAX_LAYERS}], got {type(n).__name__} {n!r}")


def check_ints(cfg, names: tuple, low: int = 1) -> None:
    """Each of `names` an int in [low, MAX_SIZE]."""
    for name in names:
        v = getattr(cfg, name)
        if not _is_int(v) or not low <= v <= MAX_SIZE:
            raise KernelgateError(f"config: {name} must be an int in [{low}, {MAX_SIZE}], got {type(v).__name__} {v!r}")


def check_eos(cfg) -> None:
    """eos_token_ids: int token ids of the vocabulary."""
    bad = [(i, t) for i, t in enumerate(cfg.eos_token_ids) if not _is_int(t) or not 0 <= t < cfg.vocab_size]
    if bad:
        raise KernelgateError(f"config: eos_token_id must be int token ids in [0, {cfg.vocab_size}), "
                              f"got {_short(cfg.eos_token_ids, bad)}")


def check_common(cfg, numbers: tuple, bools: tuple, strings: tuple) -> None:
    """The checks every family's config shares: `numbers` positive and finite, `bools` true / false,
    `strings` strings; bos_token_id, dtype, and the layer / MLP kinds and EOS ids as lists."""
    for name in numbers:
        v = getattr(cfg, name)
        if not _is_number(v) or not math.isfinite(v) or v <= 0:
            raise KernelgateError(f"config: {name} must be a positive number, got {type(v).__name__} {v!r}")
    for name in bools:
        if not isinstance(getattr(cfg, name), bool):
            raise KernelgateError(f"config: {name} must be true / false, got {getattr(cfg, name)!r}")
    for name in strings:
        if not isinstance(getattr(cfg, name), str):
            raise KernelgateError(f"config: {name} must be a string, got {getattr(cfg, name)!r}")
    if cfg.bos_token_id is not None and not _is_int(cfg.bos_token_id):
        raise KernelgateError(f"config: bos_token_id must be an int, got {cfg.bos_token_id!r}")
    if cfg.dtype is not None and not isinstance(cfg.dtype, str):
        raise KernelgateError(f"config: dtype must be a string, got {cfg.dtype!r}")
    if not isinstance(cfg.layer_types, list) or not isinstance(cfg.mlp_types, list) \
            or not isinstance(cfg.eos_token_ids, list):
        raise KernelgateError("config: layer_types, mlp_types and eos_token_ids must be lists")


def tiny(**overrides) -> KimiLinearConfig:
    """The built-in small Kimi-Linear-shaped model (`kernelgate run` with no --model)."""
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=16, v_head_dim=16, linear_num_heads=4, linear_head_dim=16,
              num_experts=8, num_experts_per_token=2, eos_token_ids=[])
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def real_width(num_layers: int = 4, **overrides) -> KimiLinearConfig:
    """Kimi-Linear-48B-A3B layer widths with `num_layers` layers (3:1 KDA:MLA), for benchmarks."""
    kw = dict(num_hidden_layers=num_layers, vocab_size=163840)
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def config_json(path: str | Path) -> tuple[Path, object]:
    """(the config.json file, its parsed contents) of a checkpoint folder or of the file itself."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise KernelgateError(f"load_model: no config.json at {path}")
    try:
        return path, json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise KernelgateError(f"load_model: {path} is not JSON ({e})") from None
