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
import torch.nn.functional as F

from ..formats import BLOCK
from ..operand import GroupedOperand, NVFP4Operand
from ..reference import apply_outer_scales
from ..spec import Block, Form
from . import Backend, register_backend, resolved, warn_once
from . import grouped
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
    from torchao.prototype.mx_formats.utils import to_blocked  # a prototype: loaded when used

    s = scale.view(torch.uint8)
    if block == Block.D2:  # a str enum: "2d" too
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
    traced = tuple(p for p in Backend.PRIMITIVES if p != "grouped_mm")
    fakes = {"grouped_mm": grouped.fake_grouped_mm}

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

    def quantize_groups(self, x, offs, row, col, *, seed=0, row_offset=0, col_offset=0, signs=None,
                        transient=(False, False), prepare=None):
        """The Triton backend's, but a rowwise copy with per-group outer scales (fprop's X,
        dgrad's dY) stays codes, transient or not, and ``prepare`` is left as it is:
        ``F.scaled_grouped_mm`` reads codes (:func:`native_unsupported`)."""
        if row is not None and not row.per_token:
            transient = (False, transient[1])
        r, c, _ = resolved("triton").quantize_groups(
            x, offs, row, col, seed=seed, row_offset=row_offset, col_offset=col_offset,
            signs=signs, transient=transient)
        return r, c, prepare

    def quantize_experts(self, w, spec, *, need_t, transient=False):
        """The Triton backend's, with W as codes (what ``F.scaled_grouped_mm`` reads)."""
        return resolved("triton").quantize_experts(w, spec, need_t=need_t)

    def grouped_mm(self, a, b, *, out_dtype=torch.float32):
        """:func:`native_grouped_mm` where it computes the GEMM with one rounding, else the Triton
        grouped GEMM (logged once per reason)."""
        why = native_unsupported(a, b, out_dtype)
        if why:
            warn_once(f"native grouped NVFP4 GEMM: {why}; using the Triton grouped GEMM for such "
                      f"GEMMs (logged once)", key="native-grouped-" + why)
            return resolved("triton").grouped_mm(a, b, out_dtype=out_dtype)
        return native_grouped_mm(a, b)


def native_unsupported(a: GroupedOperand, b, out_dtype: torch.dtype) -> str:
    """Why ``F.scaled_grouped_mm`` cannot compute this grouped GEMM exactly ('' if it can): it
    takes one global scale per group and operand and returns bf16 only, so per-token outer
    scales or another output dtype would round twice; wgrad (2d x 2d) is not wired up."""
    if isinstance(b, GroupedOperand):
        return "wgrad (groups along K) is not wired to scaled_grouped_mm"
    if a.per_token:
        return "per-token outer scales cannot be one global scale per group"
    if out_dtype != torch.bfloat16:
        return f"scaled_grouped_mm returns bfloat16 only, {out_dtype} was asked"
    if Form.VALUES in (a.data.form, b.form):
        return "an operand holds inner values, not codes"
    if a.data.k % 32:
        return f"K = {a.data.k} is not a multiple of 32"
    return ""


def blocked_group_scales(scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The E4M3 block scales (T, K/16) of a rows-grouped operand in the layout
    ``scaled_grouped_mm`` takes for a 2-D A (torchao's ``torch_to_blocked_2d_M_groups``): each
    group's rows padded to a multiple of 128 and laid out with ``to_blocked``, groups one after
    another. Built on the device without the group sizes on the host: (T + 128 G) rows of
    ceil(K/64) * 4 columns, zero padding."""
    from torchao.prototype.mx_formats.utils import to_blocked  # a prototype: loaded when used

    t, cols = scale.shape
    n_groups = offs.shape[0]
    ends = offs.long()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + 127) // 128 * 128
    starts, pstarts = ends - sizes, torch.cumsum(padded, 0) - padded
    group = torch.repeat_interleave(torch.arange(n_groups, device=scale.device), sizes,
                                    output_size=t) if n_groups else sizes
    dest = torch.arange(t, device=scale.device) - starts[group] + pstarts[group]
    rows = (t + 127) // 128 * 128 + 128 * n_groups
    buf = torch.zeros(rows, cols, dtype=torch.uint8, device=scale.device)
    buf.index_copy_(0, dest, scale.view(torch.uint8))
    out_cols = (cols + 3) // 4 * 4
    return to_blocked(buf).view(rows, out_cols).view(torch.float8_e4m3fn)


def native_grouped_mm(a: GroupedOperand, b: NVFP4Operand) -> torch.Tensor:
    """fprop/dgrad on FP4 tensor cores: ``F.scaled_grouped_mm`` with NVFP4 operands (block scales
    ``BlockWise1x16`` in the swizzled 32x4x4 layout, the per-group outer scales as the
    ``TensorWise`` global scales, whose product scales each group's fp32 accumulator before its one
    rounding to bf16). UNTESTED ON HARDWARE (docs/moe.md): the CPU tests replace the call by an
    emulation of its documented semantics.

    Raises:
        ValueError: the operands are not on an sm100+ GPU.
    """
    if not fp4_tensor_cores(a.data.device):
        raise ValueError(f"the native grouped NVFP4 GEMM needs an sm100+ GPU, got {a.data.device}")
    fp4 = torch.float4_e2m1fn_x2
    n_groups = b.qdata.shape[0]
    b_scales = torch.stack([swizzle_scales(b.scale[g], b.block) for g in range(n_groups)])
    rec, swz = F.ScalingType, F.SwizzleType
    return F.scaled_grouped_mm(
        a.data.qdata.view(fp4), b.qdata.view(fp4).transpose(-2, -1),
        [blocked_group_scales(a.data.scale, a.offs), a.data.outer_scale],
        [rec.BlockWise1x16, rec.TensorWise],
        [b_scales, b.outer_scale], [rec.BlockWise1x16, rec.TensorWise],
        swizzle_a=[swz.SWIZZLE_32_4_4, swz.NO_SWIZZLE], swizzle_b=[swz.SWIZZLE_32_4_4, swz.NO_SWIZZLE],
        offs=a.offs, output_dtype=torch.bfloat16)
