"""The layer algorithm, written once: fprop, dgrad and wgrad of an NVFP4 linear and the autograd
Function that runs them, for a dense layer and for the experts' grouped projections.

The recipe table of docs/recipe.md (after NVIDIA, arXiv 2509.25149, section 4):

    fprop  Y  = X W^T    X: 1D RN             W: 2D (or 1D) RN
    dgrad  dX = dY W     dY: 1D, SR           W^T: the same 2D quantization, transposed
    wgrad  dW = dY^T X   dY^T: RHT + 1D, SR   X^T: RHT + 1D, RN   (blocks along tokens)

A layout maps these steps onto the backend's primitives: :class:`Dense` (W (N, K), X (M, K):
``prepare_weight``, ``quantize_pair``, ``mm``) and :class:`Grouped` (experts: W (G, N, K), the
tokens sorted by expert in groups ending at ``offs``: ``quantize_experts``, ``quantize_groups``,
``grouped_mm``). A dense layer is one group: both run the same three GEMMs, quantize the same
operands under the same specs and keep the same operands (as codes) for backward. A new kind of
layer whose GEMMs map onto other primitives is a new layout with the same methods.

How each operand is quantized (spec, RHT signs, SR stream and counters, the amax reduction of a
tensor-parallel shard, rowwise / columnwise usage) comes in the pass's quantizers
(``quantizers.build``, once per forward and once per backward); a layout turns a pair of them into
the primitive's arguments (:func:`_pair_arguments`).

Under ``backward_estimator="ms_eden"`` (Quartet II, arXiv 2601.22813) the backward is
:func:`ms_eden_grads`: W^T and X^T are quantized again, with MS-EDEN, from the forward's NVFP4 W and
X (dequantized), as ``backward_override="dequantized"`` keeps them.
"""

from typing import Dict, NamedTuple, Optional, Tuple, Union

import torch

from . import high_precision, quantizers
from . import reference as R
from .backends import Backend, resolved
from .backends.grouped import expert_rows
from .formats import BLOCK
from .layer import autocast_off, next_sr_key
from .operand import GroupedOperand, NVFP4Operand
from .quantizers import Quantizers, TensorQuantizer, Usage
from .recipe import NVFP4Recipe
from .spec import Block, Override
from .tensor import NVFP4Tensor
from .tensor_parallel import TensorParallelShard

__all__ = ["Dense", "Grouped", "GemmsFn", "fprop", "grads", "ms_eden_grads", "weight_operands"]


def weight_operands(be: Backend, weight: torch.Tensor, q: TensorQuantizer,
                    ) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
    """fprop's W (N, K) and, with W's columnwise usage (``q.columnwise``), dgrad's W^T (K, N)
    (codes): ``be.prepare_weight`` of a high-precision ``weight`` under ``q.rowwise`` (its spec and
    amax reducer); a weight that is an :class:`NVFP4Tensor` already (FSDP2's fp4 all-gather,
    ``fsdp.py``: 2d blocks) is used as it is, W^T its exact transpose (``be.transpose_2d``:
    codes and scales moved)."""
    need_t = q.columnwise is not None
    if isinstance(weight, NVFP4Tensor):
        w = weight.operand
        return be.prepare(w), be.transpose_2d(w) if need_t else None
    return be.prepare_weight(weight, q.rowwise.spec, need_t=need_t,
                             amax_reduce=quantizers.amax_reducer(q.rowwise))


def _pair_arguments(q: TensorQuantizer, next_b: Optional[NVFP4Operand]) -> dict:
    """The arguments of ``Backend.quantize_pair`` / ``quantize_groups`` after x (and offs) for
    the copies of ``q``: specs, the SR stream and counters, the RHT signs, ``transient`` (a copy
    used by its GEMM only) and ``prepare`` (``next_b``: a saved operand a later GEMM takes as B);
    ``amax_reduce`` only where a copy has a reducer (a tensor-parallel shard)."""
    row, col = q
    args = dict(row=row and row.spec, col=col and col.spec,
                seed=row.seed if row else col.seed if col else 0,
                row_offset=row.offset if row else 0, col_offset=col.offset if col else 0,
                signs=col.signs if col and col.signs is not None else row and row.signs,
                transient=(bool(row and row.gemm_only), bool(col and col.gemm_only)),
                prepare=next_b)
    reduce = (row and row.amax_reduce, col and col.amax_reduce)
    if reduce != (None, None):
        args["amax_reduce"] = reduce
    return args


