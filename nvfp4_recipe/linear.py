"""NVFP4Linear: an nn.Linear whose three GEMMs (fprop, dgrad, wgrad) run in NVFP4.

The recipe table of docs/recipe.md (after NVIDIA, arXiv 2509.25149, section 4):

    fprop  Y  = X W^T    X: 1D RN             W: 2D (or 1D) RN
    dgrad  dX = dY W     dY: 1D, SR           W^T: the same 2D quantization, transposed
    wgrad  dW = dY^T X   dY^T: RHT + 1D, SR   X^T: RHT + 1D, RN   (blocks along tokens)

The weight stays a high-precision master parameter; it is quantized on every forward (once per
weight version inside :func:`cached_weights`, for evaluation and generation). Backward keeps the
quantized columnwise X^T (and W^T), not the high-precision X. A tensor-parallel layer
(DTensor weight) runs the same algorithm on its shards (``distributed.py``).
"""

from typing import Optional, Tuple

import torch
from torch import nn

from . import high_precision
from . import reference as R
from .backends import Backend, get_backend, resolved
from .formats import BLOCK
from .layer import (NVFP4Module, backend_name, local, next_sr_key, nvfp4_operands, out_dtype, sr_key,
                    training)
from .operand import NVFP4Operand
from .recipe import SR_OFFSETS, NVFP4Recipe
from .spec import GemmRole, Override
from .tensor import NVFP4Tensor
from .tensor_parallel import TensorParallelShard, is_tensor_parallel, tensor_parallel_forward


__all__ = ["NVFP4Linear", "linear_fprop", "linear_grads"]

def _amax_reduce(shard: Optional[TensorParallelShard], recipe: NVFP4Recipe, role: GemmRole):
    """The amax reducer of operand ``role`` (None: its own amax)."""
    return None if shard is None else shard.amax_reduce(role, recipe.spec(role))


def weight_operands(be: Backend, weight: torch.Tensor, recipe: NVFP4Recipe, need_wt: bool,
                    amax_reduce=None) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
    """fprop's W (N, K) and, with ``need_wt``, dgrad's W^T (K, N) (codes): ``be.prepare_weight``
    of a high-precision ``weight``; a weight that is an :class:`NVFP4Tensor` already (FSDP2's fp4
    all-gather, ``fsdp.py``: 2d blocks) is used as it is, W^T its exact transpose
    (``reference.transpose_2d``: codes and scales moved)."""
    if isinstance(weight, NVFP4Tensor):
        w = weight.operand
        return be.prepare(w), R.transpose_2d(w) if need_wt else None
    return be.prepare_weight(weight, recipe.spec(GemmRole.W_FPROP), need_t=need_wt,
                             amax_reduce=amax_reduce)


def linear_fprop(be: Backend, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 recipe: NVFP4Recipe, signs: torch.Tensor, out_dtype: torch.dtype, need_wt: bool,
                 need_xt: bool, shard: Optional[TensorParallelShard] = None,
                 w: Optional[NVFP4Operand] = None, keep: bool = False,
                 ) -> Tuple[torch.Tensor, Optional[NVFP4Operand], Optional[NVFP4Operand], Optional[tuple]]:
    """fprop of an NVFP4 linear: ``Y = Q(X) @ Q(W)^T + bias`` on backend ``be`` (with
    ``recipe.forward_override``: ``X @ W^T + bias`` in ``out_dtype``, the copies for backward
    quantized as usual).

    Args:
        x: (M, K) activations; weight: W (N, K), or W quantized already (an NVFP4Tensor:
            :func:`weight_operands`); bias: None or (N,).
        signs: (16,) RHT signs of the wgrad copy X^T.
        need_wt, need_xt: also quantize W^T (K, N) for dgrad and X^T (K, M) for wgrad.
        shard: None, or the tensor-parallel layout of these local shards
            (:class:`distributed.TensorParallelShard`): the amaxes of sharded operands are
            reduced over the group, so each shard is quantized as the whole tensor is.
        w: W as ``be.prepare_weight`` made it for fprop (:func:`cached_weights`), or None to
            quantize ``weight`` here; only without need_wt.
        keep: also return fprop's operands (X as codes), for a dequantized backward.
    Returns:
        (Y (M, N) of ``out_dtype``, W^T or None, X^T or None, (X, W) operands or None): the copies
        backward keeps, as codes.
    """
    reduce = lambda role: _amax_reduce(shard, recipe, role)
    col = recipe.spec(GemmRole.X_WGRAD) if need_xt else None
    if recipe.forward_override is not None:
        wt = weight_operands(be, weight, recipe, True, reduce(GemmRole.W_FPROP))[1] if need_wt else None
        xt = be.quantize_pair(x, None, col, signs=signs, amax_reduce=(
            None, reduce(GemmRole.X_WGRAD)))[1] if need_xt else None
        return high_precision.fprop(x.to(out_dtype), weight, bias), wt, xt, None
    wt = None
    if w is None:
        w, wt = weight_operands(be, weight, recipe, need_wt, reduce(GemmRole.W_FPROP))
    xq, xt, _ = be.quantize_pair(x, recipe.spec(GemmRole.X_FPROP), col, signs=signs,
                                 transient=(not keep, False),
                                 amax_reduce=(reduce(GemmRole.X_FPROP), reduce(GemmRole.X_WGRAD)))
    return be.mm(xq, w, bias=bias, out_dtype=out_dtype), wt, xt, ((xq, w) if keep else None)


