"""DeepSeek V3.2 / V4 indexer: fused q transform, fp8 key cache store, paged logits. Importing the package declares its ops."""
from . import indexer_q, indexer_k_cache, fp8_paged_mqa_logits  # noqa: F401
