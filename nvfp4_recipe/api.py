"""``quantize_(model, NVFP4Recipe())``: swap nn.Linear layers for NVFP4Linear (and transformers'
``Conv1D`` for NVFP4Conv1D), in place, and the mixture-of-experts modules ``moe`` knows for their
NVFP4 versions.

:func:`quantize_` here applies the recipe's layer filter (fully qualified name patterns, first/last
layers, feature counts not multiples of 16, dtypes), says in one log line which modules it kept in
high precision and why (a WARNING when any is) and gives each layer its own SR stream, derived
from its name. The swap is also registered with torchao's
``quantize_``, whose handler is called with a module and the recipe only (torchao 0.18: no name,
no model): through that entry point a recipe that needs the layer names (``keep_bf16``,
``keep_first_last``, ``keep_first_blocks``, ``keep_last_blocks``, ``stochastic_rounding``) raises a
ValueError that points here. :func:`set_recipe` changes the recipe of a quantized model in place.
"""

import dataclasses
import difflib
import fnmatch
import logging
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from . import _torchao  # noqa: F401  (imports torchao quietly, before the line below)
from torchao.quantization.transform_module import register_quantize_module_handler

from . import moe
from .backends import get_backend
from .blocks import repeated_blocks
from .conv1d import NVFP4Conv1D, features, is_conv1d
from .frozen import NVFP4FrozenLinear
from .fused import attach_groups
from .layer import NVFP4Module, layer_seed, size_problem
from .linear import NVFP4Linear
from .recipe import NVFP4Recipe
from .spec import GemmRole

log = logging.getLogger("nvfp4_recipe")

__all__ = ["quantize_", "skip_reasons", "dequantize_", "linear_layers", "frozen_layers", "nvfp4_counts",
           "check_module"]


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _dtype_problem(module: nn.Module) -> Optional[str]:
    dtype = next((p.dtype for p in module.parameters(recurse=False)
                  if p.is_floating_point() and p.dtype not in _DTYPES), None)
    if dtype is None:
        return None
    return f"{str(dtype).replace('torch.', '')} parameters (NVFP4 layers take bfloat16, float16 or " \
           f"float32)"


def _layer_problem(module: nn.Module) -> Optional[str]:
    """Why a linear layer cannot run in NVFP4 (None if it can)."""
    return (size_problem(dict(zip(("in_features", "out_features"), features(module))))
            or _dtype_problem(module))


def check_module(caller: str, model: object) -> None:
    """Raises TypeError, naming ``caller``, when ``model`` is not an nn.Module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller} takes an nn.Module as model, got {type(model).__name__}")


def _check_backend(recipe: NVFP4Recipe, device: torch.device) -> None:
    """Raises ValueError when ``recipe.backend`` cannot run on ``device`` or cannot run one of the
    recipe's specs (``Backend.check_spec``: MS-EDEN off the reference backend). A meta device is
    only checked at the first forward (the specs at the first backward), once the model is
    materialized."""
    if device.type != "meta":
        backend = get_backend(recipe.backend.value, device)
        for role in GemmRole:
            backend.check_spec(recipe.spec(role))


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
    "keep_first_blocks": "it needs the model's blocks",
    "keep_last_blocks": "it needs the model's blocks",
    "stochastic_rounding": "each layer's SR stream is derived from the layer's name",
    "backward_estimator": "each layer's MS-EDEN stream is derived from the layer's name",
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
    problem = _layer_problem(module)
    if problem is not None:
        log.info("nvfp4: keeping an nn.Linear(%d, %d) in high precision: %s (torchao's quantize_ "
                 "passes no layer names; nvfp4_recipe.quantize_ logs them)",
                 module.in_features, module.out_features, problem)
        return module
    _check_backend(recipe, module.weight.device)
    return NVFP4Linear.from_module(module, recipe)


def linear_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """fqn -> module of every linear layer of ``model`` in module order: nn.Linear (NVFP4Linear
    and NVFP4Conv1D included) and transformers' ``Conv1D`` (:func:`conv1d.is_conv1d`)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}


