"""Triton kernels of nvfp4-recipe (tensors in, tensors out; no import of the rest of the package)."""
