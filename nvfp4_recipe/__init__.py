"""nvfp4-recipe: NVFP4 training for PyTorch on any device (CPU reference, Triton emulation, Blackwell)."""

from .recipe import NVFP4Recipe

__all__ = ["NVFP4Recipe"]
