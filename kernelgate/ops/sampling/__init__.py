from . import greedy_tokens  # noqa: F401
