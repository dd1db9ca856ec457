"""Dense projections in the model dtype: the `linear` op (a one-token GEMV beside PyTorch's GEMM).
Importing the package declares its ops; FP8 projections are quant/fp8_linear."""
from . import linear  # noqa: F401
