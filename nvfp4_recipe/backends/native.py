"""The native NVFP4 GEMM on Blackwell (sm100+): cuBLAS block-scaled FP4 through ``torch._scaled_mm``.

UNTESTED ON HARDWARE: no Blackwell GPU was available. The CPU tests check the scale layout against
cuBLAS's documented one and the whole call against the reference with ``torch._scaled_mm`` replaced
by an emulation of its documented semantics; the plumbing follows torchao 0.18's NVFP4 matmul
(``torchao.prototype.mx_formats.nvfp4_tensor._addmm_nvfp4_dispatch``), which runs on sm100.

What it does: the packed codes go in as ``torch.float4_e2m1fn_x2`` (A (M, K/2) row-major, B as the
column-major (K/2, N) view of its (N, K/2) storage, so nothing is copied), the E4M3 block scales in
cuBLAS's swizzled 128x4 tile layout (torchao's ``to_blocked``; 2d scales are first repeated to one
row per data row), and cuBLAS returns the fp32 product of the inner values. The outer scales and the
bias are then applied in fp32 and the result is rounded once, as in ``reference.scaled_mm``
(torchao instead multiplies a bf16 product by the outer scales, which rounds twice).
``torch.nn.functional.scaled_mm`` (torch >= 2.10) exposes the same cuBLAS kernel.
"""

import torch

from ..formats import BLOCK
from ..operand import NVFP4Operand
from ..reference import apply_outer_scales
from ..spec import Block
from . import register_backend, warn_once
from .reference import ReferenceBackend


def fp4_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU with FP4 tensor cores (compute capability 10.0 or newer)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


def swizzle_scales(scale: torch.Tensor, block: Block) -> torch.Tensor:
    """E4M3 block scales in cuBLAS's block-scaling layout, as ``torch._scaled_mm`` takes them.

    Args:
        scale: float8_e4m3fn, (rows, K/16) for "1d" blocks or (rows/16, K/16) for "2d".
    Returns:
        1-D float8_e4m3fn tensor of ceil(rows/128)*128 * ceil(K/64)*4 scales: the (rows, K/16)
        matrix zero-padded to whole 128x4 tiles, tiles in row-major order, each tile stored as
        ``[r % 32][r // 32][c]`` (cuBLAS docs, "1D block scaling factors layout"; torchao's
        ``to_blocked``).
    """
    from torchao.prototype.mx_formats.utils import to_blocked

    s = scale.view(torch.uint8)
    if Block(block) is Block.D2:
        s = s.repeat_interleave(BLOCK, dim=0)
    return to_blocked(s).view(torch.float8_e4m3fn)


def _unaligned(a: NVFP4Operand, b: NVFP4Operand) -> str:
    """Why cuBLAS cannot take these operands ('' if it can): 16-byte aligned rows of A, B and D."""
    k = 2 * a.qdata.shape[-1]
    if k % 32:
        return f"K = {k} is not a multiple of 32"
    if b.qdata.shape[0] % 4:
        return f"N = {b.qdata.shape[0]} is not a multiple of 4"
    return ""


def native_scaled_mm(a: NVFP4Operand, b: NVFP4Operand, bias=None,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """D (M, N) = (s_a * s_b) * (A_inner @ B_inner^T) + bias on FP4 tensor cores.

    Args:
        a: A (M, K) with codes and blocks along K (1d or 2d block scales), outer scale () or (M,).
        b: B (N, K), likewise, outer () or (N,). bias: optional (N,). out_dtype: result dtype.
    Raises:
        ValueError: K mismatch, or operands not on an sm100+ GPU.
    """
    if a.qdata.shape[-1] != b.qdata.shape[-1]:
        raise ValueError(f"K mismatch: A qdata is {tuple(a.qdata.shape)}, B qdata {tuple(b.qdata.shape)}")
    if not fp4_tensor_cores(a.qdata.device):
        raise ValueError(f"the native NVFP4 GEMM needs an sm100+ GPU, got {a.qdata.device}")
    fp4 = torch.float4_e2m1fn_x2
    acc = torch._scaled_mm(a.qdata.view(fp4), b.qdata.view(fp4).t(),
                           swizzle_scales(a.scale, a.block), swizzle_scales(b.scale, b.block),
                           out_dtype=torch.float32)
    return apply_outer_scales(acc, a.outer_scale, b.outer_scale, bias, out_dtype)


@register_backend
class NativeBackend(ReferenceBackend):
    """sm100+ FP4 tensor cores for the GEMM; quantization is the reference implementation."""

    name = "native"
    traced = True

    def mm(self, a: NVFP4Operand, b: NVFP4Operand, *, bias=None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """As :meth:`Backend.mm`; shapes cuBLAS cannot take fall back to the reference GEMM
        (logged once)."""
        why = _unaligned(a, b)
        if why:
            warn_once(f"native NVFP4 GEMM: {why} (cuBLAS needs 16-byte aligned rows); using the "
                      "reference GEMM for such shapes (logged once)", key="native-unaligned")
            return super().mm(a, b, bias=bias, out_dtype=out_dtype)
        return native_scaled_mm(a, b, bias, out_dtype)
