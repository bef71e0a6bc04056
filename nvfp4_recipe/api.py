"""``quantize_(model, NVFP4Recipe())``: swap nn.Linear layers for NVFP4Linear, in place, and the
mixture-of-experts modules ``moe`` knows for their NVFP4 versions.

:func:`quantize_` here applies the recipe's layer filter (fully qualified name patterns, first/last
layers, feature counts not multiples of 16), logs every skipped layer by name and gives each layer
its own SR stream, derived from its name. The swap is also registered with torchao's
``quantize_``, whose handler is called with a module and the recipe only (torchao 0.18: no name,
no model): through that entry point a recipe that needs the layer names (``keep_bf16``,
``keep_first_last``, ``stochastic_rounding``) raises a ValueError that points here.
"""

import fnmatch
import logging
import zlib
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from torchao.quantization.transform_module import register_quantize_module_handler

from . import moe
from .backends import get_backend
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
        if n <= 0 or n % BLOCK:
            return f"{name}={n} is not a positive multiple of {BLOCK}"
    return None


def _check_backend(recipe: NVFP4Recipe, device: torch.device) -> None:
    """Raises ValueError when ``recipe.backend`` cannot run on ``device`` (a meta device is only
    checked at the first forward, once the model is materialized)."""
    if device.type != "meta":
        get_backend(recipe.backend.value, device)


def _check_same_recipe(fqn: str, layer: nn.Module, recipe: NVFP4Recipe) -> None:
    if layer.recipe != recipe:
        raise ValueError(
            f"quantize_: layer {fqn or '(the model)'!r} is already in NVFP4 ({type(layer).__name__}) "
            f"under another recipe "
            f"({layer.recipe}); to re-configure, call nvfp4_recipe.dequantize_(model) first, then "
            f"quantize_(model, new_recipe) (this restarts the SR streams)")


# Fields whose effect needs each layer's name or the whole model, which torchao's quantize_ does
# not pass to its handler; the message says why.
_NEEDS_NAMES = {
    "keep_bf16": "its patterns match layer names",
    "keep_first_last": "it needs the order of the model's linear layers",
    "stochastic_rounding": "each layer's SR stream is derived from the layer's name",
}


@register_quantize_module_handler(NVFP4Recipe)
def _torchao_handler(module: nn.Module, recipe: NVFP4Recipe) -> nn.Module:
    """torchao's ``quantize_`` handler: an nn.Linear becomes an NVFP4Linear (layer seed 0).

    Raises:
        ValueError: a recipe field that needs layer names is set (use :func:`quantize_`); the
            module is an NVFP4Linear under another recipe; the backend cannot run on its device.
    """
    for name, why in _NEEDS_NAMES.items():
        if getattr(recipe, name):
            raise ValueError(
                f"torchao.quantization.quantize_ cannot apply NVFP4Recipe.{name}={getattr(recipe, name)!r}: "
                f"{why}, and torchao passes its handler neither the name nor the model; call "
                f"nvfp4_recipe.quantize_(model, recipe) instead (it takes the same arguments)")
    if isinstance(module, NVFP4Linear):
        _check_same_recipe("", module, recipe)
        return module
    if not isinstance(module, nn.Linear):
        return module
    problem = _shape_problem(module)
    if problem is not None:
        log.info("nvfp4: keeping an nn.Linear(%d, %d) in high precision: %s (torchao's quantize_ "
                 "passes no layer names; nvfp4_recipe.quantize_ logs them)",
                 module.in_features, module.out_features, problem)
        return module
    _check_backend(recipe, module.weight.device)
    return NVFP4Linear.from_linear(module, recipe)


