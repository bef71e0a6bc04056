"""``quantize_(model, NVFP4Recipe())``: swap nn.Linear layers for NVFP4Linear, in place.

The swap is registered with torchao's ``quantize_`` (so ``torchao.quantization.quantize_`` takes an
NVFP4Recipe too); :func:`quantize_` here adds the recipe's layer filter (fully qualified name
patterns, first/last layers, feature counts not multiples of 16) and logs every skipped layer.
"""

import fnmatch
import logging
import zlib
from typing import Callable, Dict, List, Optional

from torch import nn
from torchao.quantization import quantize_ as _torchao_quantize_
from torchao.quantization.transform_module import register_quantize_module_handler

from .formats import BLOCK
from .linear import NVFP4Linear
from .recipe import NVFP4Recipe

log = logging.getLogger("nvfp4_recipe")

__all__ = ["quantize_", "skip_reasons", "dequantize_"]


def _layer_seed(fqn: str) -> int:
    """A per-layer SR stream key derived from the module's name, the same in every process."""
    return zlib.crc32(fqn.encode())


def _shape_problem(module: nn.Linear) -> Optional[str]:
    for name in ("in_features", "out_features"):
        n = getattr(module, name)
        if n % BLOCK:
            return f"{name}={n} is not a multiple of {BLOCK}"
    return None


@register_quantize_module_handler(NVFP4Recipe)
def _swap_linear(module: nn.Module, recipe: NVFP4Recipe) -> nn.Module:
    """torchao handler: an nn.Linear becomes an NVFP4Linear; an unsuitable one is kept and logged."""
    if not isinstance(module, nn.Linear) or isinstance(module, NVFP4Linear):
        return module
    problem = _shape_problem(module)
    if problem is not None:
        log.info("nvfp4: keeping %s in high precision: %s", module, problem)
        return module
    return NVFP4Linear.from_linear(module, recipe)


def skip_reasons(model: nn.Module, recipe: NVFP4Recipe) -> Dict[str, str]:
    """For each nn.Linear that ``quantize_`` would leave in high precision: fqn -> the reason."""
    linears: List[str] = [n for n, m in model.named_modules()
                          if isinstance(m, nn.Linear) and not isinstance(m, NVFP4Linear)]
    edge = set(linears[:recipe.keep_first_last] + linears[len(linears) - recipe.keep_first_last:]
               if recipe.keep_first_last else [])
    modules = dict(model.named_modules())
    reasons = {}
    for fqn in linears:
        pattern = next((p for p in recipe.keep_bf16 if fnmatch.fnmatchcase(fqn, p)), None)
        if pattern is not None:
            reasons[fqn] = f"matches keep_bf16 pattern {pattern!r}"
        elif fqn in edge:
            reasons[fqn] = f"among the first/last {recipe.keep_first_last} linear layers (keep_first_last)"
        else:
            problem = _shape_problem(modules[fqn])
            if problem is not None:
                reasons[fqn] = problem
    return reasons


def quantize_(model: nn.Module, recipe: Optional[NVFP4Recipe] = None,
              filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Swap the model's eligible nn.Linear layers for NVFP4Linear in place; returns ``model``.

    Eligible: an nn.Linear whose in/out features are multiples of 16, whose fully qualified name
    matches none of ``recipe.keep_bf16`` and that is not among the first/last
    ``recipe.keep_first_last`` linear layers, and (if given) for which ``filter_fn(module, fqn)``
    is True. Each skipped layer is logged at INFO with its reason (see :func:`skip_reasons`). The
    weight and bias Parameters are kept (an optimizer built before the swap still updates them);
    each layer gets its own SR stream from ``recipe.seed`` and its name.

    Raises:
        TypeError: ``recipe`` is not an NVFP4Recipe.
    """
    recipe = NVFP4Recipe() if recipe is None else recipe
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"quantize_ takes an NVFP4Recipe, got {type(recipe).__name__}")
    skipped = skip_reasons(model, recipe)
    for fqn, why in skipped.items():
        log.info("nvfp4: keeping %s in high precision: %s", fqn, why)

    def eligible(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and not isinstance(module, NVFP4Linear)
                and fqn not in skipped and (filter_fn is None or filter_fn(module, fqn)))

    _torchao_quantize_(model, recipe, filter_fn=eligible)
    for fqn, module in model.named_modules():
        if isinstance(module, NVFP4Linear):
            module.sr_seed.fill_((recipe.seed + _layer_seed(fqn)) & 0xFFFFFFFF)
    return model


def dequantize_(model: nn.Module) -> nn.Module:
    """Swap every NVFP4Linear back to a plain nn.Linear (same Parameters), in place."""
    for name, child in list(model.named_children()):
        if isinstance(child, NVFP4Linear):
            setattr(model, name, child.to_linear())
        else:
            dequantize_(child)
    return model

