"""The backend calls of NVFP4Linear as torch custom ops, so torch.compile sees them as opaque nodes.

Each op dispatches at run time to the backend named in its arguments (``backends.get_backend``) and
has a fake (meta) implementation giving output shapes and dtypes, so ``torch.compile(fullgraph=True)``
traces NVFP4Linear without graph breaks whatever the backend (reference, Triton kernels, native), and
CUDA graphs capture the same kernels as eager. SR seeds are device tensors, read inside the kernels.
"""

from typing import List, Optional

import torch

from .backends import get_backend
from .formats import BLOCK
from .recipe import OperandSpec
from .reference import NVFP4Data

__all__ = ["quantize", "quantize_pair", "quantize_weight", "scaled_mm"]


def _flat(*datas: NVFP4Data) -> List[torch.Tensor]:
    """The tensors of ``datas`` in order; one sharing storage with an earlier one (a shared outer
    scale, a transpose that is a view) is cloned, since custom-op outputs may not alias each other."""
    out, seen = [], set()
    for t in (t for d in datas for t in d):
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return out


def _fake(rows: int, k: int, spec: OperandSpec, device, lead=()) -> List[torch.Tensor]:
    """Empty tensors shaped like the quantization of a (*lead, rows, k) operand under ``spec``."""
    scale_shape = (rows // BLOCK, k // BLOCK) if spec.block == "2d" else (*lead, rows, k // BLOCK)
    outer_shape = (*lead, rows) if spec.scaling == "per_token" else ()
    return [torch.empty(*lead, rows, k // 2, dtype=torch.uint8, device=device),
            torch.empty(scale_shape, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(outer_shape, dtype=torch.float32, device=device)]


@torch.library.custom_op("nvfp4_recipe::quantize", mutates_args=())
def _quantize(x: torch.Tensor, spec: str, seed: torch.Tensor, offset: int,
              signs: Optional[torch.Tensor], backend: str) -> List[torch.Tensor]:
    be = get_backend(backend, x.device)
    return _flat(be.quantize(x, OperandSpec.decode(spec), seed, offset, signs))


@_quantize.register_fake
def _(x, spec, seed, offset, signs, backend):
    return _fake(x.shape[-2], x.shape[-1], OperandSpec.decode(spec), x.device, x.shape[:-2])


@torch.library.custom_op("nvfp4_recipe::quantize_pair", mutates_args=())
def _quantize_pair(x: torch.Tensor, row: str, col: str, seed: torch.Tensor, row_offset: int,
                   col_offset: int, signs: Optional[torch.Tensor], backend: str) -> List[torch.Tensor]:
    be = get_backend(backend, x.device)
    return _flat(*be.quantize_pair(x, OperandSpec.decode(row), OperandSpec.decode(col), seed,
                                   row_offset, col_offset, signs))


@_quantize_pair.register_fake
def _(x, row, col, seed, row_offset, col_offset, signs, backend):
    m, k = x.shape
    return (_fake(m, k, OperandSpec.decode(row), x.device)
            + _fake(k, m, OperandSpec.decode(col), x.device))


@torch.library.custom_op("nvfp4_recipe::quantize_weight", mutates_args=())
def _quantize_weight(w: torch.Tensor, spec: str, backend: str) -> List[torch.Tensor]:
    return _flat(*get_backend(backend, w.device).quantize_weight(w, OperandSpec.decode(spec)))


@_quantize_weight.register_fake
def _(w, spec, backend):
    n, k = w.shape
    s = OperandSpec.decode(spec)
    return _fake(n, k, s, w.device) + _fake(k, n, s, w.device)


@torch.library.custom_op("nvfp4_recipe::scaled_mm", mutates_args=())
def _scaled_mm(a_qdata: torch.Tensor, a_scale: torch.Tensor, a_outer: torch.Tensor,
               b_qdata: torch.Tensor, b_scale: torch.Tensor, b_outer: torch.Tensor, a_block: str,
               b_block: str, bias: Optional[torch.Tensor], out_dtype: torch.dtype,
               backend: str) -> torch.Tensor:
    be = get_backend(backend, a_qdata.device)
    return be.scaled_mm(NVFP4Data(a_qdata, a_scale, a_outer), NVFP4Data(b_qdata, b_scale, b_outer),
                        a_block, b_block, bias, out_dtype)


@_scaled_mm.register_fake
def _(a_qdata, a_scale, a_outer, b_qdata, b_scale, b_outer, a_block, b_block, bias, out_dtype, backend):
    return a_qdata.new_empty((a_qdata.shape[0], b_qdata.shape[0]), dtype=out_dtype)


# ------------------------------------------------------------------ typed wrappers for callers
def quantize(x, spec: OperandSpec, seed, offset: int, signs, backend: str) -> NVFP4Data:
    """``Backend.quantize`` through the custom op."""
    return NVFP4Data(*_quantize(x, spec.encode(), seed, offset, signs, backend))


def quantize_pair(x, row: OperandSpec, col: OperandSpec, seed, row_offset: int, col_offset: int,
                  signs, backend: str):
    """``Backend.quantize_pair`` through the custom op: (rowwise, columnwise) NVFP4Data."""
    t = _quantize_pair(x, row.encode(), col.encode(), seed, row_offset, col_offset, signs, backend)
    return NVFP4Data(*t[:3]), NVFP4Data(*t[3:])


def quantize_weight(w, spec: OperandSpec, backend: str):
    """``Backend.quantize_weight`` through the custom op: (W, W^T) NVFP4Data."""
    t = _quantize_weight(w, spec.encode(), backend)
    return NVFP4Data(*t[:3]), NVFP4Data(*t[3:])


def scaled_mm(a: NVFP4Data, b: NVFP4Data, a_block: str, b_block: str, bias, out_dtype,
              backend: str) -> torch.Tensor:
    """``Backend.scaled_mm`` through the custom op."""
    return _scaled_mm(*a, *b, a_block, b_block, bias, out_dtype, backend)