# module types whose forward multiplies by their weights, which quantize_ does not convert
_MATMUL_MODULES = (nn.MultiheadAttention, nn.modules.conv._ConvNd, nn.Bilinear)


def _other_weights(model: nn.Module, layers: Dict[str, nn.Module]) -> Dict[str, str]:
    """fqn -> why, for the modules other than ``layers`` whose weights feed a matmul that
    quantize_ does not convert: nn.MultiheadAttention's in_proj, convolutions, nn.Bilinear, and
    modules holding 3-D parameters (experts of a layout ``moe`` does not know). Parameters such as
    a positional embedding held by a model are not matmul weights and are not listed."""
    known = {id(m) for m in layers.values()}
    reasons = {}
    for fqn, m in model.named_modules():
        if id(m) in known or isinstance(m, NVFP4Module):
            continue
        big = [name for name, p in m.named_parameters(recurse=False)
               if (p.dim() >= 2 and isinstance(m, _MATMUL_MODULES)) or p.dim() == 3]
        if big:
            reasons[fqn] = f"{type(m).__name__} holding {', '.join(big)}: a layer type quantize_ " \
                           f"does not convert"
    return reasons


def _kept_blocks(model: nn.Module, recipe: NVFP4Recipe) -> Dict[str, str]:
    """{block fqn: why} for the first/last blocks ``recipe.keep_first_blocks`` /
    ``keep_last_blocks`` keep in high precision (``blocks.repeated_blocks``).

    Raises:
        ValueError: they are set and the model has no repeated blocks.
    """
    if not (recipe.keep_first_blocks or recipe.keep_last_blocks):
        return {}
    try:
        blocks = [fqn for fqn, _ in repeated_blocks(model)]
    except ValueError as e:
        raise ValueError(f"NVFP4Recipe.keep_first_blocks / keep_last_blocks: {e}") from None
    first, last = recipe.blocks_kept(len(blocks))
    kept = {fqn: f"in block {fqn}, one of the last {last} of {len(blocks)} blocks (keep_last_blocks)"
            for fqn in blocks[len(blocks) - last:]}
    kept.update({fqn: f"in block {fqn}, one of the first {first} of {len(blocks)} blocks "
                      f"(keep_first_blocks)" for fqn in blocks[:first]})
    return kept


def _in_block(fqn: str, blocks: Dict[str, str]) -> Optional[str]:
    return next((why for block, why in blocks.items() if fqn.startswith(block + ".")), None)


def _kept_by_pattern(recipe: NVFP4Recipe, fqn: str) -> Optional[str]:
    """Why ``recipe.keep_bf16`` keeps module ``fqn`` in high precision: the first pattern that
    matches the name (``fnmatch.fnmatchcase``), or None."""
    pattern = next((p for p in recipe.keep_bf16 if fnmatch.fnmatchcase(fqn, p)), None)
    return None if pattern is None else f"matches keep_bf16 pattern {pattern!r}"


