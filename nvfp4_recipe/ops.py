"""The backend calls of NVFP4Linear as torch custom ops, so torch.compile sees them as opaque nodes.

Each op dispatches at run time to the backend named in its arguments (``backends.get_backend``) and
has a fake (meta) implementation giving output shapes and dtypes, so ``torch.compile(fullgraph=True)``
traces NVFP4Linear without graph breaks whatever the backend (reference, Triton kernels, native), and
CUDA graphs capture the same kernels as eager. SR seeds are device tensors, read inside the kernels.

The typed wrappers at the end are what NVFP4Linear calls. While torch.compile traces they call the
custom ops; in eager mode they call the backend directly, because a custom op's dispatch costs about
100 µs of host time a call (H200 host, 2026-11-21) and small layers are bound by host time in
eager mode. The backend computes the same values either way; the op only adds its checks and
copies.
"""

import functools
from typing import List, Optional

import torch

from .backends import get_backend
from .formats import BLOCK
from .recipe import OperandSpec
from .reference import NVFP4Data

__all__ = ["linear_fprop", "linear_grads"]


def _flat(*datas: NVFP4Data) -> List[torch.Tensor]:
    """The tensors of ``datas`` in order; one sharing storage with an earlier one (a shared outer
    scale, a transpose that is a view) is cloned, since custom-op outputs may not alias each other."""
    out, seen = [], set()
    for t in (t for d in datas for t in d):
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return out


def _fake(rows: int, k: int, spec: OperandSpec, device) -> List[torch.Tensor]:
    """Empty tensors shaped like the quantization of a (rows, k) operand under ``spec``."""
    scale_shape = (rows // BLOCK, k // BLOCK) if spec.block == "2d" else (rows, k // BLOCK)
    outer_shape = (rows,) if spec.scaling == "per_token" else ()
    return [torch.empty(rows, k // 2, dtype=torch.uint8, device=device),
            torch.empty(scale_shape, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(outer_shape, dtype=torch.float32, device=device)]


def _spec(text: Optional[str]) -> Optional[OperandSpec]:
    return None if text is None else OperandSpec.decode(text)


def _data(t: List[Optional[torch.Tensor]]) -> Optional[NVFP4Data]:
    return None if t[0] is None else NVFP4Data(*t)


@torch.library.custom_op("nvfp4_recipe::linear_fprop", mutates_args=())
def _linear_fprop(x: torch.Tensor, weight: torch.Tensor, w_spec: str, x_spec: str,
                  xt_spec: Optional[str], need_wt: bool, bias: Optional[torch.Tensor],
                  out_dtype: torch.dtype, seed: torch.Tensor, signs: Optional[torch.Tensor],
                  backend: str) -> List[torch.Tensor]:
    be = get_backend(backend, x.device)
    y, wtq, xtq = be.linear_fprop(x, weight, OperandSpec.decode(w_spec), OperandSpec.decode(x_spec),
                                  _spec(xt_spec), need_wt, bias, out_dtype, seed, signs)
    return [y] + _flat(*(q for q in (wtq, xtq) if q is not None))


@_linear_fprop.register_fake
def _(x, weight, w_spec, x_spec, xt_spec, need_wt, bias, out_dtype, seed, signs, backend):
    (m, k), n = x.shape, weight.shape[0]
    out = [x.new_empty((m, n), dtype=out_dtype)]
    if need_wt:
        out += _fake(k, n, OperandSpec.decode(w_spec), x.device)
    if xt_spec is not None:
        out += _fake(k, m, OperandSpec.decode(xt_spec), x.device)
    return out


@torch.library.custom_op("nvfp4_recipe::linear_grads", mutates_args=())
def _linear_grads(dy: torch.Tensor, wt_qdata: Optional[torch.Tensor],
                  wt_scale: Optional[torch.Tensor], wt_outer: Optional[torch.Tensor],
                  xt_qdata: Optional[torch.Tensor], xt_scale: Optional[torch.Tensor],
                  xt_outer: Optional[torch.Tensor], w_block: str, dy_spec: str, dyt_spec: str,
                  dx_dtype: torch.dtype, dw_dtype: torch.dtype, seed: torch.Tensor,
                  dy_offset: int, dyt_offset: int, signs: Optional[torch.Tensor],
                  backend: str) -> List[torch.Tensor]:
    be = get_backend(backend, dy.device)
    dx, dw = be.linear_grads(dy, _data([wt_qdata, wt_scale, wt_outer]),
                             _data([xt_qdata, xt_scale, xt_outer]), w_block, _spec(dy_spec),
                             _spec(dyt_spec), dx_dtype, dw_dtype, seed, dy_offset, dyt_offset, signs)
    return [t for t in (dx, dw) if t is not None]


@_linear_grads.register_fake
def _(dy, wt_qdata, wt_scale, wt_outer, xt_qdata, xt_scale, xt_outer, w_block, dy_spec, dyt_spec,
      dx_dtype, dw_dtype, seed, dy_offset, dyt_offset, signs, backend):
    m, n = dy.shape
    out = []
    if wt_qdata is not None:  # W^T is (K, N)
        out.append(dy.new_empty((m, wt_qdata.shape[0]), dtype=dx_dtype))
    if xt_qdata is not None:  # X^T is (K, M)
        out.append(dy.new_empty((n, xt_qdata.shape[0]), dtype=dw_dtype))
    return out


# ------------------------------------------------------------------ typed wrappers for callers
def _direct_in_eager(wrapper):
    """``wrapper(*args, backend)`` calls its custom op while torch.compile traces; in eager mode
    the backend method of the same name takes ``args`` directly (see the module docstring)."""
    @functools.wraps(wrapper)
    def call(*args):
        if torch.compiler.is_compiling():
            return wrapper(*args)
        *args, backend = args
        return getattr(get_backend(backend, args[0].device), wrapper.__name__)(*args)
    return call


@_direct_in_eager
def linear_fprop(x, weight, w_spec: OperandSpec, x_spec: OperandSpec,
                 xt_spec: Optional[OperandSpec], need_wt: bool, bias, out_dtype, seed, signs,
                 backend: str):
    """``Backend.linear_fprop``: (Y, W^T NVFP4Data or None, X^T NVFP4Data or None)."""
    t = _linear_fprop(x, weight, w_spec.encode(), x_spec.encode(),
                      None if xt_spec is None else xt_spec.encode(), need_wt, bias, out_dtype, seed,
                      signs, backend)
    wt = NVFP4Data(*t[1:4]) if need_wt else None
    xt = NVFP4Data(*t[-3:]) if xt_spec is not None else None
    return t[0], wt, xt


@_direct_in_eager
def linear_grads(dy, wt: Optional[NVFP4Data], xt: Optional[NVFP4Data], w_block: str,
                 dy_spec: OperandSpec, dyt_spec: OperandSpec, dx_dtype, dw_dtype, seed,
                 dy_offset: int, dyt_offset: int, signs, backend: str):
    """``Backend.linear_grads``: (dX or None, dW or None)."""
    none3 = (None, None, None)
    t = iter(_linear_grads(dy, *(wt or none3), *(xt or none3), w_block, dy_spec.encode(),
                           dyt_spec.encode(), dx_dtype, dw_dtype, seed, dy_offset, dyt_offset,
                           signs, backend))
    return (next(t) if wt is not None else None), (next(t) if xt is not None else None)