class Dense(NamedTuple):
    """The layout of a dense layer, one group: X (M, K), W (N, K) (or an :class:`NVFP4Tensor`,
    :func:`weight_operands`), an optional bias (N,); X^T (K, M) and W^T (K, N) are
    :class:`NVFP4Operand`.

    Fields:
        shard: None, or the tensor-parallel layout of these local shards
            (:class:`tensor_parallel.TensorParallelShard`), which :func:`quantizers.build` reads:
            the amaxes of sharded operands are reduced over the group, so each shard is quantized
            as the whole tensor is, and an SR operand's counters are shifted past the other
            shards' blocks.
        weight_amax: None, or the fp32 0-d amax W is quantized with instead of its own (a fused
            group's shared amax, ``NVFP4Linear.shared_weight_amax``), which
            :func:`quantizers.build` reads.
        given: None, or a frozen weight (``frozen.NVFP4FrozenLinear``): W (N, K) given as an
            operand of codes, whose tensors nothing modifies, in place of a high-precision W
            (the ``w`` of :class:`GemmsFn` is then None); no wgrad, W^T made in backward
            (:meth:`given_columns`), the high-precision GEMMs on W dequantized.
    """

    shard: Optional[TensorParallelShard] = None
    weight_amax: Optional[torch.Tensor] = None
    given: Optional[NVFP4Operand] = None
    offs = None  # one group (``high_precision``'s convention)

    def weights(self, be: Backend, w: Optional[torch.Tensor], q: TensorQuantizer,
                ) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
        """(W, W^T or None): :func:`weight_operands`, W always ready for :meth:`mm` (a W used by
        fprop's GEMM only changes nothing); a given W made ready, its W^T left to backward."""
        if self.given is not None:
            return be.prepare(self.given), None
        return weight_operands(be, w, q)

    def given_columns(self, be: Backend) -> NVFP4Operand:
        """dgrad's W^T (K, N) of the given W: its exact transpose (``be.transpose_2d``) for 16x16
        tile scales, else W dequantized (exact) and quantized again along N under its spec
        (``be.quantize``)."""
        if self.given.block is Block.D2:
            return be.transpose_2d(self.given)
        return be.quantize(R.dequantize(self.given).t(), self.given.spec)

    def high_precision_weight(self, w: Optional[torch.Tensor]) -> torch.Tensor:
        """W as the high-precision GEMMs take it: ``w``, or the given W dequantized (float32)."""
        return w if self.given is None else R.dequantize(self.given)

    @staticmethod
    def tokens(be: Backend, x: torch.Tensor, q: TensorQuantizer,
               next_b: Optional[NVFP4Operand] = None):
        """(rowwise, columnwise, ``next_b`` made ready or None): x (M, K) quantized by
        ``q.rowwise`` and x^T (K, M) by ``q.columnwise`` (each None to skip) in
        ``be.quantize_pair``, which may make ``next_b`` (a saved operand a later :meth:`mm` takes
        as B) ready in the same pass."""
        return be.quantize_pair(x, **_pair_arguments(q, next_b))

    def weight_columns(self, be: Backend, w: torch.Tensor, q: TensorQuantizer) -> NVFP4Operand:
        """W^T (K, N) quantized from a high-precision w (N, K) by ``q.columnwise`` (an MS-EDEN
        backward's dgrad B): the columnwise copy of :meth:`tokens`."""
        return self.tokens(be, w, q)[1]

    def grad_copies(self, be: Backend, dy: torch.Tensor, q: TensorQuantizer, wt, xt):
        """(dY, dY^T, W^T, X^T): :meth:`tokens` of dY (M, N) by ``q`` (SR counters as
        :func:`quantizers.build` set them, shifted per tensor-parallel shard), W^T made ready for
        :meth:`mm` by ``be.prepare`` and X^T, wgrad's B, in dY's pass."""
        wt = None if wt is None else be.prepare(wt)
        dyq, dytq, xt = self.tokens(be, dy, q, xt)
        return dyq, dytq, wt, xt

    @staticmethod
    def mm(be: Backend, a: NVFP4Operand, b: NVFP4Operand, out_dtype: torch.dtype,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``be.mm``: A (M, K) @ B (N, K)^T + bias -> (M, N) of ``out_dtype``."""
        return be.mm(a, b, bias=bias, out_dtype=out_dtype)

    @staticmethod
    def dequantizable(xq: NVFP4Operand, wq: NVFP4Operand) -> Tuple[NVFP4Operand, NVFP4Operand]:
        """fprop's X and W as ``reference.dequantize`` takes them: as they are."""
        return xq, wq

    @staticmethod
    def gradient(dy: torch.Tensor) -> torch.Tensor:
        """dY as the primitives take it: as it is."""
        return dy

    @staticmethod
    def saved_columns(xt: NVFP4Operand) -> Tuple[NVFP4Operand, None]:
        """(X^T's dense operand, what else rebuilds it: nothing)."""
        return xt, None

    @staticmethod
    def columns(data: NVFP4Operand, meta: None) -> NVFP4Operand:
        """X^T rebuilt from :meth:`saved_columns`."""
        return data


class Grouped(NamedTuple):
    """The layout of the experts' grouped projections: X (T, K) tokens sorted by expert, W
    (G, N, K) stacked expert weights, no bias; X and X^T are :class:`GroupedOperand`, W and W^T
    stacked :class:`NVFP4Operand` (G, N, K) and (G, K, N) with (G,) outer scales.

    Fields:
        offs: int32 (G,) cumulative group ends on the device (``torch._grouped_mm``'s
            convention), never read on the host.
        given: None, or frozen expert weights (``frozen_experts``): stacked W (G, N, K) given as
            an operand of codes with (G,) outer scales, as :class:`Dense`'s ``given``.
    """

    offs: torch.Tensor
    given: Optional[NVFP4Operand] = None

    shard = None  # the experts are not tensor parallel (a class attribute, not a field)
    weight_amax = None  # each expert's weight has its own amax

    def weights(self, be: Backend, w: Optional[torch.Tensor], q: TensorQuantizer,
                ) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
        """(W, W^T or None): ``be.quantize_experts`` under ``q.rowwise``, each W_g alone, W^T with
        W's columnwise usage (a W used by fprop's GEMM only may come back as inner values); a
        given W as it is, its W^T left to backward."""
        if self.given is not None:
            return self.given, None
        return be.quantize_experts(w, q.rowwise.spec, need_t=q.columnwise is not None,
                                   transient=q.rowwise.gemm_only)

    def given_columns(self, be: Backend) -> NVFP4Operand:
        """Each expert's W_g^T of the given W, stacked (G, K, N): :meth:`Dense.given_columns` of
        each."""
        w = self.given
        experts = [Dense(given=NVFP4Operand(w.qdata[g], w.scale[g], w.outer_scale[g], w.spec))
                   .given_columns(be) for g in range(w.qdata.shape[0])]
        return NVFP4Operand(torch.stack([t.qdata for t in experts]),
                            torch.stack([t.scale for t in experts]), w.outer_scale, w.spec)

    def high_precision_weight(self, w: Optional[torch.Tensor]) -> torch.Tensor:
        """W as the high-precision GEMMs take it: ``w``, or the given W dequantized (float32)."""
        return w if self.given is None else R.dequantize(dequantizable_experts(self.given))

    def tokens(self, be: Backend, x: torch.Tensor, q: TensorQuantizer,
               next_b: Optional[NVFP4Operand] = None):
        """(rowwise, columnwise, ``next_b`` made ready or None): the token groups of x (T, K)
        quantized by ``q.rowwise`` and each x_g^T by ``q.columnwise`` (each None to skip) in
        ``be.quantize_groups``, which may make ``next_b`` (a stacked expert operand a later
        :meth:`mm` takes as B) ready in the same pass."""
        return be.quantize_groups(x, self.offs, **_pair_arguments(q, next_b))

    @staticmethod
    def weight_columns(be: Backend, w: torch.Tensor, q: TensorQuantizer) -> NVFP4Operand:
        """Stacked W^T (G, K, N), outer scales (G,), quantized from high-precision expert weights
        w (G, N, K) by ``q.columnwise`` (an MS-EDEN backward's dgrad B), each W_g^T alone: the
        columnwise copies of W's rows grouped by expert (:meth:`tokens` with groups of N rows),
        their codes and block scales moved into the stacked layout (``q.columnwise`` must ask
        for codes: not ``gemm_only``)."""
        g, n, k = w.shape
        offs = torch.arange(1, g + 1, dtype=torch.int32, device=w.device) * n
        cols = Grouped(offs).tokens(be, w.reshape(g * n, k), q)[1].data  # (K, G N)

        def stacked(t: torch.Tensor, per: int) -> torch.Tensor:
            return t.reshape(k, g, n // per).transpose(0, 1).contiguous()
        return cols._replace(qdata=stacked(cols.qdata, 2), scale=stacked(cols.scale, BLOCK))

    def grad_copies(self, be: Backend, dy: torch.Tensor, q: TensorQuantizer, wt, xt):
        """(dY, dY^T, W^T, X^T): :meth:`tokens` of dY (T, N) by ``q`` (SR counters from
        ``SR_OFFSETS``, each group's past the earlier groups'), W^T, dgrad's B, made ready for
        :meth:`mm` in dY's pass; ``grouped_mm`` takes X^T as it is."""
        dyq, dytq, wt = self.tokens(be, dy, q, wt)
        return dyq, dytq, wt, xt

    @staticmethod
    def mm(be: Backend, a: GroupedOperand, b, out_dtype: torch.dtype,
           bias: None = None) -> torch.Tensor:
        """``be.grouped_mm`` (the experts have no bias): (T, N), or (G, N, K) for wgrad."""
        return be.grouped_mm(a, b, out_dtype=out_dtype)

    @staticmethod
    def dequantizable(xq: GroupedOperand, wq: NVFP4Operand) -> Tuple[NVFP4Operand, NVFP4Operand]:
        """fprop's X and W as ``reference.dequantize`` takes them (:func:`dequantizable`,
        :func:`dequantizable_experts`)."""
        return dequantizable(xq), dequantizable_experts(wq)

    @staticmethod
    def gradient(dy: torch.Tensor) -> torch.Tensor:
        """dY as the grouped primitives take it: contiguous."""
        return dy.contiguous()

    @staticmethod
    def saved_columns(xt: GroupedOperand) -> Tuple[NVFP4Operand, bool]:
        """(X^T's data, its ``per_token``): with ``offs``, what rebuilds it."""
        return xt.data, xt.per_token

    def columns(self, data: NVFP4Operand, per_token: bool) -> GroupedOperand:
        """X^T rebuilt from :meth:`saved_columns`: grouped along the tokens."""
        return GroupedOperand(data, self.offs, True, per_token)


def dequantizable(xq: GroupedOperand) -> NVFP4Operand:
    """A rows-grouped operand as a dense one with one outer scale per row (its group's, or its
    own per token), which ``reference.dequantize`` takes."""
    d = xq.data
    if xq.per_token:
        return d
    rows = torch.arange(d.rows, device=xq.offs.device)
    group = torch.searchsorted(xq.offs, rows, right=True).clamp_(max=xq.groups - 1)
    return d._replace(outer_scale=d.outer_scale[group])


def dequantizable_experts(wq: NVFP4Operand) -> NVFP4Operand:
    """Stacked (G, N, K) expert weights with their (G,) outer scales spread over the rows (G, N)."""
    return wq._replace(outer_scale=wq.outer_scale[:, None].expand(-1, expert_rows(wq)))


def fprop(layout, be: Backend, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
          q: Quantizers, out_dtype: torch.dtype, wq: Optional[NVFP4Operand] = None):
    """fprop: ``Y = Q(X) @ Q(W)^T + bias`` per group on backend ``be`` (where the recipe's
    ``forward_override`` leaves X no rowwise quantizer: ``X @ W^T + bias`` in ``out_dtype``,
    ``high_precision.fprop``, the copies for backward quantized as usual).

    Args:
        layout: :class:`Dense` or :class:`Grouped`, which gives the shapes of x, w and bias.
        q: the forward's :class:`quantizers.Quantizers` (``quantizers.build``): X's rowwise copy
            (fprop's A) and columnwise copy (wgrad's X^T, with its usage), W's (fprop's B) and
            W^T (dgrad's, with W's columnwise usage).
        wq: W as ``layout.weights`` made it for fprop (``cached_weights``), or None to quantize
            ``w`` here; only without W's columnwise usage.
    Returns:
        (Y of ``out_dtype``, zeros past the last group; W^T or None; X^T or None; (X, W) or None):
        the copies backward keeps, as codes; (X, W) as ``reference.dequantize`` takes them where
        X's rowwise copy is not for fprop's GEMM only (a dequantized backward).
    """
    if q.x.rowwise is None:
        wt = layout.weights(be, w, q.w)[1] if q.w.columnwise else None
        xt = layout.tokens(be, x, q.x)[1] if q.x.columnwise else None
        y = high_precision.fprop(x.to(out_dtype), layout.high_precision_weight(w), bias,
                                 layout.offs)
        return y, wt, xt, None
    wt = None
    if wq is None:
        wq, wt = layout.weights(be, w, q.w)
    xq, xt, _ = layout.tokens(be, x, q.x)
    y = layout.mm(be, xq, wq, out_dtype, bias)
    return y, wt, xt, None if q.x.rowwise.gemm_only else layout.dequantizable(xq, wq)


def grads(layout, be: Backend, dy: torch.Tensor, wt: Optional[NVFP4Operand], xt,
          q: Quantizers, dx_dtype: torch.dtype, dw_dtype: torch.dtype,
          ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """dgrad and wgrad from dY on backend ``be``, with the backward's quantizers ``q``
    (``quantizers.build``; dY's rowwise usage with W^T, its columnwise usage with X^T).

    dgrad (with W^T): ``dX = Q(dY) @ (W^T)^T``, dY quantized rowwise (``DY_DGRAD``: SR from
    ``SR_OFFSETS[DY_DGRAD]``). wgrad (with X^T): ``dW = Q(dY^T) @ (X^T)^T``, dY^T quantized along
    the tokens (``DY_WGRAD``: RHT, SR from ``SR_OFFSETS[DY_WGRAD]``). Both copies of dY come from
    one read and are used by their GEMMs only; one of the saved operands is made ready to be its
    GEMM's B in that pass where the backend can (``layout.grad_copies``).

    Returns:
        (dX of ``dx_dtype`` or None, dW of ``dw_dtype`` or None), shaped as x and w of
        :func:`fprop`.
    """
    dyq, dytq, wt, xt = layout.grad_copies(be, dy, q.dy, wt, xt)
    dx = None if dyq is None else layout.mm(be, dyq, wt, dx_dtype)
    del dyq  # frees dY's copy before the wgrad GEMM
    dw = None if dytq is None else layout.mm(be, dytq, xt, dw_dtype)
    return dx, dw


def ms_eden_grads(layout, be: Backend, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                  q: Quantizers, dx_dtype: torch.dtype, dw_dtype: torch.dtype,
                  ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """dgrad and wgrad of an MS-EDEN backward (Quartet II, arXiv 2601.22813) on backend ``be``,
    with its quantizers ``q`` (``quantizers.build_ms_eden``): ``dX = Q(dY) @ Q(W^T)^T`` and
    ``dW = Q(dY^T) @ Q(X^T)^T``, W^T and X^T quantized again from the high-precision ``w`` and
    ``x`` (the forward's NVFP4 W and X dequantized, or the unquantized ones under
    ``forward_override``; shaped as :func:`fprop`'s), each GEMM's two operands rotated alike along
    its inner dimension (N for dgrad, the tokens of each group for wgrad), so the rotations
    cancel in the product.

    Returns:
        (dX of ``dx_dtype`` or None, dW of ``dw_dtype`` or None), as :func:`grads`.
    Raises:
        ValueError: ``be`` does not run MS-EDEN (``Backend.check_spec``).
    """
    for c in (*q.dy, q.w.columnwise, q.x.columnwise):
        if c is not None:
            be.check_spec(c.spec)
    dyq, dytq, _ = layout.tokens(be, dy, q.dy)
    dx = None if dyq is None else layout.mm(be, dyq, layout.weight_columns(be, w, q.w), dx_dtype)
    del dyq  # frees dY's copy before the wgrad GEMM
    dw = None if dytq is None else layout.mm(be, dytq, layout.tokens(be, x, q.x)[1], dw_dtype)
    return dx, dw


def _save(ctx, **kept: Union[None, torch.Tensor, NVFP4Operand]) -> None:
    """Keep ``kept`` for :func:`_saved` in backward, by name: a tensor as it is, an operand as its
    tensors (``save_for_backward``, which checks them for in-place changes) and its spec."""
    tensors, ctx.kept = [], []
    for name, item in kept.items():
        if isinstance(item, NVFP4Operand):
            ctx.kept.append((name, item.spec))
            tensors += [item.qdata, item.scale, item.outer_scale, item.values]
        else:
            ctx.kept.append((name, None))
            tensors.append(item)
    ctx.save_for_backward(*tensors)


def _saved(ctx) -> Dict[str, Union[None, torch.Tensor, NVFP4Operand]]:
    """What :func:`_save` kept, by name."""
    tensors, out = iter(ctx.saved_tensors), {}
    for name, spec in ctx.kept:
        if spec is None:
            out[name] = next(tensors)
        else:
            qdata, scale, outer, values = (next(tensors) for _ in range(4))
            out[name] = NVFP4Operand(qdata, scale, outer, spec, values)
    return out


def _backward_source(recipe: NVFP4Recipe) -> Optional[Override]:
    """Where backward takes X and W from, None for the saved W^T and X^T of an NVFP4 backward: an
    overridden backward's (``backward_override``), or an MS-EDEN backward's
    (``backward_estimator``): the forward's NVFP4 X and W (DEQUANTIZED), or the unquantized
    ones (HIGH_PRECISION) where ``forward_override`` runs fprop without NVFP4 operands."""
    if recipe.backward_estimator is None:
        return recipe.backward_override
    return Override.HIGH_PRECISION if recipe.forward_override else Override.DEQUANTIZED


class GemmsFn(torch.autograd.Function):
    """y = x @ W^T + bias under ``layout`` (:class:`Dense` or :class:`Grouped`) with NVFP4 fprop,
    dgrad and wgrad (:func:`fprop`, :func:`grads`), or the GEMMs the recipe's overrides take out
    of NVFP4 (``high_precision``), or an MS-EDEN backward (:func:`ms_eden_grads`). Returns a fresh
    tensor, never a view, so that in-place ops on it work. Backward keeps W^T and X^T as codes
    with their specs (rebuilt as the operands forward made), not the high-precision X; an
    overridden or MS-EDEN backward keeps what ``high_precision.saved`` says. Saved by name
    (:func:`_save`).

    Raises:
        ValueError: an MS-EDEN recipe on a tensor-parallel layer (not run there yet).
    """

    @staticmethod
    def forward(ctx, x, w, bias, signs, sr, recipe: NVFP4Recipe, backend: str,
                out_dtype: torch.dtype, layout):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        source = _backward_source(recipe)
        if recipe.backward_estimator is not None and layout.shard is not None:
            raise ValueError(f"NVFP4Recipe.backward_estimator={recipe.backward_estimator.value!r} "
                             f"does not run on tensor-parallel layers yet")
        q = quantizers.build(recipe, signs, Usage(need_dx and not source, need_dw and not source,
                                                  keep=source is Override.DEQUANTIZED),
                             layout.shard, weight_amax=layout.weight_amax)
        y, wt, xt, kept = fprop(layout, resolved(backend), x, w, bias, q, out_dtype)
        # sr = (sr_seed, sr_step, sr_rank) is read in backward as it is then, not saved: every
        # backward advances sr_step, which a saved tensor's version check would refuse when the
        # layer runs twice before one backward (shared weights, a loop over the layer, the
        # projections of an experts module, whose steps are views of one buffer). The layout
        # (a grouped one holds the forward's offs, which nothing modifies) is kept with it.
        ctx.recipe, ctx.backend, ctx.sr, ctx.layout = recipe, backend, sr, layout
        ctx.x_dtype, ctx.w_dtype = x.dtype, None if w is None else w.dtype
        ctx.has_bias = bias is not None
        if source is not None:
            _save(ctx, w=w, **high_precision.saved(source, x, kept, need_dw))
            return y
        xt, ctx.xt_meta = layout.saved_columns(xt) if xt is not None else (None, None)
        _save(ctx, signs=signs, wt=wt, xt=xt)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        source, layout = _backward_source(ctx.recipe), ctx.layout
        with autocast_off(dy.device.type):
            g = layout.gradient(dy)
            if source is None:
                dx, dw = _nvfp4_grads(ctx, g, need_dx, need_dw)
            else:
                dx, dw = _grads_from_x_and_w(ctx, source, g, need_dx, need_dw)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32)  # fp32 accumulation without an fp32 copy of dY
        return dx, dw, db, None, None, None, None, None, None


def _grads_from_x_and_w(ctx, source: Override, dy: torch.Tensor, need_dx: bool, need_dw: bool):
    """dgrad and wgrad from the X and W :class:`GemmsFn` kept (``_backward_source``): in high
    precision under ``backward_override`` (``high_precision.grads``), else an MS-EDEN backward
    (:func:`ms_eden_grads`)."""
    layout, kept = ctx.layout, _saved(ctx)
    x, w = high_precision.restored(source, layout.high_precision_weight(kept.pop("w")), kept)
    if ctx.recipe.backward_override is not None:
        return high_precision.grads(dy, x, w, need_dx, need_dw, ctx.x_dtype, ctx.w_dtype,
                                    layout.offs)
    q = quantizers.build_ms_eden(ctx.recipe, Usage(need_dx, need_dw), next_sr_key(*ctx.sr),
                                 dy.device)
    return ms_eden_grads(layout, resolved(ctx.backend), dy, x, w, q, ctx.x_dtype, ctx.w_dtype)


def _nvfp4_grads(ctx, dy: torch.Tensor, need_dx: bool, need_dw: bool):
    """dgrad and wgrad in NVFP4 from what :class:`GemmsFn` saved: W^T and X^T rebuilt from their
    codes and specs."""
    saved = _saved(ctx)
    wt = None
    if need_dx:
        wt = saved["wt"] if ctx.layout.given is None else ctx.layout.given_columns(
            resolved(ctx.backend))
    xt = None if saved["xt"] is None or not need_dw else ctx.layout.columns(saved["xt"],
                                                                             ctx.xt_meta)
    signs = saved["signs"]
    q = quantizers.build(ctx.recipe, signs, Usage(wt is not None, xt is not None),
                         ctx.layout.shard, dy.shape, next_sr_key(*ctx.sr))
    return grads(ctx.layout, resolved(ctx.backend), dy, wt, xt, q, ctx.x_dtype, ctx.w_dtype)
