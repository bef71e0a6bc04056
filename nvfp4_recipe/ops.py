"""NVFP4Linear's two steps as torch operators, so that torch.compile traces the layer without graph
breaks whatever the backend.

``linear.linear_fprop`` and ``linear.linear_grads`` (the layer's algorithm) run inside operators
whose arguments are tensors and plain bools/floats/strings (the recipe's fields):

- with the Triton backend on a GPU, ``nvfp4_recipe::linear_fprop_triton`` and
  ``linear_grads_triton``, registered with ``torch.library.triton_op``: torch.compile traces their
  bodies, the kernels' launches are recorded with ``wrap_triton`` (``kernels.runtime.Launcher``),
  and Inductor compiles, tunes and launches the same Triton kernels from its own generated code,
  with its buffer reuse and fusion of the elementwise work around them, and without this package's
  Python on the hot path (the TMA GEMM too: it makes its descriptors on the device);
- with any other backend, or under the Triton interpreter (whose kernels cannot be recorded),
  ``nvfp4_recipe::linear_fprop`` and ``linear_grads``, opaque ``torch.library.custom_op``
  operators with fake implementations that give the output shapes.

:func:`fprop` and :func:`grads` are what the layer calls: an operator while torch.compile traces,
the functions directly in eager mode, where an operator's dispatch would add its host cost to every
call of a small layer.
"""

import functools
from typing import List, Optional, Tuple

import torch

from .backends import get_backend
from .formats import BLOCK
from .operand import NVFP4Operand
from .kernels.runtime import interpreting, tracing
from .recipe import NVFP4Recipe
from .spec import Block


@functools.lru_cache(maxsize=None)
def _recipe(weight_2d: bool, per_token: bool, rht: bool, sr: bool, amax_x: Optional[float],
            amax_dy: Optional[float]) -> NVFP4Recipe:
    """The recipe whose quantization the custom ops' plain arguments describe (cached)."""
    estimation = None if amax_x is None else (amax_x, amax_dy)
    return NVFP4Recipe(rht=rht, stochastic_rounding=sr, amax_estimation=estimation,
                       weight_2d=weight_2d, scaling="per_token" if per_token else "per_tensor")


def _fields(recipe: NVFP4Recipe) -> Tuple:
    """The arguments of :func:`_recipe` for ``recipe`` (what the custom ops take of it)."""
    est = recipe.amax_estimation or (None, None)
    return (recipe.weight_2d, recipe.scaling == "per_token", recipe.rht,
            recipe.stochastic_rounding, *est)


def _codes(*ops: Optional[NVFP4Operand]) -> List[torch.Tensor]:
    """The code tensors of ``ops`` in order; one sharing storage with an earlier one (a shared outer
    scale, a transpose that is a view) is cloned, since operator outputs may not alias each other.
    (While torch.compile traces a triton_op's body there is no storage to compare, and the traced
    graph tracks aliasing itself.)"""
    if tracing():
        return [t for op in ops if op is not None for t in op[:3]]
    out, seen = [], set()
    for t in (t for op in ops if op is not None for t in op[:3]):
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone() if ptr in seen else t)
        seen.add(ptr)
    return out


