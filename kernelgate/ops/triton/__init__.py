"""Portable Triton kernels, one file per op family; imported lazily by the registry."""
