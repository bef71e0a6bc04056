"""NVFP4Recipe: validation, and every flag changes exactly the numbers it claims to change."""

import logging
import math

import pytest
import torch

from nvfp4_recipe import NVFP4Linear, NVFP4Recipe
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.reference import DEFAULT_RHT_SIGNS
from nvfp4_recipe.spec import Block, GemmRole, QuantSpec, Rounding


@pytest.mark.parametrize("kwargs, field", [
    (dict(rht="yes"), "rht"),
    (dict(rht_signs=(1, -1)), "rht_signs"),
    (dict(rht_signs=(2,) * 16), "rht_signs"),
    (dict(rht=False, rht_signs=(1,) * 16), "rht_signs"),
    (dict(amax_estimation=(2.0,)), "amax_estimation"),
    (dict(amax_estimation=(2.0, -1.0)), "amax_estimation"),
    (dict(rht=False, amax_estimation=(2.0, 1.0)), "amax_estimation"),
    (dict(scaling="per_channel"), "scaling"),
    (dict(backend="cuda"), "backend"),
    (dict(keep_first_last=-1), "keep_first_last"),
    (dict(keep_bf16=(3,)), "keep_bf16"),
    (dict(seed=-1), "seed"),
    (dict(weight_2d=1), "weight_2d"),
    (dict(keep_bf16=None), "keep_bf16"),
    (dict(keep_bf16=3), "keep_bf16"),
    (dict(amax_estimation=1.0), "amax_estimation"),
    (dict(amax_estimation=(math.inf, 1.0)), "amax_estimation"),
    (dict(amax_estimation=(2.0, math.nan)), "amax_estimation"),
    (dict(amax_estimation=(True, 1.0)), "amax_estimation"),
    (dict(seed=True), "seed"),
    (dict(seed=1.0), "seed"),
    (dict(keep_first_last=True), "keep_first_last"),
    (dict(rht_signs=(True,) * 16), "rht_signs"),
    (dict(rht_signs=torch.ones(4, 4)), "rht_signs"),
    (dict(rht_signs=torch.zeros(16)), "rht_signs"),
    (dict(rht_signs=5), "rht_signs"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"NVFP4Recipe.{field}"):
        NVFP4Recipe(**kwargs)


def test_valid_values_are_normalized():
    signs = torch.tensor([1.0, -1.0] * 8)
    r = NVFP4Recipe(rht_signs=signs, keep_bf16=["lm_head"], amax_estimation=[2, 1], seed=3)
    assert r.rht_signs == (1, -1) * 8 and all(type(s) is int for s in r.rht_signs)
    assert torch.equal(r.signs(), signs)
    assert r.keep_bf16 == ("lm_head",) and r.amax_estimation == (2.0, 1.0)
    assert r == NVFP4Recipe(rht_signs=(1, -1) * 8, keep_bf16="lm_head", amax_estimation=(2.0, 1.0), seed=3)


def test_defaults_are_the_nvidia_recipe():
    r = NVFP4Recipe()
    assert (r.rht, r.stochastic_rounding, r.weight_2d, r.scaling, r.amax_estimation) == (
        True, True, True, "per_tensor", None)
    assert r.spec(GemmRole.W_FPROP) == QuantSpec(Block.D2)
    assert r.spec(GemmRole.DY_DGRAD) == QuantSpec(rounding=Rounding.SR)
    assert r.spec(GemmRole.DY_WGRAD) == QuantSpec(rounding=Rounding.SR, rht=True)
    assert r.spec(GemmRole.X_WGRAD) == QuantSpec(rht=True)
    assert r.spec(GemmRole.X_FPROP) == QuantSpec()
    assert r.spec("dy_dgrad") == r.spec(GemmRole.DY_DGRAD)  # roles by name too
    assert r.rht_signs is None and r.signs().tolist() == list(DEFAULT_RHT_SIGNS)  # TE's vector


def run(recipe, seed=0):
    """y, dx, dw of one NVFP4Linear step on fixed inputs."""
    torch.manual_seed(seed)
    layer = NVFP4Linear(64, 32, recipe=recipe)
    x = torch.randn(64, 64, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn_like(y))
    return y.detach(), x.grad, layer.weight.grad


# flag -> which of (y, dx, dw) it must change
FLAGS = {
    "rht": (dict(rht=False), (False, False, True)),
    "rht_signs": (dict(rht_signs=(1, -1) * 8), (False, False, True)),
    "stochastic_rounding": (dict(stochastic_rounding=False), (False, True, True)),
    "weight_2d": (dict(weight_2d=False), (True, True, False)),
    "scaling": (dict(scaling="per_token"), (True, True, True)),
    "amax_estimation": (dict(amax_estimation=(2.0, 1.0)), (False, False, True)),
    "seed": (dict(seed=1), (False, True, True)),
}


@pytest.mark.parametrize("flag", list(FLAGS))
def test_each_flag_changes_what_it_claims(flag):
    kwargs, changes = FLAGS[flag]
    base, other = run(NVFP4Recipe()), run(NVFP4Recipe(**kwargs))
    for name, a, b, should_change in zip(("y", "dx", "dw"), base, other, changes):
        assert (not torch.equal(a, b)) == should_change, f"{flag} {'did not change' if should_change else 'changed'} {name}"


def test_backend_selection_and_errors(caplog):
    assert get_backend("auto", torch.device("cpu")).name == "reference"
    with pytest.raises(ValueError, match="backend 'native' cannot run here"):
        get_backend("native", torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        layer = NVFP4Linear(32, 32, recipe=NVFP4Recipe(backend="native"))
        with pytest.raises(ValueError, match="native"):
            layer(torch.randn(16, 32))
