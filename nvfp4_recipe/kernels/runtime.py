"""The kernels' runtime layer: where they run and how they are launched.

The interpreter flag (``TRITON_INTERPRET=1``, read once at import as ``triton.jit`` reads it),
device queries cached per device (the SM count sizes persistent grids; the compute capability picks
hardware paths), the check that tensors can run the kernels at all, scalar arguments given by value
or as device pointers, and the autotuner's tile pruning. Imports nothing from the package.
"""

import functools
import os
from typing import Tuple, Union

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRET


@functools.lru_cache(maxsize=None)
def _cuda_props(device: torch.device):
    """``torch.cuda.get_device_properties`` of a CUDA ``device``, cached: the uncached query costs
    several µs of host time, and a layer's fwd+bwd asks a dozen times."""
    return torch.cuda.get_device_properties(device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, the size of a persistent grid (4 under the
    interpreter or off CUDA)."""
    if interpreting() or device.type != "cuda":
        return 4
    return _cuda_props(device).multi_processor_count


def capability(device: torch.device) -> Tuple[int, int]:
    """(major, minor) compute capability of a CUDA ``device``."""
    props = _cuda_props(device)
    return props.major, props.minor


def has_e4m3_convert(device: torch.device) -> bool:
    """Whether ``device`` converts E4M3 to fp16 in hardware (CUDA sm89+), which the inline-PTX
    dequantization and the quantize kernels' inner-value output need."""
    return device.type == "cuda" and capability(device) >= (8, 9)


def inner_values_supported(device: torch.device) -> bool:
    """Whether the quantize kernels can write fp16 inner values on ``device`` (E4M3 conversion,
    or the interpreter)."""
    return interpreting() or has_e4m3_convert(device)


def ptx_dequant(device: torch.device) -> bool:
    """Whether the kernels can use the inline-PTX dequantization (a GPU with E4M3 conversion)."""
    return not interpreting() and has_e4m3_convert(device)


def check_runnable(device: torch.device) -> None:
    """Raise ValueError unless the kernels can run on ``device`` (CUDA, or the interpreter)."""
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton NVFP4 kernels need CUDA tensors (or TRITON_INTERPRET=1 to run "
                         f"them in the Triton interpreter), got tensors on {device}")


def prune_wide_tiles(tile_cols):
    """An autotune ``early_config_prune``: drops the configs whose tile spans more columns
    (``tile_cols(config)``) than the matrix's K rounded up to a power of two (at least 128), whose
    lanes would mostly be masked off (e.g. K = 512 in a small model), keeping at least the last
    config; with NVFP4_AUTOTUNE=0 keeps only the first survivor (no tuning runs)."""
    def prune(configs, named_args, **kwargs):
        width = max(128, triton.next_power_of_2(named_args["K"]))
        fit = [c for c in configs if tile_cols(c) <= width] or list(configs[-1:])
        return fit[:1] if os.environ.get("NVFP4_AUTOTUNE") == "0" else fit
    return prune


def scalar(v: Union[int, torch.Tensor], device) -> Tuple[Union[int, torch.Tensor], bool]:
    """A seed/offset as a kernel argument: an int by value, a tensor as a device pointer."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype.is_floating_point:
            raise TypeError(f"seeds and offsets must be ints or one-element integer tensors, got {v}")
        return v.to(device=device, dtype=torch.int64, non_blocking=True).reshape(()), True
    return int(v), False


@triton.jit
def scalar_arg(arg, IS_PTR: tl.constexpr):
    """A scalar kernel argument given either by value or as a pointer to a device scalar."""
    if IS_PTR:
        return tl.load(arg)
    else:
        return arg
