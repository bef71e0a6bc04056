"""Interactive inspection: which layers a model runs in NVFP4, what NVFP4 does to a tensor, and the
quantized operands a training step actually used."""

import contextlib
import math
from typing import Dict, Iterator, Optional, Union

import torch
from torch import nn

from . import reference as R
from .api import check_module, linear_layers, nvfp4_counts, skip_reasons
from .conv1d import features
from .formats import E2M1_GRID, unpack_nibbles
from .layer import NVFP4Module
from .linear import NVFP4Linear
from .recipe import NVFP4Recipe
from .spec import GemmRole, QuantSpec

__all__ = ["summary", "tensor_stats", "capture"]

E2M1_MAX_CODE = len(E2M1_GRID) - 1  # the magnitude code of 6
# A block scale rounded to E4M3 (3 mantissa bits) may sit up to 2**-4 below block_amax / 6, which
# clips the block's largest values by as much; saturation is counted beyond that.
_SATURATION_MARGIN = 1 / 8
_ROLES = {*GemmRole, *(r.value for r in GemmRole)}


def summary(model: nn.Module, recipe: Optional[NVFP4Recipe] = None) -> str:
    """A table of the model's linear layers (nn.Linear and transformers' Conv1D): fqn, shape,
    NVFP4 or the dtype they run in, and why; then the other modules left in high precision (experts
    modules, layer types ``quantize_`` does not convert) with why; then the counts.

    The reasons are those ``quantize_`` found (the ``nvfp4_kept`` it sets on the model) or, with
    ``recipe``, that recipe's filter applied to the model as it is now (``api.skip_reasons``).

    Raises:
        TypeError: ``model`` is not an nn.Module.
    """
    check_module("summary", model)
    reasons = skip_reasons(model, recipe) if recipe is not None else getattr(model, "nvfp4_kept", {})
    linears = linear_layers(model)
    modules = dict(model.named_modules())
    rows = [("layer", "in x out", "precision", "note")]
    for fqn, m in linears.items():
        shape = " x ".join(map(str, features(m)))
        if isinstance(m, NVFP4Linear):
            rows.append((fqn, shape, "nvfp4", m.extra_repr().split("recipe=")[1]))
        else:
            rows.append((fqn, shape, _dtype(m), reasons.get(fqn, "")))
    rows += [(fqn, "", _dtype(modules[fqn]), why) for fqn, why in reasons.items()
             if fqn not in linears and fqn in modules]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(nvfp4_counts(model))
    return "\n".join(lines)


def _dtype(module: nn.Module) -> str:
    p = next(module.parameters(recurse=False), None)
    return "" if p is None else str(p.dtype).replace("torch.", "")


@contextlib.contextmanager
def capture(model: nn.Module) -> Iterator[Dict[str, Dict[str, object]]]:
    """Record the NVFP4 operands each NVFP4 module of ``model`` (NVFP4Linear and the experts
    modules) uses in the steps run inside the context, as :class:`NVFP4Tensor` s (the last
    step's, per module).

    Yields a dict ``{layer fqn: {name: NVFP4Tensor}}`` filled as the steps run: after a forward,
    ``"w"`` (W as fprop's B, (N, K)), ``"x"`` (X as fprop's A, (M, K)) and, when the token count
    is a multiple of 16, ``"xt"`` (X^T as wgrad's B: RHT along the tokens, (K, M)); after the
    backward, ``"dy"`` (dY as dgrad's A, SR) and ``"dyt"`` (dY^T as wgrad's A). Each is quantized
    again from the step's tensors with the step's specs, RHT signs and SR stream, so it holds the
    bits the GEMMs used (it costs those quantizations again; eager mode only, not under
    torch.compile). Outside the context the layers record nothing.

    An experts module records ``{projection: {name: [NVFP4Tensor, ...]}}`` with the same names:
    one tensor per expert for ``"w"`` (W_g, (N, K)), one per token group for the others (the
    group's tokens as the grouped GEMMs quantize them: X_g (M_g, K), X_g^T (K, M_g), ...).

    Example::

        with nvfp4_recipe.capture(model) as ops:
            loss_fn(model(x)).backward()
        print(ops["blocks.0.fc1"]["dy"])          # the SR-quantized output gradient
        nvfp4_recipe.tensor_stats(...)
    """
    layers = {fqn: m for fqn, m in model.named_modules() if isinstance(m, NVFP4Module)}
    for layer in layers.values():
        layer.captured = {}
    try:
        yield {fqn: layer.captured for fqn, layer in layers.items()}
    finally:
        for layer in layers.values():
            layer.captured = None


