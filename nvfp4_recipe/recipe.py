"""NVFP4Recipe: which NVFP4 techniques a training linear uses, and how each GEMM operand is quantized.

Defaults follow NVIDIA's NVFP4 pretraining recipe (NVIDIA, "Pretraining Large Language Models with
NVFP4", arXiv 2509.25149): 2D 16x16 weight blocks, RHT on the wgrad operands, stochastic rounding on
gradients, per-tensor outer scales. ``docs/recipe.md`` describes every field.
"""

import enum
import functools
import math
import numbers
from dataclasses import Field, dataclass, field, fields, make_dataclass
from typing import Annotated, Any, Literal, Optional, Tuple, Union, get_args, get_origin

import torch
from . import _torchao  # noqa: F401  (imports torchao quietly, before the line below)
from torchao.core.config import AOBaseConfig
from typing_extensions import Doc

from .formats import BLOCK, FLT_MAX
from .reference import DEFAULT_RHT_SIGNS
from .spec import (FOUR_OVER_SIX_DEFAULT_E4M3_MAX, FOUR_OVER_SIX_E4M3_MAX,
                   MS_EDEN_DEFAULT_ROTATION, MS_EDEN_ROTATIONS, BackendName, BackwardEstimator,
                   Block, FourOverSix, FourOverSixError, FourOverSixOperands, GemmRole, MSEden,
                   Override, QuantSpec, Rounding, Scaling, enum_values, parse_enum)

# SR stream offsets of the two gradient operands: disjoint Philox counter ranges for any tensor of
# fewer than 2**35 elements (16 elements per counter).
SR_OFFSETS = {GemmRole.DY_DGRAD: 0, GemmRole.DY_WGRAD: 2**31}
# An MS-EDEN backward's counters (backward_estimator="ms_eden"), under the step's SR key: the
# block-scale draws of its four operands (one counter per block of 16: disjoint ranges for any
# operand of fewer than 2**34 elements), by role (W_FPROP: dgrad's W^T, quantized again from W),
# and the one counter of the rotation's signs.
MS_EDEN_OFFSETS = {GemmRole.DY_DGRAD: 0, GemmRole.W_FPROP: 2**30, GemmRole.DY_WGRAD: 2**31,
                   GemmRole.X_WGRAD: 3 * 2**30}
ROTATION_SIGNS_OFFSET = 2**32 - 1
# The operands an MS-EDEN backward quantizes: all of the backward's (W^T under DY_DGRAD's spec)
_MS_EDEN_ROLES = (GemmRole.DY_DGRAD, GemmRole.DY_WGRAD, GemmRole.X_WGRAD)

# The operands each ``four_over_six`` setting quantizes with 4/6 (W^T is W's exact transpose).
_FOUR_OVER_SIX_ROLES = {
    FourOverSixOperands.WEIGHTS: (GemmRole.W_FPROP,),
    FourOverSixOperands.ACTIVATIONS: (GemmRole.W_FPROP, GemmRole.X_FPROP, GemmRole.X_WGRAD),
    FourOverSixOperands.ALL: tuple(GemmRole),
}


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"NVFP4Recipe.{name}: {msg}")


