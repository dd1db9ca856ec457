"""Quantized weights: FP8 e4m3fn helpers (fp8_weights: quantize / dequantize, block and per-channel
scales) and the fp8_linear op. Importing the package declares its ops; the FP8 MoE experts live in
moe/ (fused_experts_fp8)."""
from . import fp8_linear  # noqa: F401
from .fp8_weights import (dequantize_fp8, quantize_fp8_block, quantize_fp8_channel,  # noqa: F401
                          quantize_fp8_groups)
