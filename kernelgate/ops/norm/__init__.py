"""Normalisation ops: gated RMSNorm. Importing the package declares its ops."""
from . import gated_rms_norm  # noqa: F401
