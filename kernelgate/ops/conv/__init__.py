"""Short causal depthwise convolution (KDA's q/k/v conv). Importing the package declares its ops."""
from . import short_conv  # noqa: F401