def _is_number(x) -> bool:
    """A real number that is not a bool (True == 1 would pass for a sign, a seed or a count)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_fp32_scale(x) -> bool:
    """A number that float32 holds as a finite value > 0: 1e40 is finite in Python but inf in
    float32, 1e-50 is 0 there."""
    return _is_number(x) and 0 < x < FLT_MAX and torch.tensor(float(x), dtype=torch.float32).item() > 0


def parse_signs(value, name: str) -> Tuple[int, ...]:
    """RHT signs given as any sequence or 1-D tensor of 16 values +1/-1, as a tuple of ints.

    Raises:
        ValueError: ``"{name}: ..."`` for another length, another value or a bool.
    """
    values = value.tolist() if isinstance(value, torch.Tensor) else value
    try:
        signs = tuple(values)
    except TypeError:
        signs = ()
    if len(signs) != BLOCK or not all(_is_number(s) and s in (1, -1) for s in signs):
        raise ValueError(f"{name}: must be {BLOCK} values of +1/-1, got {value!r}")
    return tuple(int(s) for s in signs)


def _parse_amax_estimation(value) -> Tuple[float, float]:
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_fp32_scale(s) for s in value)
    _check(ok, "amax_estimation", f"must be None or two scales (act_scale, grad_scale), each positive and "
           f"finite in float32 (0 < scale < {FLT_MAX:.7g}, not 0 when rounded to float32), got {value!r}")
    return tuple(float(s) for s in value)


def _parse_patterns(value) -> Tuple[str, ...]:
    patterns = (value,) if isinstance(value, str) else value
    _check(isinstance(patterns, (tuple, list)) and all(isinstance(p, str) for p in patterns),
           "keep_bf16", f"must be a tuple of fnmatch patterns (str), () for none, got {value!r}")
    return tuple(patterns)


def _field(default, help: str) -> Any:
    """A recipe field with its one-line help (the help of the generated config options)."""
    return field(default=default, metadata={"help": help})


def _plain(value):
    """An enum field's value as its string; any other value unchanged."""
    return value.value if isinstance(value, enum.Enum) else value


