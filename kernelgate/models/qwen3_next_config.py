"""Gated DeltaNet hybrid configuration (Qwen3-Next, Qwen3.5-MoE text): one dataclass read from
HF `config.json`.

model_type `qwen3_next` keeps its fields at the top level; `qwen3_5_moe` (the multimodal
checkpoint) keeps the language model's in `text_config` (`tie_word_embeddings` may sit at
either level), `qwen3_5_moe_text` at the top. Rotary settings come from `rope_parameters`
(transformers 5) or the older top-level `rope_theta` / `partial_rotary_factor`. Layer kinds
come from `layer_types` ("linear_attention" / "full_attention") or `full_attention_interval`
(every n-th layer full attention); MLP kinds from `mlp_only_layers` / `decoder_sparse_step`
(Qwen3-Next) -- Qwen3.5-MoE has MoE in every layer.

Sizes are checked when the config is made (bounds shared with Kimi Linear's config).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import KernelgateError
from .config import MAX_SIZE, _check_layers, _is_int, _short, check_common, check_eos, check_ints

MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
LAYER_KINDS = ("linear_attention", "full_attention")
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "conv_kernel_size", "num_experts", "num_experts_per_token",
                  "moe_intermediate_size")
# (our field, its name in config.json)
_NAMES = {"num_experts_per_token": "num_experts_per_tok", "conv_kernel_size": "linear_conv_kernel_dim"}
_PLAIN = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "rms_norm_eps", "hidden_act",
          "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias", "linear_num_key_heads",
          "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "num_experts",
          "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "bos_token_id")


@dataclass
class Qwen3NextConfig:
    model_type: str = "qwen3_next"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int | None = 5632    # dense MLP layers (mlp_only_layers); None: there are none
    num_hidden_layers: int = 48
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # gated full attention (GQA, per-head q/k norm, partial rotary, sigmoid output gate)
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    # Gated DeltaNet (value heads a multiple of key heads)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    conv_kernel_size: int = 4
    # MoE: softmax top-k routing, one gated shared expert
    num_experts: int = 512
    num_experts_per_token: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512     # 0: no shared expert
    norm_topk_prob: bool = True
    # per layer: "linear_attention" | "full_attention", and "dense" | "moe"
    layer_types: list = field(default_factory=list)
    mlp_types: list = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list = field(default_factory=list)
    dtype: str | None = None

    def __post_init__(self):
        self._check_types()
        n = self.num_hidden_layers
        if not self.layer_types:     # full attention every 4th layer
            self.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
        if not self.mlp_types:
            self.mlp_types = ["moe"] * n
        for name, kinds in (("layer_types", LAYER_KINDS), ("mlp_types", ("dense", "moe"))):
            v = getattr(self, name)
            bad = [(i, t) for i, t in enumerate(v) if t not in kinds]
            if len(v) != n or bad:
                raise KernelgateError(f"config: {name} must be {n} entries of {'/'.join(map(repr, kinds))}, "
                                      f"got {_short(v, bad)}")
        if self.model_type not in MODEL_TYPES:
            raise KernelgateError(f"config: model_type {self.model_type!r} not in {MODEL_TYPES}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise KernelgateError(f"config: linear_num_value_heads {self.linear_num_value_heads} is not a multiple "
                                  f"of linear_num_key_heads {self.linear_num_key_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise KernelgateError(f"config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                                  f"num_key_value_heads {self.num_key_value_heads}")
        if self.num_experts_per_token > self.num_experts:
            raise KernelgateError(f"config: num_experts_per_tok {self.num_experts_per_token} > num_experts "
                                  f"{self.num_experts}")
        rd = self.rotary_dim
        if rd < 2 or rd % 2 or rd > self.head_dim:
            raise KernelgateError(f"config: partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {rd} "
                                  f"of head_dim {self.head_dim} (must be even, in [2, head_dim])")
        if self.hidden_act != "silu":
            raise KernelgateError(f"config: hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.attention_bias:
            raise KernelgateError("config: attention_bias true is not supported (q/k/v/o projections without bias)")
        if self.conv_kernel_size < 2:
            raise KernelgateError(f"config: linear_conv_kernel_dim must be >= 2, got {self.conv_kernel_size}")
        if "dense" in self.mlp_types and self.intermediate_size is None:
            raise KernelgateError("config: intermediate_size is needed by the dense MLP layers (mlp_only_layers)")
        check_eos(self)

    def _check_types(self) -> None:
        check_ints(self, _POSITIVE_INTS)
        _check_layers(self.num_hidden_layers)
        check_ints(self, ("shared_expert_intermediate_size",), low=0)
        v = self.intermediate_size
        if v is not None and (not _is_int(v) or not 1 <= v <= MAX_SIZE):
            raise KernelgateError(f"config: intermediate_size must be null or an int in [1, {MAX_SIZE}], got {v!r}")
        check_common(self, numbers=("rms_norm_eps", "rope_theta", "partial_rotary_factor"),
                     bools=("tie_word_embeddings", "norm_topk_prob", "attention_bias"),
                     strings=("hidden_act", "model_type"))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN short conv: q | k | v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim \
            + self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_dict(cls, d: dict) -> Qwen3NextConfig:
        if not isinstance(d, dict):
            raise KernelgateError(f"config: config.json must hold a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "qwen3_next")
        top = d
        if model_type == "qwen3_5_moe":
            d = d.get("text_config")
            if not isinstance(d, dict):
                raise KernelgateError(f"config: text_config must be an object for model_type 'qwen3_5_moe', got {d!r}")
        kw = {"model_type": model_type}
        for name in _PLAIN:
            if d.get(name) is not None:
                kw[name] = d[name]
        for ours, theirs in _NAMES.items():
            if d.get(theirs) is not None:
                kw[ours] = d[theirs]
        if model_type != "qwen3_next" and "intermediate_size" not in kw:
            kw["intermediate_size"] = None         # every layer is MoE
        tie = d.get("tie_word_embeddings", top.get("tie_word_embeddings"))
        if tie is not None:
            kw["tie_word_embeddings"] = tie
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise KernelgateError(f"config: rope_parameters must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise KernelgateError(f"config: rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
        for name in ("rope_theta", "partial_rotary_factor"):
            v = rope.get(name, d.get(name))
            if v is not None:
                kw[name] = v
        n = kw.get("num_hidden_layers", cls.num_hidden_layers)
        _check_layers(n)
        for name in ("layer_types", "mlp_only_layers"):
            if d.get(name) is not None and not isinstance(d[name], list):
                raise KernelgateError(f"config: {name} must be a list, got {d[name]!r}")
        if d.get("layer_types"):
            kw["layer_types"] = list(d["layer_types"])
        else:
            every = d.get("full_attention_interval", 4)
            if not _is_int(every) or every < 1:
                raise KernelgateError(f"config: full_attention_interval must be an int >= 1, got {every!r}")
            kw["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        if model_type == "qwen3_next":
            only = d.get("mlp_only_layers") or []
            step = d.get("decoder_sparse_step", 1)
            if not _is_int(step) or step < 1:
                raise KernelgateError(f"config: decoder_sparse_step must be an int >= 1, got {step!r}")
            experts = kw.get("num_experts", cls.num_experts)
            kw["mlp_types"] = ["moe" if i not in only and experts and (i + 1) % step == 0 else "dense"
                               for i in range(n)]
        eos = d.get("eos_token_id", top.get("eos_token_id"))
        kw["eos_token_ids"] = [] if eos is None else ([eos] if not isinstance(eos, list) else list(eos))
        kw["dtype"] = d.get("dtype") or d.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype")
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_checkpoint(self) -> dict:
        """config.json for this config in transformers' layout for its model_type (Qwen3.5-MoE's
        language model under text_config); `from_dict` reads it back equal."""
        d = {name: getattr(self, name) for name in _PLAIN}
        d.update({theirs: getattr(self, ours) for ours, theirs in _NAMES.items()})
        d.update(model_type=self.model_type, tie_word_embeddings=self.tie_word_embeddings,
                 layer_types=list(self.layer_types), eos_token_id=list(self.eos_token_ids), dtype=self.dtype,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                  "partial_rotary_factor": self.partial_rotary_factor})
        if self.model_type == "qwen3_next":
            d.update(mlp_only_layers=[i for i, t in enumerate(self.mlp_types) if t == "dense"], decoder_sparse_step=1)
        elif "dense" in self.mlp_types:
            raise KernelgateError(f"config: model_type {self.model_type!r} has MoE in every layer; dense layers "
                                  f"need model_type 'qwen3_next'")
        if self.model_type == "qwen3_5_moe":
            return {"model_type": "qwen3_5_moe", "text_config": d, "tie_word_embeddings": self.tie_word_embeddings}
        return d


def tiny(**overrides) -> Qwen3NextConfig:
    """A small Qwen3-Next-shaped model (3 GDN layers, 1 full attention, GVA 2 -> 4 heads)."""
    kw = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_token": 2,
              "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
    kw.update(overrides)
    return Qwen3NextConfig(**kw)