def skip_reasons(model: nn.Module, recipe: NVFP4Recipe,
                 filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> Dict[str, str]:
    """fqn -> the reason, for each module that ``quantize_(model, recipe, filter_fn)`` would leave
    in high precision: linear layers (:func:`linear_layers`) and experts modules
    (``moe.experts_modules``) it cannot or may not convert, and the other modules that hold
    matmul-sized weights of a type it does not convert (e.g. nn.MultiheadAttention's
    ``in_proj_weight``, convolutions). The fqn of ``model`` itself is "".

    The first/last ``recipe.keep_first_last`` layers are counted among all linear layers, NVFP4
    ones included, so a second ``quantize_`` with the same recipe selects the same layers. The
    first/last ``keep_first_blocks`` / ``keep_last_blocks`` transformer blocks
    (``blocks.repeated_blocks``) keep every layer inside them. The routers of MoE layers stay in
    high precision (``moe.router_ids``).

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: the recipe keeps first/last blocks and the model has no repeated blocks.
    """
    check_module("skip_reasons", model)
    linears = linear_layers(model)
    names: List[str] = list(linears)
    n = recipe.keep_first_last
    edge = set(names[:n] + names[len(names) - n:]) if n else set()
    out_projs = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    routers = moe.router_ids(model)
    experts = moe.experts_modules(model)
    blocks = _kept_blocks(model, recipe)
    reasons = {}
    for fqn, module in experts.items():
        if isinstance(module, NVFP4Module):
            continue
        problem = (_kept_by_pattern(recipe, fqn) or moe.experts_problem(module)
                   or _in_block(fqn, blocks) or _dtype_problem(module))
        if problem is not None:
            reasons[fqn] = problem
    for fqn, module in linears.items():
        if isinstance(module, NVFP4Linear):
            continue
        if (pattern := _kept_by_pattern(recipe, fqn)) is not None:
            reasons[fqn] = pattern
        elif fqn in edge:
            reasons[fqn] = f"among the first/last {n} linear layers (keep_first_last)"
        elif (block := _in_block(fqn, blocks)) is not None:
            reasons[fqn] = block
        elif id(module) in out_projs:
            reasons[fqn] = "out_proj of an nn.MultiheadAttention, which uses its weight, not its forward"
        elif id(module) in routers:
            reasons[fqn] = "the router of an MoE layer (routing stays in high precision)"
        elif (problem := _layer_problem(module)) is not None:
            reasons[fqn] = problem
    if filter_fn is not None:
        for fqn, module in {**linears, **experts}.items():
            if not (fqn in reasons or isinstance(module, NVFP4Module) or filter_fn(module, fqn)):
                reasons[fqn] = "filter_fn returned False"
    reasons.update(_other_weights(model, {**linears, **experts}))
    return reasons


def frozen_layers(model: nn.Module) -> Dict[str, NVFP4FrozenLinear]:
    """fqn -> layer of every frozen NVFP4 linear (``load_frozen``) of ``model``, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, NVFP4FrozenLinear)}


def nvfp4_counts(model: nn.Module) -> str:
    """"k of n linear layers [and i of j experts modules] in NVFP4[ (f frozen)]" for ``model``,
    the frozen NVFP4 linears counted among the linear layers."""
    linears, experts = linear_layers(model).values(), moe.experts_modules(model).values()
    frozen = len(frozen_layers(model))
    text = (f"{sum(isinstance(m, NVFP4Linear) for m in linears) + frozen} of "
            f"{len(linears) + frozen} linear layers")
    if experts:
        text += f" and {sum(isinstance(m, moe.NVFP4Experts) for m in experts)} of {len(experts)} " \
                f"experts modules"
    return text + " in NVFP4" + (f" ({frozen} frozen)" if frozen else "")


def _unmatched_patterns(recipe: NVFP4Recipe, names: List[str]) -> None:
    """Warn about each keep_bf16 pattern that matches none of ``names`` (the layers it was meant
    to keep would silently run in NVFP4)."""
    for pattern in recipe.keep_bf16:
        if not fnmatch.filter(names, pattern):
            near = difflib.get_close_matches(pattern, names, n=3)
            log.warning("quantize_: keep_bf16 pattern %r matches no layer, so it keeps nothing in "
                        "high precision%s", pattern,
                        f" (closest layer names: {', '.join(near)})" if near else "")


def _report(model: nn.Module, kept: Dict[str, str]) -> None:
    """One log line for a quantize_ call: the layers in NVFP4 and those kept in high precision,
    with why; a WARNING when a layer is kept or nothing is in NVFP4 (else INFO)."""
    counts = nvfp4_counts(model)
    text = f"quantize_: {counts}"
    if kept:
        text += "; kept in high precision: " + ", ".join(
            f"{fqn or '(the model)'} ({why})" for fqn, why in kept.items())
    nothing = not any(isinstance(m, NVFP4Module) for m in model.modules())
    log.log(logging.WARNING if kept or nothing else logging.INFO, text)


def _convert(module: nn.Module, recipe: NVFP4Recipe, fqn: str) -> nn.Module:
    seed = layer_seed(fqn)
    if is_conv1d(module):
        return NVFP4Conv1D.from_module(module, recipe, seed)
    if isinstance(module, nn.Linear):
        return NVFP4Linear.from_module(module, recipe, seed)
    return moe.convert_experts(module, recipe, seed)


def quantize_(model: nn.Module, recipe: Optional[NVFP4Recipe] = None,
              filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Swap the model's eligible linear layers for NVFP4 ones in place; returns the model.

    Eligible: an nn.Linear (becomes an NVFP4Linear) or a transformers ``Conv1D`` (GPT-2's
    projections; becomes an :class:`conv1d.NVFP4Conv1D`, its (in, out) weight unchanged) with
    bfloat16, float16 or float32 parameters, whose in/out features are positive multiples of 16,
    whose fully qualified name matches none of ``recipe.keep_bf16`` and that is not among the
    first/last ``recipe.keep_first_last`` linear layers nor an MoE router, and (if given) for
    which ``filter_fn(module, fqn)`` is True; and likewise each experts module ``moe`` knows
    (torchtitan's ``GroupedExperts``, Hugging Face's batched experts; ``moe.register_experts``),
    which becomes an ``moe.NVFP4Experts``. The weight and bias Parameters are kept (an optimizer
    built before the swap still updates them); each layer gets its own SR stream from
    ``recipe.seed`` and its name. The NVFP4Linear layers of each fused projection group (q/k/v,
    gate/up: ``fused.GROUPS``) get the group (``fused.attach_groups``), whose shared weight amax
    they use while ``recipe.shared_weight_amax`` is on.

    It logs one line: how many layers are in NVFP4 and each module kept in high precision with
    why (see :func:`skip_reasons`), at WARNING when a module is kept or nothing is in NVFP4, at
    INFO otherwise; and a WARNING for each ``keep_bf16`` pattern that matches no layer. The
    reasons stay on the returned module as ``nvfp4_kept`` ({fqn: reason}), which ``summary``
    shows.

    ``model`` may itself be an nn.Linear: it cannot be swapped in place, so the NVFP4Linear is
    returned; use the return value (``layer = quantize_(layer)``), as with torchao's ``quantize_``.

    Calling ``quantize_`` again with the same recipe changes no layer already converted (their SR
    state included); with another recipe it raises: ``dequantize_`` the model first.

    Raises:
        TypeError: ``model`` is not an nn.Module; ``recipe`` is not an NVFP4Recipe; ``filter_fn``
            is not callable.
        ValueError: the model has NVFP4 layers under another recipe; ``recipe.backend``
            cannot run on the device of a layer to convert. Nothing is swapped then.
    """
    check_module("quantize_", model)
    recipe = NVFP4Recipe() if recipe is None else recipe
    if not isinstance(recipe, NVFP4Recipe):
        raise TypeError(f"quantize_ takes an NVFP4Recipe, got {type(recipe).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"quantize_: filter_fn must be None or a callable (module, fqn) -> bool, "
                        f"got {type(filter_fn).__name__}")
    layers = {**linear_layers(model), **moe.experts_modules(model)}
    for fqn, module in layers.items():
        if isinstance(module, NVFP4Module):
            _check_same_recipe(fqn, module, recipe)
    kept = skip_reasons(model, recipe, filter_fn)
    targets = {fqn: m for fqn, m in layers.items()
               if not isinstance(m, NVFP4Module) and fqn not in kept}
    for device in {next(m.parameters()).device for m in targets.values()}:
        _check_backend(recipe, device)
    _unmatched_patterns(recipe, list(layers))
    swapped = {id(m): _convert(m, recipe, fqn) for fqn, m in targets.items()}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in swapped:  # every place a shared module appears gets the same layer
                setattr(parent, name, swapped[id(child)])
    model = swapped.get(id(model), model)
    model.nvfp4_kept = kept
    groups = attach_groups(model)
    if groups and recipe.shared_weight_amax:
        log.info("quantize_: %d fused projection groups (q/k/v, gate/up) share a weight amax "
                 "(NVFP4Recipe.shared_weight_amax)", groups)
    _report(model, kept)
    return model


# Fields set_recipe leaves alone: which layers are quantized, and what the SR and RHT buffers hold.
_FIXED = {"keep_bf16": "which layers are in NVFP4", "keep_first_last": "which layers are in NVFP4",
          "keep_first_blocks": "which layers are in NVFP4", "keep_last_blocks": "which layers are in NVFP4",
          "seed": "the layers' SR streams", "rht_signs": "the layers' RHT sign buffers"}


def _four_over_six_reset(changes: dict) -> dict:
    """``changes`` with the ``four_over_six_*`` fields it does not give back at their defaults when
    it switches 4/6 off (``four_over_six=None``): they only mean something with 4/6 on."""
    if "four_over_six" not in changes or changes["four_over_six"] is not None:
        return changes
    defaults = {f.name: f.default for f in dataclasses.fields(NVFP4Recipe)
                if f.name.startswith("four_over_six_")}
    return {**defaults, **changes}


def set_recipe(model: nn.Module, **changes) -> nn.Module:
    """Change fields of the recipe of every NVFP4 module of ``model`` in place
    (``dataclasses.replace`` of each module's recipe); returns the model. The SR streams go on
    where they are (``sr_step`` is kept), the Parameters and optimizer state are untouched, and
    the weights :func:`cached_weights` kept are dropped. E.g. fprop in bf16 for the last tenth of
    the steps (NVIDIA, arXiv 2509.25149, App. D)::

        if step == int(0.9 * steps):
            nvfp4_recipe.set_recipe(model, forward_override="high_precision")

    A compiled model recompiles at its next call; a captured CUDA graph must be captured again.

    Raises:
        TypeError: ``model`` is not an nn.Module, or a change names no NVFP4Recipe field.
        ValueError: the model has no NVFP4 module; a change to a field fixed at ``quantize_``
            (layer selection, ``seed``, ``rht_signs``: ``dequantize_`` and ``quantize_`` again,
            which restarts the SR streams); an invalid value (as NVFP4Recipe); a recipe a module
            cannot run (``NVFP4Module.check_recipe``: a frozen NVFP4 base and the overrides), or a
            backend that cannot run on a module's device (checked as ``quantize_`` does). No
            module is changed then. ``four_over_six=None`` puts the other 4/6 fields back to
            their defaults unless they are given too.
    """
    check_module("set_recipe", model)
    names = {f.name for f in dataclasses.fields(NVFP4Recipe)}
    for name in changes:
        if name not in names:
            raise TypeError(f"set_recipe: NVFP4Recipe has no field {name!r}")
        if name in _FIXED:
            raise ValueError(f"set_recipe cannot change {name}: it sets {_FIXED[name]} at quantize_; "
                             f"call dequantize_(model), then quantize_(model, new_recipe)")
    layers = [m for m in model.modules() if isinstance(m, NVFP4Module)]
    if not layers:
        raise ValueError("set_recipe: the model has no NVFP4 module; call quantize_ first")
    recipes = [dataclasses.replace(m.recipe, **_four_over_six_reset(changes)) for m in layers]
    for layer, recipe in zip(layers, recipes):
        layer.check_recipe(recipe)
        for t in layer.buffers(recurse=False):
            _check_backend(recipe, t.device)
    for layer, recipe in zip(layers, recipes):
        layer.recipe = recipe
        layer._weight_cache = {}
    return model


def dequantize_(model: nn.Module) -> nn.Module:
    """Swap every NVFP4 module back to its high-precision module (``NVFP4Module.dequantize``), in
    place: an NVFP4Linear to a plain nn.Linear and an NVFP4Conv1D or NVFP4 experts module to the
    module it was made from, holding the same Parameters; an NVFP4FrozenLinear to an nn.Linear
    holding its weight dequantized. Returns the model (the high-precision module when ``model``
    is itself an NVFP4 one).

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: an NVFP4 experts module built directly, not converted from one.
    """
    check_module("dequantize_", model)
    model.__dict__.pop("nvfp4_kept", None)
    if isinstance(model, NVFP4Module):
        return model.dequantize()
    for name, child in list(model.named_children()):
        if isinstance(child, NVFP4Module):
            setattr(model, name, child.dequantize())
        else:
            dequantize_(child)
    return model
