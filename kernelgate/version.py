"""The package version (read without importing anything else: `kernelgate --version`)."""
__version__ = "0.1.0"