@dataclass(frozen=True)
class NVFP4Recipe(AOBaseConfig):
    """Configuration of NVFP4 training for ``quantize_``: a frozen value, equal to and hashing as
    any recipe with the same fields. Change one with ``dataclasses.replace(recipe, field=value)``,
    which validates again; assigning a field raises ``dataclasses.FrozenInstanceError``.

    Fields (strings are accepted for the enum fields and converted; lists for the tuple fields):
        rht: apply the 16-point random Hadamard transform to both wgrad operands (dY^T and X^T).
        rht_signs: the 16 +-1 signs of the RHT (any sequence or 1-D tensor, stored as a tuple of
            16 ints); None uses TransformerEngine's and torchao's vector
            (``reference.DEFAULT_RHT_SIGNS``), shared by every layer.
        stochastic_rounding: round the gradient operands (dY for dgrad and wgrad) stochastically.
        amax_estimation: None (measure amax after the RHT) or (act_scale, grad_scale), a tuple of
            two floats: estimate the post-RHT amax of X^T / dY^T as scale * amax before the RHT,
            skipping a pass. Both scales positive and finite in float32.
        weight_2d: quantize weights in 16x16 tiles so that W (fprop) and W^T (dgrad) agree.
        scaling: a :class:`~nvfp4_recipe.spec.Scaling`, PER_TENSOR ("per_tensor") or PER_TOKEN
            ("per_token") outer scales for activations and gradients (weights keep a per-tensor
            outer scale, so W and W^T share one quantization).
        keep_bf16: fnmatch patterns of fully qualified module names left in high precision (a
            tuple or list of str, or one str; stored as a tuple).
        keep_first_last: keep the first and the last this many nn.Linear layers in high precision.
        backend: a :class:`~nvfp4_recipe.spec.BackendName`: AUTO ("auto": triton on CUDA GPUs,
            reference on CPU), REFERENCE, TRITON or NATIVE (opt-in, untested on a Blackwell GPU).
        seed: base seed of the per-layer SR streams, an int in [0, 2**31).
        four_over_six: None, or a :class:`~nvfp4_recipe.spec.FourOverSixOperands`: the operands
            quantized with 4/6 block scaling (docs/numerics.md), cumulative: WEIGHTS ("weights":
            W and W^T), ACTIVATIONS ("activations": the weights and X, X^T) or ALL ("all": also
            dY and dY^T).
        four_over_six_error: a :class:`~nvfp4_recipe.spec.FourOverSixError`, MAE ("mae") or
            MSE ("mse"): the error 4/6 picks each block's scale by.
        four_over_six_e4m3_max: 256 (the default, ``spec.FOUR_OVER_SIX_DEFAULT_E4M3_MAX``: the
            paper's, leaving the largest block's map-to-4 scale inside E4M3) or 448 (TE's
            default): the E4M3 bound of the 4/6 outer scale.
        four_over_six_fast_math: measure the 4/6 error on the scaled values (TE's fast math).
        The three four_over_six_* fields keep their defaults unless four_over_six is set.
        backward_override: None (dgrad and wgrad in NVFP4), or an :class:`~nvfp4_recipe.spec.Override`:
            HIGH_PRECISION ("high_precision": both from the unquantized X and W, saved for
            backward, in the precision of dY) or DEQUANTIZED ("dequantized": from the forward's
            NVFP4 X and W, saved as codes and dequantized in backward). TransformerEngine's
            ``backward_override``.
        forward_override: None (fprop in NVFP4) or HIGH_PRECISION ("high_precision": fprop from
            the unquantized X and W; the backward keeps its recipe), e.g. for the last steps of a
            run (NVIDIA, arXiv 2509.25149, App. D; ``nvfp4_recipe.set_recipe``).
        keep_first_blocks, keep_last_blocks: keep the first / last transformer blocks (the
            model's repeated blocks, ``blocks.repeated_blocks``) in high precision: an int count,
            or a number in (0, 1) for that fraction of the blocks, rounded up.
        backward_estimator: None (the backward as ``rht`` and ``stochastic_rounding`` say), or a
            :class:`~nvfp4_recipe.spec.BackwardEstimator`: MS_EDEN ("ms_eden": Quartet II's,
            arXiv 2601.22813): dgrad and wgrad quantize dY, dY^T and the forward's NVFP4 W^T
            and X^T (dequantized; the unquantized ones under forward_override) again with
            MS-EDEN (``spec.MSEden``): rotated along the GEMM's inner dimension by a random
            Hadamard transform drawn every backward, values rounded to nearest, block scales
            EDEN-corrected and rounded stochastically. Needs rht=False, stochastic_rounding=
            False (MS-EDEN replaces both), per-tensor scaling, no backward_override, and
            four_over_six other than "all" (4/6 then applies to the forward's operands).
        ms_eden_rotation: the MS-EDEN rotation size, 16, 32, 64 or 128 (the default, Quartet
            II's); keeps its default unless backward_estimator is set.
        shared_weight_amax: the projections serving engines fuse into one GEMM (q/k/v and
            gate/up: Hugging Face's ``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``,
            torchtitan's ``wq``/``wk``/``wv``, ``w1``/``w3``; ``fused.GROUPS``) quantize their
            weights with one per-tensor amax, the group's largest, as TransformerEngine's fused
            QKV does, so that an exported group has one global scale (docs/serving.md). Applies
            where ``quantize_`` found such a group (``fused.attach_groups``); changes Y and dX.

    Raises:
        ValueError: ``"NVFP4Recipe.<field>: ..."`` at construction (and at ``dataclasses.replace``)
            for any invalid value or combination.
    """

    rht: bool = _field(True, "random Hadamard transform on both wgrad operands")
    rht_signs: Optional[Tuple[int, ...]] = _field(
        None, "the 16 +-1 RHT signs (default: TransformerEngine's and torchao's vector)")
    stochastic_rounding: bool = _field(
        True, "stochastic rounding of the gradient operands (dY for dgrad and wgrad)")
    amax_estimation: Optional[Tuple[float, float]] = _field(
        None, "act_scale grad_scale: estimate the post-RHT amax as scale x amax before the RHT")
    weight_2d: bool = _field(
        True, "16x16 weight blocks, so that W (fprop) and W^T (dgrad) share one quantization")
    scaling: Scaling = _field(
        Scaling.PER_TENSOR, "outer scales of activations and gradients: one per tensor or one per row")
    keep_bf16: Tuple[str, ...] = _field((), "fnmatch patterns of module names kept in high precision")
    keep_first_last: int = _field(
        0, "keep the first and the last this many nn.Linear layers in high precision")
    backend: BackendName = _field(
        BackendName.AUTO, "auto: triton on CUDA GPUs, reference on the CPU (native: opt-in, untested)")
    seed: int = _field(0, "base seed of the per-layer SR streams")
    four_over_six: Optional[FourOverSixOperands] = _field(
        None, "4/6 block scaling on the weights, also the activations, or all operands")
    four_over_six_error: FourOverSixError = _field(
        FourOverSixError.MAE, "the error 4/6 picks each block's scale by")
    four_over_six_e4m3_max: int = _field(FOUR_OVER_SIX_DEFAULT_E4M3_MAX,
                                         "E4M3 bound of the 4/6 outer scale: 256 or 448")
    four_over_six_fast_math: bool = _field(
        False, "4/6 error on the scaled values (TransformerEngine's fast math)")

    backward_override: Optional[Override] = _field(
        None, "dgrad and wgrad in high precision: high_precision (unquantized X, W) or dequantized")
    forward_override: Optional[Override] = _field(
        None, "fprop in high precision (high_precision), the backward as the recipe says")
    backward_estimator: Optional[BackwardEstimator] = _field(
        None, "ms_eden: Quartet II's backward (rotated operands, EDEN-corrected scales rounded "
              "stochastically); needs rht and stochastic_rounding off")
    ms_eden_rotation: int = _field(MS_EDEN_DEFAULT_ROTATION,
                                   "the MS-EDEN rotation size: 16, 32, 64 or 128")
    keep_first_blocks: float = _field(
        0, "keep the first transformer blocks in high precision: a count or a fraction in (0, 1)")
    keep_last_blocks: float = _field(
        0, "keep the last transformer blocks in high precision: a count or a fraction in (0, 1)")
    shared_weight_amax: bool = _field(
        True, "fused projections (q/k/v, gate/up) quantize their weights with one shared amax")

    def __post_init__(self):
        for name in ("rht", "stochastic_rounding", "weight_2d", "shared_weight_amax"):
            _check(isinstance(getattr(self, name), bool), name, f"must be a bool, got {getattr(self, name)!r}")
        if self.rht_signs is not None:
            self._set("rht_signs", parse_signs(self.rht_signs, "NVFP4Recipe.rht_signs"))
            _check(self.rht, "rht_signs", "given, but rht=False")
        if self.amax_estimation is not None:
            self._set("amax_estimation", _parse_amax_estimation(self.amax_estimation))
            _check(self.rht, "amax_estimation", "estimates the post-RHT amax; it needs rht=True")
        self._set("scaling", parse_enum(Scaling, self.scaling, "NVFP4Recipe.scaling"))
        self._set("backend", parse_enum(BackendName, self.backend, "NVFP4Recipe.backend"))
        self._set("keep_bf16", _parse_patterns(self.keep_bf16))
        _check(_is_int(self.keep_first_last) and self.keep_first_last >= 0, "keep_first_last",
               f"must be an int >= 0, got {self.keep_first_last!r}")
        _check(_is_int(self.seed) and 0 <= self.seed < 2**31, "seed",
               f"must be an int in [0, 2**31), got {self.seed!r}")
        self._set("keep_first_last", int(self.keep_first_last))
        self._set("seed", int(self.seed))
        self._check_four_over_six()
        self._check_overrides()
        self._check_backward_estimator()
        for name in ("keep_first_blocks", "keep_last_blocks"):
            value = getattr(self, name)
            count = _is_number(value) and value >= 0 and float(value).is_integer()
            _check(count or _is_number(value) and 0 < value < 1, name,
                   f"must be a count >= 0 or a fraction in (0, 1), got {value!r}")
            self._set(name, int(value) if count else float(value))
        # Not a field: left out of ==, hash and replace; spec() is asked on every layer step.
        specs = {role: self._quant_spec(role) for role in GemmRole}
        # by member and by value: spec(role) is then one dict lookup, which torch.compile traces
        self._set("_specs", {**specs, **{role.value: s for role, s in specs.items()}})

    def _check_overrides(self) -> None:
        for name in ("backward_override", "forward_override"):
            if getattr(self, name) is not None:
                self._set(name, parse_enum(Override, getattr(self, name), f"NVFP4Recipe.{name}"))
        _check(self.forward_override in (None, Override.HIGH_PRECISION), "forward_override",
               f"must be None or 'high_precision', got {_plain(self.forward_override)!r}")
        _check(self.forward_override is None or self.backward_override is not Override.DEQUANTIZED,
               "backward_override", "'dequantized' needs the forward's NVFP4 operands, but "
               "forward_override='high_precision' runs fprop without them")

    def _check_backward_estimator(self) -> None:
        rotation = self.ms_eden_rotation
        _check(_is_int(rotation) and rotation in MS_EDEN_ROTATIONS, "ms_eden_rotation",
               f"must be one of {MS_EDEN_ROTATIONS}, got {rotation!r}")
        self._set("ms_eden_rotation", int(rotation))
        if self.backward_estimator is None:
            _check(rotation == MS_EDEN_DEFAULT_ROTATION, "ms_eden_rotation",
                   "given, but backward_estimator=None")
            return
        self._set("backward_estimator", parse_enum(BackwardEstimator, self.backward_estimator,
                                                   "NVFP4Recipe.backward_estimator"))
        why = "MS-EDEN (backward_estimator='ms_eden') "
        _check(not self.rht, "rht", why + "rotates the backward's operands itself; set rht=False")
        _check(not self.stochastic_rounding, "stochastic_rounding",
               why + "rounds the gradients' values to nearest and their block scales "
               "stochastically; set stochastic_rounding=False")
        _check(self.scaling is Scaling.PER_TENSOR, "scaling", why + "takes per-tensor scaling")
        _check(self.backward_override is None, "backward_override",
               why + "quantizes the backward, which backward_override takes out of NVFP4")
        _check(self.four_over_six is not FourOverSixOperands.ALL, "four_over_six",
               why + "quantizes dY and dY^T, which 'all' would put under 4/6; use 'activations'")

    def blocks_kept(self, n_blocks: int) -> Tuple[int, int]:
        """(first, last): how many of ``n_blocks`` repeated blocks stay in high precision at the
        start and at the end (``keep_first_blocks`` / ``keep_last_blocks``; fractions rounded up)."""
        def count(value):
            return min(n_blocks, value if _is_int(value) else math.ceil(value * n_blocks))
        return count(self.keep_first_blocks), count(self.keep_last_blocks)

    def _check_four_over_six(self) -> None:
        if self.four_over_six is not None:
            self._set("four_over_six", parse_enum(FourOverSixOperands, self.four_over_six,
                                                  "NVFP4Recipe.four_over_six"))
        self._set("four_over_six_error", parse_enum(FourOverSixError, self.four_over_six_error,
                                                    "NVFP4Recipe.four_over_six_error"))
        bound = self.four_over_six_e4m3_max
        _check(_is_int(bound) and bound in FOUR_OVER_SIX_E4M3_MAX, "four_over_six_e4m3_max",
               f"must be one of {FOUR_OVER_SIX_E4M3_MAX}, got {bound!r}")
        self._set("four_over_six_e4m3_max", int(bound))
        _check(isinstance(self.four_over_six_fast_math, bool), "four_over_six_fast_math",
               f"must be a bool, got {self.four_over_six_fast_math!r}")
        if self.four_over_six is None:
            for f in fields(self):
                if f.name.startswith("four_over_six_"):
                    _check(getattr(self, f.name) == f.default, f.name, "given, but four_over_six=None")

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        """Constructor syntax with the enum fields as their values (``eval`` gives the recipe back)."""
        args = ", ".join(f"{f.name}={_plain(getattr(self, f.name))!r}" for f in fields(self))
        return f"{type(self).__name__}({args})"

    def _four_over_six(self, role: GemmRole) -> Optional[FourOverSix]:
        if self.four_over_six is None or role not in _FOUR_OVER_SIX_ROLES[self.four_over_six]:
            return None
        return FourOverSix(self.four_over_six_error, self.four_over_six_e4m3_max,
                           self.four_over_six_fast_math)

    def _quant_spec(self, role: GemmRole) -> QuantSpec:
        if self.backward_estimator is BackwardEstimator.MS_EDEN and role in _MS_EDEN_ROLES:
            return QuantSpec(ms_eden=MSEden(self.ms_eden_rotation))
        fos = self._four_over_six(role)
        if role is GemmRole.W_FPROP:
            return QuantSpec(Block.D2 if self.weight_2d else Block.D1, four_over_six=fos)
        amax_scale = None
        if role.is_wgrad and self.amax_estimation is not None:
            amax_scale = self.amax_estimation[1 if role.is_gradient else 0]
        rounding = Rounding.SR if role.is_gradient and self.stochastic_rounding else Rounding.RN
        return QuantSpec(Block.D1, self.scaling, rounding, role.is_wgrad and self.rht, amax_scale,
                         fos)

    def spec(self, role: Union[GemmRole, str]) -> QuantSpec:
        """How the operand ``role`` (a GemmRole or its value, e.g. "dy_dgrad") of a linear's three
        GEMMs is quantized (the table of docs/recipe.md): weights 2d (or 1d) per-tensor RN;
        activations and gradients 1d with the recipe's scaling, SR on gradients, RHT and amax
        estimation on the wgrad operands; 4/6 on the operands ``four_over_six`` names; under
        MS-EDEN (``backward_estimator``) dY, dY^T and X^T MS-EDEN's (``QuantSpec.ms_eden``), as
        dgrad's W^T takes DY_DGRAD's. Raises ValueError for an unknown role."""
        spec = self._specs.get(role)
        if spec is None:
            raise ValueError(f"unknown operand role {role!r}; expected a GemmRole or one of "
                             f"{[r.value for r in GemmRole]}")
        return spec

    def signs(self) -> torch.Tensor:
        """The RHT signs as a (16,) float32 CPU tensor (TE's default vector when ``rht_signs`` is None)."""
        return torch.tensor(self.rht_signs or DEFAULT_RHT_SIGNS, dtype=torch.float32, device="cpu")