def _linears(model: nn.Module) -> Dict[str, nn.Linear]:
    """fqn -> module of every nn.Linear (NVFP4Linear included) in ``model``, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def skip_reasons(model: nn.Module, recipe: NVFP4Recipe) -> Dict[str, str]:
    """For each nn.Linear and each experts module (``moe.experts_modules``) that ``quantize_``
    would leave in high precision: fqn -> the reason.

    The first/last ``recipe.keep_first_last`` layers are counted among all linear layers, NVFP4Linear
    ones included, so a second ``quantize_`` with the same recipe selects the same layers. The
    routers of MoE layers stay in high precision (``moe.router_ids``).
    """
    linears = _linears(model)
    names: List[str] = list(linears)
    n = recipe.keep_first_last
    edge = set(names[:n] + names[len(names) - n:]) if n else set()
    out_projs = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    routers = moe.router_ids(model)
    reasons = moe.experts_skip_reasons(model, recipe)
    for fqn, module in linears.items():
        if isinstance(module, NVFP4Linear):
            continue
        pattern = next((p for p in recipe.keep_bf16 if fnmatch.fnmatchcase(fqn, p)), None)
        if pattern is not None:
            reasons[fqn] = f"matches keep_bf16 pattern {pattern!r}"
        elif fqn in edge:
            reasons[fqn] = f"among the first/last {n} linear layers (keep_first_last)"
        elif id(module) in out_projs:
            reasons[fqn] = "out_proj of an nn.MultiheadAttention, which uses its weight, not its forward"
        elif id(module) in routers:
            reasons[fqn] = "the router of an MoE layer (routing stays in high precision)"
        else:
            problem = _shape_problem(module)
            if problem is not None:
                reasons[fqn] = problem
    return reasons


def quantize_(model: nn.Module, recipe: Optional[NVFP4Recipe] = None,
              filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Swap the model's eligible nn.Linear layers for NVFP4Linear in place; returns the model.

    Eligible: an nn.Linear whose in/out features are positive multiples of 16, whose fully
    qualified name matches none of ``recipe.keep_bf16`` and that is not among the first/last
    ``recipe.keep_first_last`` linear layers nor an MoE router, and (if given) for which
    ``filter_fn(module, fqn)`` is True; and likewise each experts module ``moe`` knows
    (torchtitan's ``GroupedExperts``, Hugging Face's batched experts; ``moe.register_experts``),
    which becomes an ``moe.NVFP4Experts``. Each skipped layer is logged at INFO with its name and
    reason (see :func:`skip_reasons`). The weight and bias Parameters are kept (an optimizer built before the
    swap still updates them); each layer gets its own SR stream from ``recipe.seed`` and its name.

    ``model`` may itself be an nn.Linear: it cannot be swapped in place, so the NVFP4Linear is
    returned; use the return value (``layer = quantize_(layer)``), as with torchao's ``quantize_``.

    Calling ``quantize_`` again with the same recipe changes no layer already converted (their SR
    state included); with another recipe it raises: ``dequantize_`` the model first.

    Raises:
        TypeError: ``recipe`` is not an NVFP4Recipe.
        ValueError: the model has NVFP4Linear layers under another recipe; ``recipe.backend``
            cannot run on the device of a layer to convert. Nothing is swapped then.
    """
    recipe = NVFP4Recipe() if recipe is None else recipe
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"quantize_ takes an NVFP4Recipe, got {type(recipe).__name__}")
    layers = {**_linears(model), **moe.experts_modules(model)}
    for fqn, module in layers.items():
        if isinstance(module, (NVFP4Linear, moe.NVFP4Experts)):
            _check_same_recipe(fqn, module, recipe)
    skipped = skip_reasons(model, recipe)
    for fqn, why in skipped.items():
        log.info("nvfp4: keeping %s in high precision: %s", fqn or "(the model)", why)
    targets = {fqn: m for fqn, m in layers.items()
               if not isinstance(m, (NVFP4Linear, moe.NVFP4Experts)) and fqn not in skipped
               and (filter_fn is None or filter_fn(m, fqn))}
    for device in {next(m.parameters()).device for m in targets.values()}:
        _check_backend(recipe, device)
    swapped = {id(m): NVFP4Linear.from_linear(m, recipe, _layer_seed(fqn)) if isinstance(m, nn.Linear)
               else moe.convert_experts(m, recipe, _layer_seed(fqn)) for fqn, m in targets.items()}
    if id(model) in swapped:
        return swapped[id(model)]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in swapped:  # every place a shared module appears gets the same layer
                setattr(parent, name, swapped[id(child)])
    return model


def dequantize_(model: nn.Module) -> nn.Module:
    """Swap every NVFP4Linear back to a plain nn.Linear and every NVFP4 experts module back to the
    module it was made from (same Parameters), in place; returns the model (the high-precision
    module when ``model`` is itself an NVFP4 one)."""
    if isinstance(model, (NVFP4Linear, moe.NVFP4Experts)):
        return _high_precision(model)
    for name, child in list(model.named_children()):
        if isinstance(child, (NVFP4Linear, moe.NVFP4Experts)):
            setattr(model, name, _high_precision(child))
        else:
            dequantize_(child)
    return model


def _high_precision(layer: nn.Module) -> nn.Module:
    return layer.to_linear() if isinstance(layer, NVFP4Linear) else layer.high_precision()
