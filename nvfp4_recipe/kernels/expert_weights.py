"""NVFP4 quantization of mixture-of-experts weights: G experts' (N, K) weights stacked as one
(G, N, K) tensor, each expert with its own per-tensor outer scale.

2D 16x16 blocks: W_g and its exact transpose from one read, one launch for all experts
(``quantize.quantize_2d_tile`` per expert). 1D blocks: W_g along K and W_g^T along N, each a
``grouped_quantize.quantize_grouped`` rowwise copy of the stacked experts as token groups. Expert
g's SR stream has counter base ``offset + g * N * K / 16`` (docs/moe.md).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..operand import NVFP4Operand
from ..spec import Block, Form, QuantSpec
from .amax import check_matrix
from .four_over_six import four_over_six_constexprs, four_over_six_names
from .grouped_amax import grouped_amax_pass
from .grouped_quantize import quantize_configs, quantize_grouped, quantize_prune
from .quantize import (IntOrTensor, check_inner, empty_2d, output_pointers, quantize_2d_tile,
                       scales_as_e4m3, u32)
from .runtime import Launcher, autotune, cdiv, check_runnable, scalar, scalar_arg


@autotune(configs=quantize_configs(),
          key=["N", "K", "W", "WT", "SR", "HAS_AMAX_SCALE", "INNER", *four_over_six_names("")],
          prune=quantize_prune(""))
@triton.jit
def _experts_2d_kernel(w_ptr, N, K, stride_g, stride_n, stride_k, amax_ptr, amax_scale, seed_arg,
                       off_arg, mul16, q_ptr, s_ptr, qt_ptr, st_ptr, o_ptr,
                       W: tl.constexpr, WT: tl.constexpr, SR: tl.constexpr,
                       HAS_AMAX_SCALE: tl.constexpr, INNER: tl.constexpr,
                       FOUR_OVER_SIX_E4M3_MAX: tl.constexpr, FOUR_OVER_SIX_MSE: tl.constexpr,
                       FOUR_OVER_SIX_FAST_MATH: tl.constexpr, SEED_PTR: tl.constexpr,
                       OFF_PTR: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr):
    """``quantize.quantize_2d_tile`` of expert program_id(2)'s W_g (N, K), with its own amax and
    outer scale and the SR counter base off + g * N * K / 16; W and W^T are stacked per expert
    (W's inner values too, with INNER)."""
    g = tl.program_id(2).to(tl.int64)
    words = (N // 16) * K  # int64 words of one expert's codes, W_g (N, K/2 bytes) or W_g^T
    scales = (N // 16) * (K // 16)
    off = u32(scalar_arg(off_arg, OFF_PTR)) + u32(g) * u32(words)
    q_g = q_ptr + g * (16 * words if INNER else words)  # N K float16 inner values per expert
    quantize_2d_tile(w_ptr + g * stride_g, N, K, stride_n, stride_k, amax_ptr + g, amax_scale,
                     scalar_arg(seed_arg, SEED_PTR), off, mul16, q_g, s_ptr + g * scales,
                     qt_ptr + g * words, st_ptr + g * scales, o_ptr + g,
                     tl.program_id(0), tl.program_id(1), W, WT, SR, HAS_AMAX_SCALE, INNER,
                     FOUR_OVER_SIX_E4M3_MAX, FOUR_OVER_SIX_MSE, FOUR_OVER_SIX_FAST_MATH, BB, BC)


_EXPERTS_2D = Launcher(_experts_2d_kernel)


def expert_offsets(groups: int, rows: int, device) -> torch.Tensor:
    """int32 (groups,) ends of ``groups`` groups of ``rows`` rows each: the experts of a stacked
    (G * rows, K) weight as token groups."""
    return torch.arange(1, groups + 1, dtype=torch.int32, device=device) * rows


def quantize_experts(w: torch.Tensor, spec: QuantSpec, *, write_w: bool = True,
                     write_wt: bool = True, seed: IntOrTensor = 0, offset: IntOrTensor = 0,
                     inner: bool = False,
                     ) -> Tuple[Optional[NVFP4Operand], Optional[NVFP4Operand]]:
    """Expert weights (G, N, K) quantized per expert, each with its own per-tensor outer scale.

    2d blocks: W_g and its exact transpose from one read (``quantize_2d`` per expert, one launch).
    1d blocks: W_g along K and W_g^T along N, each a ``quantize_grouped`` rowwise copy of the
    stacked experts (W^T from a transposed copy of w).

    Args:
        w: (G, N, K) bfloat16/float16/float32, N and K multiples of 16.
        spec: a per-tensor spec without RHT (rounding and amax_scale apply).
        write_w, write_wt: which of W and W^T to return.
        seed, offset: the SR stream; expert g's counter base is offset + g * N * K / 16.
        inner: write W as its inner values (codes x block scales, float16, exact) instead of
            codes and scales, for a GEMM that uses W at once (no dequantize pass).
    Returns:
        (W, W^T) :class:`NVFP4Operand` (both carrying ``spec``) or None: qdata (G, N, K/2) /
        (G, K, N/2), scale
        (G, N/16, K/16) / (G, K/16, N/16) for 2d, (G, N, K/16) / (G, K, N/16) for 1d, outer (G,);
        with ``inner``, W has values (G, N, K) float16 instead.
    Raises:
        TypeError: dtype. ValueError: shape, a per-token or RHT spec, ``inner`` on a GPU without
            E4M3 conversion (before sm89).
    """
    if spec.per_token or spec.rht:
        raise ValueError(f"expert weights take a per-tensor spec without RHT, got {spec}")
    if w.dim() != 3:
        raise ValueError(f"expert weights must be (G, N, K), got shape {tuple(w.shape)}")
    n_groups, n, k = w.shape
    check_matrix(w.reshape(n_groups * n, k), rows16=False, cols16=True)
    if n % 16:
        raise ValueError(f"expert weights need N (dimension 1) a multiple of 16, got shape "
                         f"{tuple(w.shape)}")
    check_runnable(w.device)
    check_inner(inner and write_w, w.device)
    if spec.block is Block.D1:
        return _experts_1d(w, spec, write_w, write_wt, seed, offset, inner)
    dev = w.device
    w2 = w.reshape(n_groups * n, k)
    amax = grouped_amax_pass(w2, expert_offsets(n_groups, n, dev), spec, None)[0]
    wq, wtq, outer = empty_2d((n_groups,), n, k, spec, write_w, write_wt, inner, dev)
    seed_a, seed_p = scalar(seed, dev)
    off_a, off_p = scalar(offset, dev)
    grid = lambda meta: (cdiv(n, 16 * meta["BB"]), cdiv(k, 16 * meta["BC"]), n_groups)
    if w.numel():
        _EXPERTS_2D[grid](
            w, n, k, w.stride(0), w.stride(1), w.stride(2), amax, float(spec.amax_scale or 1.0),
            seed_a, off_a, 16, *(output_pointers(wq) if wq else (w, w)),
            *(output_pointers(wtq) if wtq else (w, w)), outer,
            W=write_w, WT=write_wt, SR=spec.sr, HAS_AMAX_SCALE=spec.amax_scale is not None,
            INNER=bool(inner and write_w), **four_over_six_constexprs(spec.four_over_six),
            SEED_PTR=seed_p, OFF_PTR=off_p)
    return (scales_as_e4m3(wq) if wq else None), (scales_as_e4m3(wtq) if wtq else None)


def _experts_1d(w, spec, write_w, write_wt, seed, offset, inner):
    """:func:`quantize_experts` with 1d blocks: rowwise grouped copies of the stacked experts."""
    n_groups, n, k = w.shape

    def stacked(t, rows, cols, inner_):
        offs = expert_offsets(n_groups, rows, t.device)
        op = quantize_grouped(t.reshape(n_groups * rows, cols), offs, spec, seed=seed,
                              row_offset=offset, inner=(inner_, False))[0].data
        if op.form is Form.VALUES:
            return op._replace(values=op.values.reshape(n_groups, rows, cols))
        return op._replace(qdata=op.qdata.reshape(n_groups, rows, cols // 2),
                           scale=op.scale.reshape(n_groups, rows, cols // 16))

    wq = stacked(w, n, k, inner) if write_w else None
    wtq = stacked(w.transpose(1, 2).contiguous(), k, n, False) if write_wt else None
    return wq, wtq
