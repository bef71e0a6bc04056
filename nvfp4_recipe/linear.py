"""NVFP4Linear: an nn.Linear whose three GEMMs (fprop, dgrad, wgrad) run in NVFP4.

The recipe table of design.md (after NVIDIA, arXiv 2509.25149, section 4):

    fprop  Y  = X W^T    X: 1D RN             W: 2D (or 1D) RN
    dgrad  dX = dY W     dY: 1D, SR           W^T: the same 2D quantization, transposed
    wgrad  dW = dY^T X   dY^T: RHT + 1D, SR   X^T: RHT + 1D, RN   (blocks along tokens)

The weight stays a high-precision master parameter; it is quantized on every forward. Backward
keeps the quantized columnwise X^T (and W^T), not the high-precision X.
"""

from typing import Optional

import torch
from torch import nn

from . import ops
from .backends import get_backend
from .formats import BLOCK
from .recipe import SR_OFFSETS, NVFP4Recipe
from .reference import NVFP4Data

__all__ = ["NVFP4Linear"]

_BUFFERS = ("rht_signs", "sr_seed", "sr_step")


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
    """y = x @ W^T + b with NVFP4 fprop, dgrad and wgrad GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, signs, sr_seed, sr_step, recipe: NVFP4Recipe, backend: str,
                out_dtype: torch.dtype):
        x2 = x.reshape(-1, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_dw and x2.shape[0] % BLOCK:
            raise ValueError(f"NVFP4 wgrad quantizes along tokens in blocks of {BLOCK}: the number of "
                             f"tokens (product of the input's leading dims) must be a multiple of "
                             f"{BLOCK}, got {x2.shape[0]}")
        w_spec = recipe.operand("w_fprop")
        y, wtq, xtq = ops.linear_fprop(x2, weight, w_spec, recipe.operand("x_fprop"),
                                       recipe.operand("x_wgrad") if need_dw else None, need_dx,
                                       bias, out_dtype, sr_seed, signs, backend)
        ctx.recipe, ctx.backend, ctx.w_block = recipe, backend, w_spec.block
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.save_for_backward(*(wtq or (None,) * 3), *(xtq or (None,) * 3), signs, sr_seed, sr_step)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        wtq, xtq, (signs, sr_seed, sr_step) = NVFP4Data(*saved[0:3]), NVFP4Data(*saved[3:6]), saved[6:]
        seed = torch.add(sr_seed, sr_step, alpha=1 << 32)  # one kernel
        sr_step.add_(1)  # a mutation in backward: torch.compile and CUDA graphs keep it
        recipe, backend = ctx.recipe, ctx.backend
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy2 = dy.reshape(-1, dy.shape[-1])
        row, col = recipe.operand("dy_dgrad"), recipe.operand("dy_wgrad")
        with torch.autocast(dy.device.type, enabled=False):
            dx, dw = ops.linear_grads(dy2, wtq if need_dx else None, xtq if need_dw else None,
                                      ctx.w_block, row, col, ctx.x_dtype, ctx.w_dtype, seed,
                                      SR_OFFSETS["dy_dgrad"], SR_OFFSETS["dy_wgrad"], signs, backend)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32)  # fp32 accumulation without an fp32 copy of dY
        return dx, dw, db, None, None, None, None, None, None


class NVFP4Linear(nn.Linear):
    """nn.Linear trained with all three GEMMs in NVFP4 under an :class:`NVFP4Recipe`.

    Shapes as nn.Linear: input (..., in_features) -> output (..., out_features); in_features and
    out_features must be multiples of 16, and in training the number of tokens (the product of the
    input's leading dims) too. Parameters are the usual high-precision ``weight`` and ``bias``.

    Buffers (saved in the state dict next to nn.Linear's keys):
        rht_signs: (16,) float32 +-1 signs of the RHT on the wgrad operands.
        sr_seed: int64 scalar, this layer's Philox key (low 32 bits).
        sr_step: int64 scalar, advanced by every backward; a backward's SR stream is keyed by
            ``sr_seed + (sr_step << 32)`` with the value before the advance.

    Raises:
        ValueError: a feature count not a multiple of 16; a token count not a multiple of 16 in
            training; a backend that cannot run on the weight's device.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, recipe: Optional[NVFP4Recipe] = None, layer_seed: int = 0):
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if n % BLOCK:
                raise ValueError(f"NVFP4Linear needs {name} to be a multiple of {BLOCK}, got {n}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.recipe = recipe if recipe is not None else NVFP4Recipe()
        self._init_buffers(layer_seed, device)

    def _init_buffers(self, layer_seed: int, device) -> None:
        self.register_buffer("rht_signs", self.recipe.signs().to(device))
        seed = (self.recipe.seed + layer_seed) & 0xFFFFFFFF
        self.register_buffer("sr_seed", torch.tensor(seed, dtype=torch.int64, device=device))
        self.register_buffer("sr_step", torch.zeros((), dtype=torch.int64, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[NVFP4Recipe] = None,
                    layer_seed: int = 0) -> "NVFP4Linear":
        """An NVFP4Linear that shares ``linear``'s weight and bias Parameters (optimizers keep them)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta",
                  recipe=recipe, layer_seed=layer_seed)
        new.weight, new.bias = linear.weight, linear.bias
        new._init_buffers(layer_seed, linear.weight.device)
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this layer's weight and bias Parameters."""
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        lin.train(self.training)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear expects input (..., {self.in_features}), got {tuple(x.shape)}")
        backend = _backend_name(self.recipe.backend, self.weight.device)
        out_dtype = _out_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            return _NVFP4LinearFn.apply(x, self.weight, self.bias, self.rht_signs, self.sr_seed,
                                        self.sr_step, self.recipe, backend, out_dtype)

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

