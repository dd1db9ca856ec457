"""OpenAI-compatible HTTP server over the async engine (`kernelgate serve`)."""
from .app import create_app  # noqa: F401
from .jobs import ModelInfo  # noqa: F401
