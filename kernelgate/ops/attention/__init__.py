"""Grouped-query attention over a paged K/V cache (Qwen3-Next / Qwen3.5 full-attention layers):
`paged_attention_decode` (split-KV) and `paged_attention_prefill` (chunks over their cached
prefix). Importing this package declares both."""
from . import paged_attention_decode, paged_attention_prefill  # noqa: F401
