"""Grouped-query attention over a paged K/V cache (Qwen3-Next / Qwen3.5 full-attention layers):
`paged_attention_decode` (split-KV) and `paged_attention_prefill` (chunks over their cached
prefix), and `rms_norm_rope` (their q / k per-head norm and partial rotary, one launch).
Importing this package declares all three."""
from . import paged_attention_decode, paged_attention_prefill, rms_norm_rope  # noqa: F401
