"""Normalisation ops: gated RMSNorm, and gated RMSNorm + the output projection. Importing the package
declares its ops."""
from . import gated_rms_norm, gated_rms_norm_linear  # noqa: F401
