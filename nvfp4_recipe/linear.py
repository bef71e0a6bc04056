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

import contextlib
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Iterator, Optional, Tuple

import torch
from torch import nn

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a build without torch.distributed has no DTensor weights
    DTensor = ()

from .backends import Backend, get_backend, resolved
from .formats import BLOCK
from .kernels.philox import next_key
from .kernels.runtime import tracing
from .operand import NVFP4Operand
from .recipe import SR_OFFSETS, NVFP4Recipe
from .spec import Block, GemmRole
from .tensor import NVFP4Tensor

if TYPE_CHECKING:
    from .distributed import TensorParallelShard

__all__ = ["NVFP4Linear", "cached_weights", "linear_fprop", "linear_grads", "next_sr_key", "sr_key"]

_BUFFERS = ("rht_signs", "sr_seed", "sr_step")

# the layers that cached a weight in the innermost cached_weights() context, None outside one
_CACHING: ContextVar[Optional[weakref.WeakSet]] = ContextVar("nvfp4_cached_weights", default=None)


@contextlib.contextmanager
def cached_weights() -> Iterator[None]:
    """Within this context each :class:`NVFP4Linear` quantizes its weight once and reuses the
    result in every forward that records no autograd graph (evaluation under ``torch.no_grad()``,
    ``generate()``), instead of quantizing the master weight on every call.

    The outputs are those of uncached forwards, bit for bit: the weight's quantization is
    round-to-nearest (no random bits), and a layer quantizes again when its weight is another
    tensor or has a new version (any in-place update through the tensor: an optimizer step,
    ``load_state_dict``, ``copy_``). Use it around evaluation or generation, not around training
    steps: updates that bypass the version counter (writes through ``weight.data``, FSDP2's
    all-gathers into its unsharded parameters) are not seen. Forwards that record autograd
    (training), torch.compile tracing, CUDA-graph capture and tensor-parallel layers do not use
    the cache. Each layer holds its fprop weight operand (fp16 inner values on sm89+ GPUs, 2 bytes
    an element; codes and scales elsewhere, 0.5625) until the context exits. The same idea as
    TransformerEngine's ``is_first_microbatch`` and ``torch.nn.utils.parametrize.cached()``.

    Example::

        with torch.no_grad(), nvfp4_recipe.cached_weights():
            model.generate(input_ids, max_new_tokens=64)
    """
    layers = weakref.WeakSet()
    token = _CACHING.set(layers)
    try:
        yield
    finally:
        _CACHING.reset(token)
        for layer in layers:
            layer._weight_cache = None


def sr_key(sr_seed: torch.Tensor, sr_step: torch.Tensor, sr_rank: int = 0) -> torch.Tensor:
    """The 64-bit Philox key of a backward's SR stream: ``sr_seed + sr_rank + (sr_step << 32)``,
    an int64 device scalar (no host sync). Distinct for every (rank, step) of a layer, since
    ``sr_seed`` and ``sr_rank`` are below 2**32; ``sr_rank`` 0 (one process) adds nothing."""
    key = torch.add(sr_seed, sr_step, alpha=1 << 32)  # one kernel
    return key + sr_rank if sr_rank else key


