"""Gated DeltaNet (Qwen3-Next, Qwen3.5): gate, chunked prefill, recurrent and packed decode.

KDA's delta rule with one log-decay per value head instead of one per channel, and grouped
value attention (HV value heads, HK q/k heads, HV % HK == 0: v head h reads q/k head
h // (HV // HK), as transformers' repeat_interleave does). Importing the package declares its ops."""
from . import gdn_gate, gdn_prefill, gdn_decode  # noqa: F401