def _option_type(tp):
    """The type a config parser fills for a recipe field of type ``tp``: an enum becomes a Literal
    of its values and a tuple a list, also inside Optional."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return Literal[enum_values(tp)]
    if get_origin(tp) is Union:
        (inner,) = (a for a in get_args(tp) if a is not type(None))
        return Optional[_option_type(inner)]
    if get_origin(tp) is tuple:
        return list[get_args(tp)[0]]
    return tp


def _option(f: Field) -> Tuple[str, Any, Field]:
    """(name, type, field) of the config option of the recipe field ``f``, for make_dataclass."""
    if isinstance(f.default, tuple):
        default = field(default_factory=functools.partial(list, f.default), metadata=f.metadata)
    else:
        default = field(default=_plain(f.default), metadata=f.metadata)
    return f.name, Annotated[_option_type(f.type), Doc(f.metadata["help"])], default


def _options_recipe(self) -> NVFP4Recipe:
    """The NVFP4Recipe of these options. Raises ValueError naming a field with a bad value."""
    return NVFP4Recipe(**{f.name: getattr(self, f.name) for f in fields(self)})


def options_dataclass(name: str, module: str, doc: str) -> type:
    """A (mutable) dataclass of config options for :class:`NVFP4Recipe`, generated from its fields,
    for parsers that fill dataclasses from a command line or a config file (torchtitan's, tyro).

    One option per recipe field, same name, same default, in order; an enum field becomes a
    ``Literal`` of its values (default: the value), a tuple field a ``list`` (default: a new list);
    each type is ``Annotated`` with the field's one-line help as a PEP 727 ``Doc``, which tyro
    shows. The class has a ``recipe()`` method: the NVFP4Recipe of the options (ValueError naming
    the field for a bad value).

    Args:
        name: the class name; module: its ``__module__``; doc: its docstring.
    """
    return make_dataclass(name, [_option(f) for f in fields(NVFP4Recipe)], namespace={
        "recipe": _options_recipe, "__module__": module, "__doc__": doc})