def next_sr_key(sr_seed: torch.Tensor, sr_step: torch.Tensor, sr_rank: int = 0) -> torch.Tensor:
    """A backward's SR key, :func:`sr_key` of the counters as they are, and ``sr_step`` advanced by
    one in place (a mutation torch.compile and CUDA graphs keep). On a GPU in eager mode one small
    kernel does both (``kernels.philox.next_key``): the launches saved are host time in a
    host-bound backward; elsewhere torch ops, also while torch.compile traces (its backward
    graph too), which fuses them and keeps the mutation as an ordinary in-place op."""
    if sr_step.is_cuda and not (torch.compiler.is_compiling() or tracing()):
        return next_key(sr_seed, sr_step, sr_rank)
    key = sr_key(sr_seed, sr_step, sr_rank)
    sr_step.add_(1)
    return key


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (``parallelize_module`` replicates a layer's buffers), else t."""
    return t.to_local() if isinstance(t, DTensor) else t


def _amax_reduce(shard: Optional["TensorParallelShard"], recipe: NVFP4Recipe, role: GemmRole):
    """The amax reducer of operand ``role`` (None: its own amax)."""
    return None if shard is None else shard.amax_reduce(role, recipe.spec(role))


def linear_fprop(be: Backend, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 recipe: NVFP4Recipe, signs: torch.Tensor, out_dtype: torch.dtype, need_wt: bool,
                 need_xt: bool, shard: Optional["TensorParallelShard"] = None,
                 w: Optional[NVFP4Operand] = None,
                 ) -> Tuple[torch.Tensor, Optional[NVFP4Operand], Optional[NVFP4Operand]]:
    """fprop of an NVFP4 linear: ``Y = Q(X) @ Q(W)^T + bias`` on backend ``be``.

    Args:
        x: (M, K) activations; weight: W (N, K); bias: None or (N,).
        signs: (16,) RHT signs of the wgrad copy X^T.
        need_wt, need_xt: also quantize W^T (K, N) for dgrad and X^T (K, M) for wgrad.
        shard: None, or the tensor-parallel layout of these local shards
            (:class:`distributed.TensorParallelShard`): the amaxes of sharded operands are
            reduced over the group, so each shard is quantized as the whole tensor is.
        w: W as ``be.prepare_weight`` made it for fprop (:func:`cached_weights`), or None to
            quantize ``weight`` here; only without need_wt.
    Returns:
        (Y (M, N) of ``out_dtype``, W^T or None, X^T or None): the copies backward keeps, as codes.
    """
    wt = None
    if w is None:
        w, wt = be.prepare_weight(weight, recipe.spec(GemmRole.W_FPROP), need_t=need_wt,
                                  amax_reduce=_amax_reduce(shard, recipe, GemmRole.W_FPROP))
    xq, xt, _ = be.quantize_pair(x, recipe.spec(GemmRole.X_FPROP),
                                 recipe.spec(GemmRole.X_WGRAD) if need_xt else None,
                                 signs=signs, transient=(True, False),
                                 amax_reduce=(_amax_reduce(shard, recipe, GemmRole.X_FPROP),
                                              _amax_reduce(shard, recipe, GemmRole.X_WGRAD)))
    return be.mm(xq, w, bias=bias, out_dtype=out_dtype), wt, xt


def linear_grads(be: Backend, dy: torch.Tensor, wt: Optional[NVFP4Operand],
                 xt: Optional[NVFP4Operand], recipe: NVFP4Recipe, signs: torch.Tensor,
                 seed: torch.Tensor, dx_dtype: torch.dtype, dw_dtype: torch.dtype,
                 shard: Optional["TensorParallelShard"] = None,
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


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would return: the autocast dtype when autocast is on, else x.dtype."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


@torch.compiler.assume_constant_result
def _backend_name(name: str, device: torch.device) -> str:
    """The backend that runs on ``device``, resolved in Python even under torch.compile (it may
    import a backend module and log a fallback, neither of which belongs in a graph)."""
    return get_backend(name, device).name


class _NVFP4LinearFn(torch.autograd.Function):
    """y (M, N) = x (M, K) @ W^T + b with NVFP4 fprop, dgrad and wgrad GEMMs (:func:`linear_fprop`,
    :func:`linear_grads`). Returns a fresh tensor, never a view, so that in-place ops on it work."""

    @staticmethod
    def forward(ctx, x, weight, bias, signs, sr_seed, sr_step, recipe: NVFP4Recipe, backend: str,
                out_dtype: torch.dtype, sr_rank: int, shard: Optional["TensorParallelShard"]):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_dw and x.shape[0] % BLOCK:
            raise ValueError(f"NVFP4 wgrad quantizes along tokens in blocks of {BLOCK}: in training the "
                             f"number of tokens (product of the input's leading dims) must be a "
                             f"multiple of {BLOCK}, got {x.shape[0]} (inference under torch.no_grad "
                             f"takes any number)")
        y, wt, xt = linear_fprop(resolved(backend), x, weight, bias, recipe, signs, out_dtype,
                                 need_dx, need_dw, shard)
        ctx.recipe, ctx.backend, ctx.sr_rank, ctx.shard = recipe, backend, sr_rank, shard
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        none3 = (None, None, None)
        ctx.save_for_backward(*(wt[:3] if wt else none3), *(xt[:3] if xt else none3), signs)
        # the SR counters are read in backward as they are then, not as saved: every backward
        # advances sr_step, which a saved tensor's version check would refuse when the layer runs
        # twice before one backward (shared weights, a loop over the layer)
        ctx.sr = (sr_seed, sr_step)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        signs = saved[6]
        sr_seed, sr_step = ctx.sr
        w_block = Block.D2 if ctx.recipe.weight_2d else Block.D1
        wt = NVFP4Operand(*saved[0:3], w_block) if saved[0] is not None else None
        xt = NVFP4Operand(*saved[3:6]) if saved[3] is not None else None
        seed = next_sr_key(sr_seed, sr_step, ctx.sr_rank)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        wt, xt = wt if need_dx else None, xt if need_dw else None
        with torch.autocast(dy.device.type, enabled=False):
            dx, dw = linear_grads(resolved(ctx.backend), dy, wt, xt, ctx.recipe, signs, seed,
                                  ctx.x_dtype, ctx.w_dtype, ctx.shard)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32)  # fp32 accumulation without an fp32 copy of dY
        return dx, dw, db, None, None, None, None, None, None, None, None


class NVFP4Linear(nn.Linear):
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
        self.recipe = recipe if recipe is not None else NVFP4Recipe()
        self.layer_seed = layer_seed
        self.sr_rank = 0
        self.captured = None  # a dict while ``inspect.capture`` records this layer
        self._weight_cache = None  # (weight, its version, backend, W operand) in cached_weights()
        self._register_recipe_buffers(device)

    def _register_recipe_buffers(self, device) -> None:
        self.register_buffer("rht_signs", torch.empty(BLOCK, dtype=torch.float32, device=device))
        self.register_buffer("sr_seed", torch.empty((), dtype=torch.int64, device=device))
        self.register_buffer("sr_step", torch.empty((), dtype=torch.int64, device=device))
        self.reset_recipe_buffers()

    @torch.no_grad()
    def reset_recipe_buffers(self) -> None:
        """Set ``rht_signs``, ``sr_seed`` and ``sr_step`` (in place) to the values the recipe and
        the layer seed give a new layer (see the class docstring)."""
        _local(self.rht_signs).copy_(self.recipe.signs())
        _local(self.sr_seed).fill_((self.recipe.seed + self.layer_seed) & 0xFFFFFFFF)
        _local(self.sr_step).zero_()

    def reset_parameters(self) -> None:
        """nn.Linear's initialization of ``weight`` and ``bias``, and :meth:`reset_recipe_buffers`."""
        super().reset_parameters()
        if "sr_step" in self._buffers:  # nn.Linear.__init__ calls this before the buffers exist
            self.reset_recipe_buffers()

    def _apply(self, fn, recurse=True):
        # to_empty (materializing a meta-device model) gives the buffers uninitialized memory
        was_meta = self.sr_step.is_meta
        self._weight_cache = None
        super()._apply(fn, recurse)
        if was_meta and not self.sr_step.is_meta:
            self.reset_recipe_buffers()
        return self

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
        new._register_recipe_buffers(linear.weight.device)
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this layer's weight and bias Parameters."""
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        lin.train(self.training)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            from .distributed import tensor_parallel_forward
            return tensor_parallel_forward(self, x)
        return self.local_forward(x, self.weight, self.bias)

    def local_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      shard: Optional["TensorParallelShard"] = None) -> torch.Tensor:
        """The layer's forward on (local) tensors: x (..., K) -> (..., N) for weight (N, K) and
        bias (N,) or None, this layer's parameters or, with ``shard``, their tensor-parallel
        shards (amaxes reduced over the group)."""
        n, k = weight.shape
        if x.shape[-1] != k:
            raise ValueError(f"NVFP4Linear expects input (..., {k}), got {tuple(x.shape)}")
        backend = _backend_name(self.recipe.backend, weight.device)
        out_dtype = _out_dtype(x)
        signs = _local(self.rht_signs)
        x2 = x.reshape(-1, k)
        with torch.autocast(x.device.type, enabled=False):
            if x2.shape[0] == 0:  # no tokens: no amax to take; nn.Linear's empty result
                y = nn.functional.linear(x2.to(weight.dtype), weight, bias).to(out_dtype)
            elif torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (x, weight, bias)):
                y = _NVFP4LinearFn.apply(x2, weight, bias, signs, _local(self.sr_seed),
                                         _local(self.sr_step), self.recipe, backend, out_dtype,
                                         self.sr_rank, shard)
            else:
                y = linear_fprop(resolved(backend), x2, weight, bias, self.recipe, signs,
                                 out_dtype, False, False, shard,
                                 self._cached_weight(weight, backend, shard))[0]
            if self.captured is not None and x2.shape[0] and shard is None:
                self._capture(x2, y, backend)
        # _unsafe_view: the (..., N) result is not a view of the (M, N) GEMM output, as with
        # nn.Linear (aten::matmul), so in-place ops and FSDP2 (which warns on views) take it
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], n))

    def _cached_weight(self, weight: torch.Tensor, backend: str,
                       shard: Optional["TensorParallelShard"]) -> Optional[NVFP4Operand]:
        """W quantized for fprop, from this layer's cache inside :func:`cached_weights` (made
        again for another weight tensor, version or backend), or None where the cache does not
        apply (outside the context, while tracing or capturing a CUDA graph, tensor parallel)."""
        if torch.compiler.is_compiling() or tracing():  # first: Dynamo cannot trace a ContextVar
            return None
        layers = _CACHING.get()
        if (layers is None or shard is not None
                or (weight.is_cuda and torch.cuda.is_current_stream_capturing())):
            return None
        cache = self._weight_cache
        if cache is None or cache[0] is not weight or cache[1:3] != (weight._version, backend):
            w, _ = get_backend(backend, weight.device).prepare_weight(
                weight, self.recipe.spec(GemmRole.W_FPROP), need_t=False)
            cache = self._weight_cache = (weight, weight._version, backend, w)
            layers.add(self)
        return cache[3]

    def quantized_weight(self) -> NVFP4Tensor:
        """The weight as fprop quantizes it (the recipe's W spec, the layer's backend), as an
        :class:`NVFP4Tensor` of shape (out_features, in_features): for inspection; training
        quantizes the master weight again on every forward."""
        backend = _backend_name(self.recipe.backend, self.weight.device)
        spec = self.recipe.spec(GemmRole.W_FPROP)
        with torch.no_grad():
            op = get_backend(backend, self.weight.device).quantize(self.weight, spec)
        return NVFP4Tensor.from_operand(op, spec, self.weight.dtype, backend=backend)

    def _capture(self, x2: torch.Tensor, y: torch.Tensor, backend: str) -> None:
        """Record the operands of this step's GEMMs in ``self.captured`` (``inspect.capture``): X,
        W and X^T now, dY and dY^T when the gradient of ``y`` arrives. They are quantized again with
        the step's specs, signs and SR stream, so they are the bits the GEMMs used."""
        be = get_backend(backend, x2.device)
        signs, r = self.rht_signs, self.recipe
        x2 = x2.detach()

        def tensor(t, role, **kw):
            spec = r.spec(role)
            return NVFP4Tensor.from_operand(be.quantize(t, spec, signs=signs, **kw), spec, t.dtype,
                                            signs if spec.rht else None, backend)

        with torch.no_grad():
            self.captured.update(w=self.quantized_weight(), x=tensor(x2, GemmRole.X_FPROP))
            if x2.shape[0] % BLOCK == 0:  # X^T's blocks run along the tokens
                self.captured.update(xt=tensor(x2.t(), GemmRole.X_WGRAD))
        if y.requires_grad:
            seed = sr_key(self.sr_seed, self.sr_step, self.sr_rank)  # before backward advances it

            def record_dy(dy):
                with torch.no_grad():
                    self.captured.update(
                        dy=tensor(dy, GemmRole.DY_DGRAD, seed=seed,
                                  offset=SR_OFFSETS[GemmRole.DY_DGRAD]),
                        dyt=tensor(dy.t(), GemmRole.DY_WGRAD, seed=seed,
                                   offset=SR_OFFSETS[GemmRole.DY_WGRAD]))
            y.register_hook(record_dy)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A checkpoint of a plain nn.Linear has no recipe buffers: keep this layer's own.
        for name in _BUFFERS:
            state_dict.setdefault(prefix + name, getattr(self, name))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        r = self.recipe
        parts = ["rht" if r.rht else "no-rht", "sr" if r.stochastic_rounding else "rn",
                 "2d-weights" if r.weight_2d else "1d-weights", r.scaling]
        if r.amax_estimation:
            parts.append(f"amax-est{r.amax_estimation}")
        return f"{super().extra_repr()}, recipe=nvfp4({', '.join(parts)}), backend={r.backend}"

