"""NVFP4Recipe: validation, and every flag changes exactly the numbers it claims to change."""

import dataclasses
import logging
import math
import typing

import pytest
import torch

from nvfp4_recipe import NVFP4Linear, NVFP4Recipe
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.recipe import options_dataclass
from nvfp4_recipe.reference import DEFAULT_RHT_SIGNS
from nvfp4_recipe.spec import (BackendName, Block, FourOverSix, FourOverSixError, FourOverSixOperands,
                               GemmRole, QuantSpec, Rounding, Scaling)


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
    (dict(amax_estimation=(1e40, 1.0)), "amax_estimation"),  # finite in Python, inf in float32
    (dict(amax_estimation=(2.0, torch.finfo(torch.float32).max)), "amax_estimation"),
    (dict(amax_estimation=(2.0, 1e-50)), "amax_estimation"),  # 0 in float32
    (dict(amax_estimation=(2.0, 10**400)), "amax_estimation"),  # too large for a Python float
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


def test_amax_estimation_takes_any_positive_float32_scale():
    assert NVFP4Recipe(amax_estimation=(3e38, 1e-40)).amax_estimation == (3e38, 1e-40)  # 1e-40: subnormal


@pytest.mark.parametrize("scale", [1e40, 3.5e38, 1e-50, 2.0**-150])  # inf or 0 in float32
@pytest.mark.parametrize("position", [0, 1])
def test_amax_estimation_refuses_scales_float32_cannot_hold(scale, position):
    pair = [2.0, 1.0]
    pair[position] = scale
    assert math.isfinite(scale) and scale > 0  # a positive finite Python float
    with pytest.raises(ValueError, match="NVFP4Recipe.amax_estimation: .*finite in float32"):
        NVFP4Recipe(amax_estimation=tuple(pair))
    fp32 = torch.tensor(scale, dtype=torch.float32).item()
    assert fp32 == 0 or math.isinf(fp32)


def test_amax_estimation_takes_the_extreme_float32_scales():
    below_max = torch.nextafter(torch.tensor(torch.finfo(torch.float32).max), torch.tensor(0.0)).item()
    smallest = 2.0**-149  # the smallest float32 subnormal
    assert NVFP4Recipe(amax_estimation=(below_max, smallest)).amax_estimation == (below_max, smallest)


def test_defaults_are_the_nvidia_recipe():
    r = NVFP4Recipe()
    assert (r.rht, r.stochastic_rounding, r.weight_2d, r.scaling, r.amax_estimation) == (
        True, True, True, Scaling.PER_TENSOR, None)
    assert r.backend is BackendName.AUTO and r.keep_bf16 == () and (r.keep_first_last, r.seed) == (0, 0)
    assert r.spec(GemmRole.W_FPROP) == QuantSpec(Block.D2)
    assert r.spec(GemmRole.DY_DGRAD) == QuantSpec(rounding=Rounding.SR)
    assert r.spec(GemmRole.DY_WGRAD) == QuantSpec(rounding=Rounding.SR, rht=True)
    assert r.spec(GemmRole.X_WGRAD) == QuantSpec(rht=True)
    assert r.spec(GemmRole.X_FPROP) == QuantSpec()
    assert r.spec("dy_dgrad") == r.spec(GemmRole.DY_DGRAD)  # roles by name too
    assert r.rht_signs is None and r.signs().tolist() == list(DEFAULT_RHT_SIGNS)  # TE's vector


def test_enum_fields_hold_enums_and_print_as_their_values():
    r = NVFP4Recipe(scaling="per_token", backend="triton")
    assert r.scaling is Scaling.PER_TOKEN and r.backend is BackendName.TRITON
    assert r == NVFP4Recipe(scaling=Scaling.PER_TOKEN, backend=BackendName.TRITON)
    assert (f"{r.scaling}", str(r.backend)) == ("per_token", "triton")
    assert "scaling='per_token'" in repr(r) and "backend='triton'" in repr(r)
    assert eval(repr(r), {"NVFP4Recipe": NVFP4Recipe}) == r


