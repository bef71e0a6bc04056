"""The recipes ``nvfp4-recipe train`` compares: the high-precision baseline and NVFP4 variants.

Every NVFP4 recipe keeps the embedding (not an nn.Linear) and the output projection ``lm_head`` in
high precision, as NVFP4 pretraining recipes do (and, in MoE models, the routers: ``quantize_``'s
default); the variants each change one field of the default :class:`NVFP4Recipe` (an ablation).
"""

from typing import Dict, Optional, Sequence

from torch import nn

from ..api import quantize_
from ..layer import NVFP4Module
from ..linear import NVFP4Linear
from ..moe import experts_modules
from ..recipe import NVFP4Recipe

BASELINE = "bf16"
KEEP_HIGH_PRECISION = ("lm_head",)

# name -> NVFP4Recipe fields changed from the default (None: the high-precision baseline).
RECIPES: Dict[str, Optional[dict]] = {
    BASELINE: None,
    "nvfp4": {},
    "nvfp4-no-rht": {"rht": False},
    "nvfp4-no-sr": {"stochastic_rounding": False},
    "nvfp4-1d-weights": {"weight_2d": False},
    "nvfp4-per-token": {"scaling": "per_token"},
    "nvfp4-amax-est": {"amax_estimation": (2.0, 1.0)},
}

DESCRIPTIONS = {
    BASELINE: "the baseline: no quantize_, every linear in the --precision dtype (bf16 autocast)",
    "nvfp4": "the default NVFP4 recipe: 2D weights, RHT on wgrad, SR on gradients, per-tensor scales",
    "nvfp4-no-rht": "nvfp4 without the random Hadamard transform (rht=False)",
    "nvfp4-no-sr": "nvfp4 with round-to-nearest gradients (stochastic_rounding=False)",
    "nvfp4-1d-weights": "nvfp4 with 1x16 weight blocks (weight_2d=False)",
    "nvfp4-per-token": "nvfp4 with per-token outer scales (scaling='per_token')",
    "nvfp4-amax-est": "nvfp4 with the post-RHT amax estimated (amax_estimation=(2.0, 1.0))",
}


def check_recipes(names: Sequence[str]) -> None:
    """Raises ValueError for an unknown or repeated recipe name, listing the valid ones."""
    for name in names:
        if name not in RECIPES:
            raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a recipe is listed twice in {list(names)}")


def make_recipe(name: str, seed: int, backend: str):
    """The :class:`NVFP4Recipe` of recipe ``name``, or None for the baseline.

    Raises:
        ValueError: ``name`` is unknown.
    """
    check_recipes([name])
    fields = RECIPES[name]
    if fields is None:
        return None
    return NVFP4Recipe(keep_bf16=KEEP_HIGH_PRECISION, seed=seed, backend=backend, **fields)


def apply_recipe(model: nn.Module, name: str, seed: int, backend: str) -> nn.Module:
    """Swap the eligible linears of ``model`` in place for NVFP4 ones (nothing for the baseline),
    exactly as a user would: ``quantize_(model, NVFP4Recipe(...))``. Returns ``model``."""
    recipe = make_recipe(name, seed, backend)
    if recipe is not None:
        quantize_(model, recipe)
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