def tensor_stats(x: torch.Tensor, spec: Union[NVFP4Recipe, QuantSpec, None] = None,
                 role: Union[GemmRole, str] = GemmRole.X_FPROP, *, seed: int = 0, offset: int = 0,
                 rht_signs: Optional[torch.Tensor] = None,
                 amax: Optional[torch.Tensor] = None) -> Dict[str, object]:
    """What NVFP4 quantization does to ``x``, read from the quantized result itself (the codes,
    block scales and dequantized values of ``reference.quantize`` / ``reference.dequantize``).

    Args:
        x: (..., K) bf16/fp16/fp32 tensor with at least one element, K a multiple of 16.
        spec: an NVFP4Recipe (the quantization of operand ``role`` of its recipe table, e.g.
            "w_fprop", "dy_dgrad", with the recipe's RHT signs), a QuantSpec, or None for 1d
            per-tensor RN.
        seed, offset: the SR stream (SR specs); rht_signs: the RHT signs of a QuantSpec with RHT
            (default: TE's vector); amax: an amax to use instead of the measured one.
    Returns:
        dict with
        ``sqnr_db``: 10 log10(|x|^2 / |x - deq(q(x))|^2), summed in float64 (finite for any finite
            fp32 input; inf only when the quantization is exact; nan when x has a NaN or Inf), in
            the RHT domain when the RHT is on;
        ``non_finite``: the number of NaN and Inf elements of x (they make the outer scale and
            every dequantized value non-finite, spec item 9);
        ``flushed_to_zero``: fraction of the nonzero inputs that dequantize to 0 (small values in a
            block with a large amax, or whole blocks whose E4M3 scale is too small);
        ``saturated``: fraction of the elements clipped by the E2M1 range: quantized to the largest
            code (6) of a nonzero block scale while |x| exceeds the dequantized value by more than
            1/8 (beyond what the E4M3 rounding of the block scale can cause), e.g. under amax
            estimation;
        ``zero_scale_blocks``: fraction of the blocks whose E4M3 block scale is 0;
        ``scale_histogram``: counts of the exponents of the nonzero block scales, {exponent: count};
        ``amax`` and ``outer_scale`` (float or tensor).
    Raises:
        TypeError, ValueError: as ``reference.quantize``; ValueError for an empty ``x`` or a
            ``role`` that is not a GemmRole nor one's value; TypeError for an ``x`` that is not a
            tensor or a ``spec`` of another type.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tensor_stats takes a torch.Tensor as x, got {type(x).__name__}")
    if role not in _ROLES:
        raise ValueError(f"tensor_stats: unknown role {role!r}; expected a GemmRole or one of "
                         f"{[r.value for r in GemmRole]}")
    if x.numel() == 0:
        raise ValueError("tensor_stats: x has no elements")
    if isinstance(spec, NVFP4Recipe):
        qspec = spec.spec(role)
        rht_signs = spec.signs() if rht_signs is None else rht_signs
    elif isinstance(spec, QuantSpec) or spec is None:
        qspec = spec or QuantSpec()
        rht_signs = NVFP4Recipe().signs() if rht_signs is None else rht_signs
    else:
        raise TypeError(f"tensor_stats takes an NVFP4Recipe, a QuantSpec or None, got {type(spec).__name__}")
    signs = rht_signs if qspec.rht else None
    ref = R.rht(x, signs).float() if signs is not None else x.float()
    data = R.quantize(x, qspec, seed=seed, offset=offset, rht_signs=signs, amax_=amax)
    deq = R.dequantize(data)
    ref64, deq64 = ref.double(), deq.double()
    err = (ref64 - deq64).square().sum().item()
    sig = ref64.square().sum().item()
    non_finite = x.numel() - torch.isfinite(x).sum().item()
    if non_finite:
        sqnr = math.nan
    elif err > 0:
        sqnr = 10 * math.log10(sig / err)
    else:
        sqnr = math.inf
    nonzero = ref != 0
    flushed = ((deq == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)
    # a block whose scale is 0 puts its values on the largest code too, but it is flushed, not clipped
    at_max = ((unpack_nibbles(data.qdata) & 0x7) == E2M1_MAX_CODE) & (deq != 0)
    saturated = (at_max & (ref64.abs() > deq64.abs() * (1 + _SATURATION_MARGIN))).double().mean().item()
    scale = data.scale.float()
    exps, counts = torch.unique(torch.floor(torch.log2(scale[scale > 0])).to(torch.int64),
                                return_counts=True)
    return {
        "sqnr_db": sqnr,
        "non_finite": non_finite,
        "flushed_to_zero": flushed,
        "saturated": saturated,
        "zero_scale_blocks": (scale == 0).double().mean().item(),
        "scale_histogram": dict(zip(exps.tolist(), counts.tolist())),
        "amax": _item(R.amax(ref, qspec.scaling)),
        "outer_scale": _item(data.outer_scale),
    }


def _item(t: torch.Tensor):
    return t.item() if t.dim() == 0 else t