def test_recipe_is_frozen():
    r = NVFP4Recipe()
    for name, value in (("scaling", "bogus"), ("seed", 3), ("keep_bf16", ("lm_head",))):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(r, name, value)
    assert r == NVFP4Recipe()


def test_replace_validates_and_respecifies():
    r = dataclasses.replace(NVFP4Recipe(), scaling="per_token")
    assert r.scaling is Scaling.PER_TOKEN and NVFP4Recipe().scaling is Scaling.PER_TENSOR
    assert r.spec(GemmRole.X_FPROP) == QuantSpec(scaling=Scaling.PER_TOKEN)  # not the default's spec
    with pytest.raises(ValueError, match="NVFP4Recipe.scaling: must be one of"):
        dataclasses.replace(r, scaling="bogus")
    with pytest.raises(ValueError, match="NVFP4Recipe.amax_estimation"):
        dataclasses.replace(NVFP4Recipe(amax_estimation=(2.0, 1.0)), rht=False)
    with pytest.raises(ValueError, match="NVFP4Recipe.backend"):
        dataclasses.replace(r, backend="cuda")


def test_equal_and_hashed_by_value():
    a, b = NVFP4Recipe(keep_bf16=["lm_head"], amax_estimation=[2, 1]), NVFP4Recipe(
        keep_bf16="lm_head", amax_estimation=(2.0, 1.0))
    assert a == b and hash(a) == hash(b) and a is not b
    assert NVFP4Recipe() == NVFP4Recipe() and NVFP4Recipe(seed=1) != NVFP4Recipe()
    assert NVFP4Recipe(scaling="per_token") != NVFP4Recipe()
    table = {NVFP4Recipe(): "default", a: "estimated"}
    assert table[NVFP4Recipe(scaling="per_tensor")] == "default" and table[b] == "estimated"
    assert len({NVFP4Recipe(), NVFP4Recipe(seed=1), NVFP4Recipe(seed=0)}) == 2


def test_options_are_generated_from_the_recipe_fields():
    Options = options_dataclass("Options", __name__, "options")
    assert [f.name for f in dataclasses.fields(Options)] == [f.name for f in dataclasses.fields(NVFP4Recipe)]
    assert dataclasses.asdict(Options()) == {
        "rht": True, "rht_signs": None, "stochastic_rounding": True, "amax_estimation": None,
        "weight_2d": True, "scaling": "per_tensor", "keep_bf16": [], "keep_first_last": 0,
        "backend": "auto", "seed": 0, "four_over_six": None, "four_over_six_error": "mae",
        "four_over_six_e4m3_max": 256, "four_over_six_fast_math": False, "backward_override": None,
        "forward_override": None, "backward_estimator": None, "ms_eden_rotation": 128,
        "keep_first_blocks": 0, "keep_last_blocks": 0, "shared_weight_amax": True}
    assert type(Options().scaling) is str and Options().keep_bf16 is not Options().keep_bf16
    hints = typing.get_type_hints(Options, include_extras=True)
    types = {name: typing.get_args(hint)[0] for name, hint in hints.items()}  # Annotated[type, Doc]
    assert typing.get_args(types["scaling"]) == ("per_tensor", "per_token")
    assert typing.get_args(types["backend"]) == ("auto", "reference", "triton", "native")
    assert types["four_over_six"] == typing.Optional[typing.Literal["weights", "activations", "all"]]
    assert types["backward_override"] == typing.Optional[typing.Literal["high_precision", "dequantized"]]
    assert types["keep_last_blocks"] is float
    assert (types["keep_bf16"], types["rht_signs"], types["amax_estimation"], types["seed"]) == (
        list[str], typing.Optional[list[int]], typing.Optional[list[float]], int)
    helps = {name: typing.get_args(hint)[1].documentation for name, hint in hints.items()}
    assert helps == {f.name: f.metadata["help"] for f in dataclasses.fields(NVFP4Recipe)}
    assert all(helps.values())


@pytest.mark.parametrize("operands,roles", [
    ("weights", {"w_fprop"}), ("activations", {"w_fprop", "x_fprop", "x_wgrad"}),
    ("all", {r.value for r in GemmRole})])