def _empty_codes(rows: int, k: int, block: Block, per_token: bool, like: torch.Tensor):
    scale_shape = (rows // BLOCK, k // BLOCK) if block is Block.D2 else (rows, k // BLOCK)
    return [like.new_empty((rows, k // 2), dtype=torch.uint8),
            like.new_empty(scale_shape, dtype=torch.float8_e4m3fn),
            like.new_empty((rows,) if per_token else (), dtype=torch.float32)]


def _stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an ``as_strided`` view of its own storage while torch.compile traces (else ``t``).

    The layer's input is usually a reshape of a fused elementwise result (the RMSNorm or GELU
    before it, reshaped to (M, K)). Inductor gives each kernel argument that reads such a reshape a
    buffer of its own, all written by the producer's kernel: five copies for the amax pass and the
    activation pair. An ``as_strided`` view makes Inductor store the producer's result once and
    pass that buffer to every kernel, as for the input of a bf16 matmul. The storage offset is
    left implicit (t's own): Inductor before torch 2.13 applied an explicit one to a graph input
    whose pointer already included it (test_compiled_layer_on_a_view_with_a_storage_offset)."""
    return t.as_strided(t.shape, t.stride()) if tracing() else t


def _fprop_body(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                signs: torch.Tensor, weight_2d: bool, per_token: bool, rht: bool, sr: bool,
                amax_x: Optional[float], amax_dy: Optional[float], out_dtype: torch.dtype,
                need_wt: bool, need_xt: bool, backend: str) -> List[torch.Tensor]:
    from .linear import linear_fprop
    recipe = _recipe(weight_2d, per_token, rht, sr, amax_x, amax_dy)
    y, wt, xt = linear_fprop(get_backend(backend, x.device), _stored(x), weight, bias, recipe, signs,
                             out_dtype, need_wt, need_xt)
    return [y] + _codes(wt, xt)


def _fprop_fake(x, weight, bias, signs, weight_2d, per_token, rht, sr, amax_x, amax_dy, out_dtype,
                need_wt, need_xt, backend):
    (m, k), n = x.shape, weight.shape[0]
    out = [x.new_empty((m, n), dtype=out_dtype)]
    if need_wt:
        out += _empty_codes(k, n, Block.D2 if weight_2d else Block.D1, False, x)
    if need_xt:
        out += _empty_codes(k, m, Block.D1, per_token, x)
    return out


def _grads_body(dy: torch.Tensor, wt_qdata: Optional[torch.Tensor],
                wt_scale: Optional[torch.Tensor], wt_outer: Optional[torch.Tensor],
                xt_qdata: Optional[torch.Tensor], xt_scale: Optional[torch.Tensor],
                xt_outer: Optional[torch.Tensor], signs: torch.Tensor, seed: torch.Tensor,
                weight_2d: bool, per_token: bool, rht: bool, sr: bool,
                amax_x: Optional[float], amax_dy: Optional[float],
                dx_dtype: torch.dtype, dw_dtype: torch.dtype, backend: str) -> List[torch.Tensor]:
    from .linear import linear_grads
    recipe = _recipe(weight_2d, per_token, rht, sr, amax_x, amax_dy)
    wt = None if wt_qdata is None else NVFP4Operand(wt_qdata, wt_scale, wt_outer,
                                                    Block.D2 if weight_2d else Block.D1)
    xt = None if xt_qdata is None else NVFP4Operand(xt_qdata, xt_scale, xt_outer)
    dx, dw = linear_grads(get_backend(backend, dy.device), _stored(dy), wt, xt, recipe, signs, seed,
                          dx_dtype, dw_dtype)
    return [t for t in (dx, dw) if t is not None]


def _grads_fake(dy, wt_qdata, wt_scale, wt_outer, xt_qdata, xt_scale, xt_outer, signs, seed,
                weight_2d, per_token, rht, sr, amax_x, amax_dy, dx_dtype, dw_dtype, backend):
    m, n = dy.shape
    out = []
    if wt_qdata is not None:  # W^T is (K, N)
        out.append(dy.new_empty((m, wt_qdata.shape[0]), dtype=dx_dtype))
    if xt_qdata is not None:  # X^T is (K, M)
        out.append(dy.new_empty((n, xt_qdata.shape[0]), dtype=dw_dtype))
    return out


def _opaque(name: str, body, fake):
    """``body`` as the custom op ``nvfp4_recipe::name`` with the fake implementation ``fake``."""
    op = torch.library.custom_op(f"nvfp4_recipe::{name}", body, mutates_args=())
    op.register_fake(fake)
    return op


_fprop_op = _opaque("linear_fprop", _fprop_body, _fprop_fake)
_grads_op = _opaque("linear_grads", _grads_body, _grads_fake)
# triton_op: torch.compile traces the body (its own fake implementation too)
_fprop_triton_op = torch.library.triton_op("nvfp4_recipe::linear_fprop_triton", _fprop_body,
                                           mutates_args=())
_grads_triton_op = torch.library.triton_op("nvfp4_recipe::linear_grads_triton", _grads_body,
                                           mutates_args=())


def _kernels_traceable(backend: str) -> bool:
    """Whether torch.compile should trace into the layer's kernels (the Triton backend compiled
    for a GPU) rather than keep its operator opaque."""
    return backend == "triton" and not interpreting()


def fprop(x, weight, bias, recipe: NVFP4Recipe, signs, out_dtype, need_wt: bool, need_xt: bool,
          backend: str):
    """``linear.linear_fprop`` on the named backend: (Y, W^T or None, X^T or None)."""
    if not torch.compiler.is_compiling():
        from .linear import linear_fprop
        return linear_fprop(get_backend(backend, x.device), x, weight, bias, recipe, signs,
                            out_dtype, need_wt, need_xt)
    op = _fprop_triton_op if _kernels_traceable(backend) else _fprop_op
    t = op(x, weight, bias, signs, *_fields(recipe), out_dtype, need_wt, need_xt, backend)
    w_block = Block.D2 if recipe.weight_2d else Block.D1
    wt = NVFP4Operand(*t[1:4], w_block) if need_wt else None
    xt = NVFP4Operand(*t[-3:]) if need_xt else None
    return t[0], wt, xt


def grads(dy, wt: Optional[NVFP4Operand], xt: Optional[NVFP4Operand], recipe: NVFP4Recipe, signs,
          seed, dx_dtype, dw_dtype, backend: str):
    """``linear.linear_grads`` on the named backend: (dX or None, dW or None)."""
    if not torch.compiler.is_compiling():
        from .linear import linear_grads
        return linear_grads(get_backend(backend, dy.device), dy, wt, xt, recipe, signs, seed,
                            dx_dtype, dw_dtype)
    none3 = (None, None, None)
    op = _grads_triton_op if _kernels_traceable(backend) else _grads_op
    t = iter(op(dy, *(wt[:3] if wt else none3), *(xt[:3] if xt else none3), signs, seed,
                *_fields(recipe), dx_dtype, dw_dtype, backend))
    return (next(t) if wt is not None else None), (next(t) if xt is not None else None)
