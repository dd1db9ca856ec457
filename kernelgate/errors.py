"""The one error kernelgate raises at its users."""


class KernelgateError(ValueError):
    """Bad input or configuration; the message names the op (or flag), the argument and the
    constraint, in one line."""
