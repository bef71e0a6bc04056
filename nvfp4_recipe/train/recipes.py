"""The recipes ``nvfp4-recipe train`` compares (their table is ``config.RECIPES``), applied to a
model: ``quantize_(model, NVFP4Recipe(...))``.
"""

import logging

from torch import nn

from ..api import quantize_
from ..layer import NVFP4Module
from ..linear import NVFP4Linear
from ..moe import experts_modules
from ..recipe import NVFP4Recipe
from .config import KEEP_HIGH_PRECISION, RECIPES, check_recipes


def make_recipe(name: str, seed: int, backend: str):
    """The :class:`NVFP4Recipe` of recipe ``name``, or None for the baseline, on ``backend``;
    where ``backend`` is "auto", on the recipe's own where its table entry names one (a recipe
    only the reference backend runs: ``nvfp4-quartet2``).

    Raises:
        ValueError: ``name`` is unknown.
    """
    check_recipes([name])
    if RECIPES[name] is None:
        return None
    fields = dict(RECIPES[name])
    own = fields.pop("backend", None)
    if own is not None and backend == "auto":
        backend = own
    return NVFP4Recipe(keep_bf16=KEEP_HIGH_PRECISION, seed=seed, backend=backend, **fields)


def apply_recipe(model: nn.Module, name: str, seed: int, backend: str,
                 quiet: bool = False) -> nn.Module:
    """Swap the eligible linears of ``model`` in place for NVFP4 ones (nothing for the baseline),
    exactly as a user would: ``quantize_(model, NVFP4Recipe(...))``; with ``quiet``, its log lines
    below ERROR are dropped (a check on a meta-device copy). Returns ``model``."""
    recipe = make_recipe(name, seed, backend)
    if recipe is None:
        return model
    log = logging.getLogger("nvfp4_recipe")
    level = log.level
    if quiet:
        log.setLevel(logging.ERROR)
    try:
        quantize_(model, recipe)
    finally:
        log.setLevel(level)
    return model


def quantized_fraction(model: nn.Module) -> str:
    """'k/n linears in NVFP4' for a model after :func:`apply_recipe`, with
    'and e/m experts layers' when it has mixture-of-experts layers."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    quantized = [m for m in linears if isinstance(m, NVFP4Linear)]
    text = f"{len(quantized)}/{len(linears)} linears"
    experts = list(experts_modules(model).values())
    if experts:
        n_fp4 = sum(isinstance(m, NVFP4Module) for m in experts)
        text += f" and {n_fp4}/{len(experts)} experts layers"
    return text + " in NVFP4"
