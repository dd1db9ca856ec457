"""Mixture of experts: router logits, routing, fused experts, the clamped SwiGLU activation. Importing the package declares its ops."""
from . import moe_routing, fused_experts, fused_experts_fp8, router_logits, silu_and_mul_clamp  # noqa: F401
