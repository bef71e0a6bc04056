"""Interactive inspection: which layers a model runs in NVFP4, and what NVFP4 does to a tensor."""

import math
from typing import Dict, Optional, Union

import torch
from torch import nn

from . import reference as R
from .formats import E2M1_MAX, E4M3_MAX
from .linear import NVFP4Linear
from .recipe import NVFP4Recipe, OperandSpec

__all__ = ["summary", "tensor_stats"]


def summary(model: nn.Module, recipe: Optional[NVFP4Recipe] = None) -> str:
    """A table of the model's linear layers: fqn, shape, NVFP4 or high precision, and why.

    ``recipe`` (optional) explains skipped layers with that recipe's filter; without it, layers that
    are plain nn.Linear are listed as "high precision".
    """
    from .api import skip_reasons

    reasons = skip_reasons(model, recipe) if recipe is not None else {}
    rows = [("layer", "in x out", "precision", "note")]
    for fqn, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        shape = f"{m.in_features} x {m.out_features}"
        if isinstance(m, NVFP4Linear):
            rows.append((fqn, shape, "nvfp4", m.extra_repr().split("recipe=")[1]))
        else:
            rows.append((fqn, shape, str(m.weight.dtype).replace("torch.", ""), reasons.get(fqn, "")))
    n_fp4 = sum(r[2] == "nvfp4" for r in rows[1:])
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"{n_fp4} of {len(rows) - 1} linear layers in NVFP4")
    return "\n".join(lines)


def tensor_stats(x: torch.Tensor, spec: Union[NVFP4Recipe, Dict, None] = None,
                 role: str = "x_fprop") -> Dict[str, object]:
    """What NVFP4 quantization does to ``x``.

    Args:
        x: (..., K) bf16/fp16/fp32 tensor, K a multiple of 16.
        spec: an NVFP4Recipe (the operand ``role`` of its recipe table is used, e.g. "w_fprop",
            "dy_dgrad"), or a dict of ``reference.quantize`` keyword arguments (block, scaling,
            rounding, seed, offset, rht_signs), or None for 1d per-tensor RN.
    Returns:
        dict with ``sqnr_db`` (10 log10(|x|^2 / |x - deq(q(x))|^2), in the RHT domain when the RHT is
        on), ``flushed_to_zero`` (fraction of nonzero inputs quantized to 0), ``saturated_blocks``
        (fraction of blocks whose unclamped scale falls outside E4M3's [2**-6, 448]: values clipped at
        +-6 (e.g. under amax estimation) or tiny blocks flushed towards zero),
        ``scale_histogram`` (counts of block-scale exponents, {exponent: count}), ``amax`` and
        ``outer_scale`` (float or tensor).
    Raises:
        TypeError, ValueError: as ``reference.quantize``.
    """
    kwargs = _quantize_kwargs(spec, role)
    ref = R.rht(x, kwargs["rht_signs"]) if kwargs.get("rht_signs") is not None else x.float()
    data = R.quantize(x, **kwargs)
    deq = R.dequantize(data, kwargs.get("block", "1d"))
    err = (ref - deq).pow(2).sum()
    sig = ref.pow(2).sum()
    sqnr = 10 * math.log10(sig.item() / err.item()) if err > 0 else math.inf
    nonzero = ref != 0
    flushed = ((deq == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)
    scale = data.scale.float()
    blocks = R._block_view(ref, kwargs.get("block", "1d")).abs().amax(-1)
    s_div = torch.where(data.outer_scale == 0, 1.0, data.outer_scale)
    if data.outer_scale.dim():
        s_div = s_div[..., None]
    raw = (blocks / E2M1_MAX) / s_div
    # beyond fp32 rounding: the amax block itself lands on 448 by construction
    saturated = ((raw > E4M3_MAX * (1 + 2**-16)) | ((raw < 2.0**-6) & (blocks > 0))).float().mean().item()
    exps, counts = torch.unique(torch.floor(torch.log2(scale)).to(torch.int64), return_counts=True)
    return {
        "sqnr_db": sqnr,
        "flushed_to_zero": flushed,
        "saturated_blocks": saturated,
        "scale_histogram": dict(zip(exps.tolist(), counts.tolist())),
        "amax": _item(R.amax(ref, kwargs.get("scaling", "per_tensor"))),
        "outer_scale": _item(data.outer_scale),
    }


def _item(t: torch.Tensor):
    return t.item() if t.dim() == 0 else t


def _quantize_kwargs(spec, role: str) -> Dict[str, object]:
    if spec is None:
        return {}
    if isinstance(spec, dict):
        return dict(spec)
    if isinstance(spec, NVFP4Recipe):
        op: OperandSpec = spec.operand(role)
        return {"block": op.block, "scaling": op.scaling, "rounding": op.rounding,
                "rht_signs": spec.signs() if op.rht else None}
    raise TypeError(f"tensor_stats takes an NVFP4Recipe, a dict of quantize options or None, "
                    f"got {type(spec).__name__}")

