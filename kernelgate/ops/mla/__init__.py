"""MLA (multi-head latent attention) ops over the paged latent cache: `mla_decode` (absorbed,
split-KV) and `mla_prefill` (chunked, expanded). Importing this package declares both."""
from . import mla_decode, mla_prefill  # noqa: F401