def linear_grads(be: Backend, dy: torch.Tensor, wt: Optional[NVFP4Operand],
                 xt: Optional[NVFP4Operand], recipe: NVFP4Recipe, signs: torch.Tensor,
                 seed: torch.Tensor, dx_dtype: torch.dtype, dw_dtype: torch.dtype,
                 shard: Optional[TensorParallelShard] = None,
                 ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """dgrad and wgrad of an NVFP4 linear from dY (M, N) on backend ``be``.

    dgrad (with W^T (K, N)): ``dX = Q(dY) @ (W^T)^T``, dY quantized rowwise (SR stream ``seed`` at
    offset ``SR_OFFSETS[DY_DGRAD]``). wgrad (with X^T (K, M)): ``dW = Q(dY^T) @ (X^T)^T``, dY^T
    quantized along the tokens (RHT, SR at offset ``SR_OFFSETS[DY_WGRAD]``). Both copies of dY
    come from one read; X^T is prepared for its GEMM in that pass where the backend can.
    ``shard``: as in :func:`linear_fprop`; a shard's SR counters also start where its rows start
    in the whole operand where rows are split (``TensorParallelShard.sr_offset``).

    Returns:
        (dX (M, K) of ``dx_dtype`` or None, dW (N, K) of ``dw_dtype`` or None).
    """
    if wt is not None:
        wt = be.prepare(wt)
    (m, n), offsets = dy.shape, dict(SR_OFFSETS)
    if shard is not None:
        offsets[GemmRole.DY_DGRAD] += shard.sr_offset(GemmRole.DY_DGRAD, m, n)
        offsets[GemmRole.DY_WGRAD] += shard.sr_offset(GemmRole.DY_WGRAD, n, m)
    dyq, dytq, xt = be.quantize_pair(
        dy, recipe.spec(GemmRole.DY_DGRAD) if wt is not None else None,
        recipe.spec(GemmRole.DY_WGRAD) if xt is not None else None, seed=seed,
        row_offset=offsets[GemmRole.DY_DGRAD], col_offset=offsets[GemmRole.DY_WGRAD],
        signs=signs, transient=(True, True), prepare=xt,
        amax_reduce=(_amax_reduce(shard, recipe, GemmRole.DY_DGRAD),
                     _amax_reduce(shard, recipe, GemmRole.DY_WGRAD)))
    dx = None if dyq is None else be.mm(dyq, wt, out_dtype=dx_dtype)
    del dyq  # frees dY's copy before the wgrad GEMM
    dw = None if dytq is None else be.mm(dytq, xt, out_dtype=dw_dtype)
    return dx, dw


def _check_dtypes(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """nn.Linear's rule: outside autocast, the input and the bias have the weight's dtype.

    Raises:
        RuntimeError: with nn.Linear's wording and the dtypes.
    """
    if torch.is_autocast_enabled(x.device.type):
        return
    for what, t in (("mat1 and mat2", x), ("the bias and the weight", bias)):
        if t is not None and t.dtype != weight.dtype:
            raise RuntimeError(f"{what} must have the same dtype, but got {t.dtype} and "
                               f"{weight.dtype} (NVFP4Linear follows nn.Linear: outside autocast the "
                               f"input and the bias take the weight's dtype)")


class _NVFP4LinearFn(torch.autograd.Function):
    """y (M, N) = x (M, K) @ W^T + b with NVFP4 fprop, dgrad and wgrad GEMMs (:func:`linear_fprop`,
    :func:`linear_grads`). Returns a fresh tensor, never a view, so that in-place ops on it work."""

    @staticmethod
    def forward(ctx, x, weight, bias, signs, sr, recipe: NVFP4Recipe, backend: str,
                out_dtype: torch.dtype, shard: Optional[TensorParallelShard]):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        override = recipe.backward_override
        if need_dw and not override and x.shape[0] % BLOCK:
            raise ValueError(
                f"NVFP4 wgrad quantizes along tokens in blocks of {BLOCK}: in training the number "
                f"of tokens (product of the input's leading dims) must be a multiple of {BLOCK}, "
                f"got {x.shape[0]}. Pad each batch to a multiple of {BLOCK} tokens (Hugging Face: "
                f"DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of={BLOCK}))"
                f" or pack sequences; inference under torch.no_grad takes any number")
        y, wt, xt, kept = linear_fprop(
            resolved(backend), x, weight, bias, recipe, signs, out_dtype, need_dx and not override,
            need_dw and not override, shard, keep=override is Override.DEQUANTIZED)
        ctx.recipe, ctx.backend, ctx.shard = recipe, backend, shard
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        if override is not None:
            ctx.kept_blocks = tuple(op.block for op in kept) if kept else None
            ctx.save_for_backward(weight, *high_precision.saved(override, x, *(kept or (None,) * 2)))
            return y
        ctx.w_block = wt.block if wt is not None else None
        none3 = (None, None, None)
        ctx.save_for_backward(*(wt[:3] if wt else none3), *(xt[:3] if xt else none3), signs)
        # sr = (sr_seed, sr_step, sr_rank) is read in backward as it is then, not saved: every
        # backward advances sr_step, which a saved tensor's version check would refuse when the
        # layer runs twice before one backward (shared weights, a loop over the layer)
        ctx.sr = sr
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        override = ctx.recipe.backward_override
        with torch.autocast(dy.device.type, enabled=False):
            if override is not None:
                weight, *kept = ctx.saved_tensors
                x, w = high_precision.restored(override, weight, kept, ctx.kept_blocks)
                dx, dw = high_precision.grads(dy, x, w, need_dx, need_dw, ctx.x_dtype, ctx.w_dtype)
            else:
                dx, dw = _nvfp4_grads(ctx, dy, need_dx, need_dw)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32)  # fp32 accumulation without an fp32 copy of dY
        return dx, dw, db, None, None, None, None, None, None


def _nvfp4_grads(ctx, dy: torch.Tensor, need_dx: bool, need_dw: bool):
    """dgrad and wgrad in NVFP4 from what :class:`_NVFP4LinearFn` saved."""
    saved = ctx.saved_tensors
    signs = saved[6]
    wt = NVFP4Operand(*saved[0:3], ctx.w_block) if saved[0] is not None and need_dx else None
    xt = NVFP4Operand(*saved[3:6]) if saved[3] is not None and need_dw else None
    return linear_grads(resolved(ctx.backend), dy, wt, xt, ctx.recipe, signs,
                        next_sr_key(*ctx.sr), ctx.x_dtype, ctx.w_dtype, ctx.shard)


class NVFP4Linear(NVFP4Module, nn.Linear):
    """nn.Linear trained with all three GEMMs in NVFP4 under an :class:`NVFP4Recipe`.

    Shapes as nn.Linear: input (..., in_features) -> output (..., out_features); in_features and
    out_features must be positive multiples of 16. Parameters are the usual high-precision
    ``weight`` and ``bias``.

    Training (grad mode on and the input, weight or bias requiring grad) runs fprop and saves the
    quantized W^T and X^T for dgrad and wgrad; the number of tokens (the product of the input's
    leading dims) must then be a multiple of 16, since wgrad blocks run along tokens. Otherwise
    (``torch.no_grad``, ``torch.inference_mode``, frozen weights and input) the layer runs fprop
    only: any number of tokens, no X^T or W^T quantized, nothing saved. An input with no elements
    gives nn.Linear's empty result (and zero weight gradient).

    Buffers (saved in the state dict next to nn.Linear's keys), all set from ``recipe`` and
    ``layer_seed``, which the layer keeps (:meth:`reset_recipe_buffers`):
        rht_signs: (16,) float32 +-1 signs of the RHT on the wgrad operands.
        sr_seed: int64 scalar, this layer's Philox key (low 32 bits): ``(recipe.seed +
            layer_seed) mod 2**32``.
        sr_step: int64 scalar, advanced by every backward; a backward's SR stream is keyed by
            ``sr_seed + sr_rank + (sr_step << 32)`` (:func:`sr_key`) with the value before the
            advance.
    ``reset_parameters()`` resets them too, and moving the layer off the meta device
    (``to_empty``) sets them, so a model built on the meta device and materialized gets the same
    buffers as one built on a real device; a loaded state dict overrides them.

    ``sr_rank`` (an int attribute, not a buffer, 0 by default): this process's rank among the
    data-parallel ranks, set by ``distributed.set_sr_rank`` so that ranks draw independent SR
    streams. It is neither saved nor broadcast (DDP broadcasts buffers).

    A weight that is a DTensor sharded over a 1-D mesh (``parallelize_module`` with
    ``ColwiseParallel`` / ``RowwiseParallel``) makes the layer tensor parallel:
    ``distributed.tensor_parallel_forward``.

    Raises:
        ValueError: a feature count not a positive multiple of 16; a token count not a multiple of
            16 in training; a backend that cannot run on the weight's device.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, recipe: Optional[NVFP4Recipe] = None, layer_seed: int = 0):
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if n <= 0 or n % BLOCK:
                raise ValueError(f"NVFP4Linear needs {name} to be a positive multiple of {BLOCK}, got {n}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_nvfp4(recipe, layer_seed, device)

    def reset_parameters(self) -> None:
        """nn.Linear's initialization of ``weight`` and ``bias``, and :meth:`reset_recipe_buffers`."""
        super().reset_parameters()
        if "sr_step" in self._buffers:  # nn.Linear.__init__ calls this before the buffers exist
            self.reset_recipe_buffers()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[NVFP4Recipe] = None,
                    layer_seed: int = 0) -> "NVFP4Linear":
        """An NVFP4Linear that shares ``linear``'s weight and bias Parameters (optimizers keep them).

        Raises:
            ValueError: a feature count not a positive multiple of 16.
        """
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta",
                  recipe=recipe, layer_seed=layer_seed)
        new.weight, new.bias = linear.weight, linear.bias
        new._init_nvfp4(recipe, layer_seed, linear.weight.device)
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this layer's weight and bias Parameters."""
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        lin.train(self.training)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tensor_parallel(self.weight):
            return tensor_parallel_forward(self, x)
        return self.local_forward(x, self.fprop_weight(), self.bias)

    def fprop_weight(self) -> torch.Tensor:
        """W (out_features, in_features) as fprop's B operand takes it: the ``weight`` Parameter
        here; a layer that stores W^T (``conv1d.NVFP4Conv1D``) returns a transposed view."""
        return self.weight

    def local_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      shard: Optional[TensorParallelShard] = None) -> torch.Tensor:
        """The layer's forward on (local) tensors: x (..., K) -> (..., N) for weight (N, K) and
        bias (N,) or None, this layer's parameters or, with ``shard``, their tensor-parallel
        shards (amaxes reduced over the group). Raises RuntimeError, as nn.Linear, for an input or
        a bias whose dtype is not the weight's outside autocast."""
        n, k = weight.shape
        if x.shape[-1] != k:
            raise ValueError(f"NVFP4Linear expects input (..., {k}), got {tuple(x.shape)}")
        _check_dtypes(x, weight, bias)
        backend = backend_name(self.recipe.backend.value, weight.device)
        y_dtype = out_dtype(x)
        signs = local(self.rht_signs)
        x2 = x.reshape(-1, k)
        with torch.autocast(x.device.type, enabled=False):
            if x2.shape[0] == 0:  # no tokens: no amax to take; nn.Linear's empty result
                y = nn.functional.linear(x2.to(weight.dtype), weight, bias).to(y_dtype)
            elif training(x, weight, bias):
                y = _NVFP4LinearFn.apply(x2, weight, bias, signs, self.sr_state(), self.recipe,
                                         backend, y_dtype, shard)
            else:
                # keyed by the Parameter, whose version counter a transposed view shares
                w = None if shard is not None else self.cached_operand(
                    "weight", self.weight, backend, lambda: weight_operands(
                        resolved(backend), weight, self.recipe, False)[0])
                y = linear_fprop(resolved(backend), x2, weight, bias, self.recipe, signs,
                                 y_dtype, False, False, shard, w)[0]
            if self.captured is not None and x2.shape[0] and shard is None:
                self._capture(x2, y, backend)
        # _unsafe_view: the (..., N) result is not a view of the (M, N) GEMM output, as with
        # nn.Linear (aten::matmul), so in-place ops and FSDP2 (which warns on views) take it
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], n))

    def quantized_weight(self) -> NVFP4Tensor:
        """The weight as fprop quantizes it (the recipe's W spec, the layer's backend), as an
        :class:`NVFP4Tensor` of shape (out_features, in_features): for inspection; training
        quantizes the master weight again on every forward."""
        backend = backend_name(self.recipe.backend.value, self.weight.device)
        spec = self.recipe.spec(GemmRole.W_FPROP)
        with torch.no_grad():
            op = get_backend(backend, self.weight.device).quantize(self.fprop_weight(), spec)
        return NVFP4Tensor.from_operand(op, spec, self.weight.dtype, backend=backend)

    def _capture(self, x2: torch.Tensor, y: torch.Tensor, backend: str) -> None:
        """Record the NVFP4 operands of this step's GEMMs (:func:`layer.nvfp4_operands`) in
        ``self.captured`` (a :class:`Recording`): X, W and X^T now, dY and dY^T when the gradient
        of ``y`` arrives. They are quantized again with the step's specs, signs and SR stream, so
        they are the bits the GEMMs used."""
        be, rec = get_backend(backend, x2.device), self.captured
        signs, r, names = self.rht_signs, self.recipe, nvfp4_operands(self.recipe)
        x2 = x2.detach()

        def keep(t, role, **kw):
            spec = r.spec(role)
            q = NVFP4Tensor.from_operand(be.quantize(t, spec, signs=signs, **kw), spec, t.dtype,
                                         signs if spec.rht else None, backend)
            return rec.keep(t, q, spec)

        with torch.no_grad():
            if "w" in names:
                rec.store.update(w=keep(self.fprop_weight().detach(), GemmRole.W_FPROP),
                                 x=keep(x2, GemmRole.X_FPROP))
            if "xt" in names and x2.shape[0] % BLOCK == 0:  # X^T's blocks run along the tokens
                rec.store.update(xt=keep(x2.t(), GemmRole.X_WGRAD))
        if y.requires_grad and "dy" in names:
            seed = sr_key(*self.sr_state())  # before backward advances it

            def record_dy(dy):
                with torch.no_grad():
                    rec.store.update(
                        dy=keep(dy, GemmRole.DY_DGRAD, seed=seed,
                                offset=SR_OFFSETS[GemmRole.DY_DGRAD]),
                        dyt=keep(dy.t(), GemmRole.DY_WGRAD, seed=seed,
                                 offset=SR_OFFSETS[GemmRole.DY_WGRAD]))
            y.register_hook(record_dy)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.recipe_repr()}"

