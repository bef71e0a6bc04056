"""The GEMMs of one call of an NVFP4 training layer, for every layout: in training the autograd
Function (``gemms.GemmsFn``: fprop now, dgrad and wgrad in its backward), otherwise fprop only
(``gemms.fprop``: any token count, nothing quantized for a backward), with W's fprop operand
taken from the layer's ``layer.cached_weights`` cache where it has one."""

from typing import Callable, Optional, Tuple

import torch

from . import gemms, quantizers
from .backends import resolved
from .layer import autocast_off, training
from .operand import NVFP4Operand
from .recipe import NVFP4Recipe

__all__ = ["forward_gemms"]


# forward_gemms' cache: make (quantizes W for fprop) -> W's fprop operand, or None
Cache = Callable[[Callable[[], NVFP4Operand]], Optional[NVFP4Operand]]


def forward_gemms(layout, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                  recipe: NVFP4Recipe, signs: torch.Tensor,
                  sr: Tuple[torch.Tensor, torch.Tensor, int], backend: str, y_dtype: torch.dtype,
                  *, cache: Optional[Cache] = None,
                  weight_amax: Optional[Callable[[], Optional[torch.Tensor]]] = None,
                  ) -> torch.Tensor:
    """``Y = X @ W^T + bias`` per group of ``layout`` with NVFP4 GEMMs, autocast off: the autograd
    Function where the call records autograd (:func:`layer.training`), else fprop only.

    Args:
        layout: ``gemms.Dense`` (x (M, K), w (N, K), bias (N,) or None) or ``gemms.Grouped``
            (x (T, K) sorted by group, w (G, N, K), no bias).
        recipe, signs: the layer's recipe and (16,) float32 RHT signs.
        sr: (sr_seed, sr_step, sr_rank) of the call's SR stream
            (``layer.NVFP4Module.sr_state``); the backward advances sr_step.
        backend: a resolved backend name; y_dtype: Y's dtype.
        cache: None, or ``cache(make)``: W's fprop operand as the layer keeps it inside
            ``layer.cached_weights`` (``layer.NVFP4Module.cached_operand``, made by ``make`` when
            missing), or None where the cache does not apply; asked in fprop-only calls.
        weight_amax: None, or a callable giving the fp32 0-d amax W is quantized with instead of
            its own (a fused group's, ``NVFP4Linear.shared_weight_amax``; ``layout`` a Dense),
            called only where W is quantized in this call (not for a cached W).
    Returns:
        Y of ``y_dtype``, (M, N) or (T, N) with zeros past the last group.
    """
    amax = (lambda: None) if weight_amax is None else weight_amax
    with autocast_off(x.device.type):
        if training(x, w, bias):
            if weight_amax is not None:
                layout = layout._replace(weight_amax=amax())
            return gemms.GemmsFn.apply(x, w, bias, signs, sr, recipe, backend, y_dtype, layout)
        be = resolved(backend)

        def fprop_quantizers(quantized_w: bool) -> quantizers.Quantizers:
            return quantizers.build(recipe, signs, quantizers.FPROP_ONLY, layout.shard,
                                    weight_amax=amax() if quantized_w else None)
        wq = None if cache is None else cache(
            lambda: layout.weights(be, w, fprop_quantizers(True).w)[0])
        q = fprop_quantizers(wq is None)
        return gemms.fprop(layout, be, x, w, bias, q, y_dtype, wq)[0]
