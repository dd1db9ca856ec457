"""Kimi Delta Attention: gate, chunked prefill, recurrent and packed decode. Importing the package declares its ops."""
from . import kda_gate, kda_prefill, kda_decode  # noqa: F401