def test_four_over_six_reaches_the_specs_of_its_operands(operands, roles):
    r = NVFP4Recipe(four_over_six=operands, four_over_six_error="mse", four_over_six_e4m3_max=448,
                    four_over_six_fast_math=True)
    assert r.four_over_six is FourOverSixOperands(operands)
    want = FourOverSix(FourOverSixError.MSE, 448, True)
    for role in GemmRole:
        spec = r.spec(role)
        assert spec.four_over_six == (want if role.value in roles else None)
        # the other fields are the recipe's without 4/6
        assert dataclasses.replace(spec, four_over_six=None) == NVFP4Recipe().spec(role)
    assert NVFP4Recipe(four_over_six="all").spec("x_fprop").four_over_six == FourOverSix("mae", 256)


@pytest.mark.parametrize("kwargs,field", [
    (dict(four_over_six="acts"), "four_over_six"),
    (dict(four_over_six="all", four_over_six_error="l1"), "four_over_six_error"),
    (dict(four_over_six="all", four_over_six_e4m3_max=300), "four_over_six_e4m3_max"),
    (dict(four_over_six="all", four_over_six_e4m3_max=True), "four_over_six_e4m3_max"),
    (dict(four_over_six="all", four_over_six_fast_math=1), "four_over_six_fast_math"),
    (dict(four_over_six_error="mse"), "four_over_six_error"),
    (dict(four_over_six_e4m3_max=448), "four_over_six_e4m3_max"),
    (dict(four_over_six_fast_math=True), "four_over_six_fast_math")])
def test_four_over_six_fields_are_validated(kwargs, field):
    with pytest.raises(ValueError, match=f"NVFP4Recipe.{field}:"):
        NVFP4Recipe(**kwargs)


def test_four_over_six_spec_is_validated():
    with pytest.raises(ValueError, match="e4m3_max"):
        FourOverSix(e4m3_max=512)
    with pytest.raises(ValueError, match="error"):
        FourOverSix(error="max")
    with pytest.raises(ValueError, match="four_over_six"):
        QuantSpec(four_over_six="mae")


def test_options_build_the_recipe():
    Options = options_dataclass("Options", __name__, "options")
    assert Options().recipe() == NVFP4Recipe()
    options = Options(scaling="per_token", keep_bf16=["lm_head"], amax_estimation=[2, 1], backend="reference")
    assert options.recipe() == NVFP4Recipe(scaling=Scaling.PER_TOKEN, keep_bf16=("lm_head",),
                                           amax_estimation=(2.0, 1.0), backend=BackendName.REFERENCE)
    with pytest.raises(ValueError, match="NVFP4Recipe.scaling"):
        Options(scaling="bogus").recipe()


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
    "four_over_six": (dict(four_over_six="weights"), (True, True, False)),  # W and W^T
    "four_over_six_activations": (dict(four_over_six="activations"), (True, True, True)),  # X^T: dW
    "four_over_six_all": (dict(four_over_six="all"), (True, True, True)),
    "backward_override": (dict(backward_override="high_precision"), (False, True, True)),
    "backward_override_dequantized": (dict(backward_override="dequantized"), (False, True, True)),
    "forward_override": (dict(forward_override="high_precision"), (True, False, False)),
}  # keep_first_blocks / keep_last_blocks choose layers: tests/test_recipe_changes.py


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


# four_over_six_fast_math only rounds the error differently: tests/test_four_over_six.py shows it
@pytest.mark.parametrize("kwargs", [dict(four_over_six_error="mse"), dict(four_over_six_e4m3_max=448)],
                         ids=lambda k: next(iter(k)))
def test_each_four_over_six_setting_changes_y_dx_and_dw(kwargs):
    base, other = run(NVFP4Recipe(four_over_six="all")), run(NVFP4Recipe(four_over_six="all", **kwargs))
    for name, a, b in zip(("y", "dx", "dw"), base, other):
        assert not torch.equal(a, b), f"{kwargs} did not change {name}"
