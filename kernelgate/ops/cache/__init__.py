"""Writes into the paged caches: `paged_cache_write` (a step's new key / value rows at their slots,
one launch for both). Importing this package declares it."""
from . import paged_cache_write  # noqa: F401
