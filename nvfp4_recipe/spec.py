"""How one GEMM operand is quantized: a frozen, typed spec, the form a quantized operand holds, the
five operand roles of a linear, and the names of the backends that run them.

A leaf module (no package imports): the recipe builds specs, the layer hands them to a backend, the
backend to the kernels, unchanged. The enums take their user-facing strings as values, so
``Block("2d")`` parses what ``NVFP4Tensor.from_hp(block="2d")`` accepts, and they print as those
strings. Sources: NVIDIA's NVFP4 recipe (arXiv 2509.25149, section 4); the per-operand quantizers
of TransformerEngine (``NVFP4Quantizer``) and float8_experimental's ``GemmInputRole``.
"""

import enum
import math
from dataclasses import dataclass, is_dataclass
from typing import Optional, Tuple, Type, TypeVar

E = TypeVar("E", bound=enum.Enum)


class _StrEnum(str, enum.Enum):
    """A str-valued enum that equals its value and prints as it: ``str()`` and f-strings of
    Scaling.PER_TOKEN give "per_token" on every Python (for a plain ``(str, Enum)``, str() gives
    "Scaling.PER_TOKEN", and f-strings do too from Python 3.11)."""

    __str__ = str.__str__
    __format__ = str.__format__


def enum_values(kind: Type[enum.Enum]) -> Tuple[str, ...]:
    """The values of the enum ``kind``, in declaration order (e.g. argparse choices)."""
    return tuple(m.value for m in kind)


def parse_enum(kind: Type[E], value, name: str) -> E:
    """``value`` (a member of ``kind`` or its value) as a member of the enum ``kind``.

    Raises:
        ValueError: ``"{name}: must be one of (...), got ..."`` for any other value.
    """
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}: must be one of {enum_values(kind)}, got {value!r}") from None


class Block(_StrEnum):
    """Block shape of the E4M3 scales: 1x16 along K, or 16x16 tiles (2-D weights)."""

    D1 = "1d"
    D2 = "2d"


class Form(_StrEnum):
    """What an operand holds (``NVFP4Operand.form``): packed E2M1 codes with their E4M3 block
    scales, or the float16 inner values (codes times block scales, exact) a quantize kernel wrote
    for a GEMM that uses them at once."""

    CODES = "codes"
    VALUES = "values"


class Scaling(_StrEnum):
    """Outer scale: one per tensor, or one per row of the operand as it enters its GEMM."""

    PER_TENSOR = "per_tensor"
    PER_TOKEN = "per_token"


class Rounding(_StrEnum):
    """E2M1 rounding: round to nearest even, or stochastic (8 random bits per element)."""

    RN = "rn"
    SR = "sr"


class Override(_StrEnum):
    """GEMMs a recipe takes out of NVFP4 (TransformerEngine's ``backward_override``): in the
    precision of their inputs from the unquantized tensors, or from the forward's dequantized
    NVFP4 operands (backward only)."""

    HIGH_PRECISION = "high_precision"
    DEQUANTIZED = "dequantized"


class FourOverSixError(_StrEnum):
    """The error by which 4/6 picks a block's scale: sum of absolute or of squared errors."""

    MAE = "mae"
    MSE = "mse"


class FourOverSixOperands(_StrEnum):
    """The operands of a linear that a recipe quantizes with 4/6: the weight (W and its
    transpose), also the activations (X, X^T), or all (also dY and dY^T)."""

    WEIGHTS = "weights"
    ACTIVATIONS = "activations"
    ALL = "all"


# The E4M3 bounds the 4/6 outer scale may map the amax to (TE's ``nvfp4_e4m3_max``): 448 as
# without 4/6, or 256, which leaves the 1.5x map-to-4 scale of the largest block unclipped.
FOUR_OVER_SIX_E4M3_MAX = (256, 448)
# The one default bound (FourOverSix, NVFP4Recipe.four_over_six_e4m3_max, NVFP4Tensor.from_hp): 256,
# the Four Over Six paper's (arXiv 2512.02010): with 448 the largest block's map-to-4 scale
# (1.5 x 448 = 672) clips at 448, so that block can only map to 6; with 256 it is 384, inside E4M3.
# TE's ``nvfp4_e4m3_max`` defaults to 448; pass 448 to match it.
FOUR_OVER_SIX_DEFAULT_E4M3_MAX = 256


@dataclass(frozen=True)
class FourOverSix:
    """4/6 adaptive block scaling of one operand (docs/numerics.md; TransformerEngine's
    ``NVFP4QuantizerRef(nvfp4_use_4over6=True)``, arXiv 2512.02010): each block's scale maps its
    amax to 6 or to 4, whichever quantizes it (RN) with the smaller error.

    Fields:
        error: FourOverSixError.MAE ("mae") or MSE ("mse"), summed over a block's elements.
        e4m3_max: 256 (the default, FOUR_OVER_SIX_DEFAULT_E4M3_MAX: the paper's) or 448 (TE's
            default), the E4M3 bound of the outer scale: S_enc = 6 * e4m3_max / amax.
        fast_math: measure the error on the scaled values (candidate x E4M3 scale against
            x * S_enc, TE's ``nvfp4_4over6_err_use_fast_math``) rather than in x's domain.

    Raises:
        ValueError: an unknown error mode, another bound, a fast_math that is not a bool.
    """

    error: FourOverSixError = FourOverSixError.MAE
    e4m3_max: int = FOUR_OVER_SIX_DEFAULT_E4M3_MAX
    fast_math: bool = False

    def __post_init__(self):
        object.__setattr__(self, "error", parse_enum(FourOverSixError, self.error, "error"))
        if isinstance(self.e4m3_max, bool) or self.e4m3_max not in FOUR_OVER_SIX_E4M3_MAX:
            raise ValueError(f"e4m3_max: must be one of {FOUR_OVER_SIX_E4M3_MAX}, got {self.e4m3_max!r}")
        object.__setattr__(self, "e4m3_max", int(self.e4m3_max))
        if not isinstance(self.fast_math, bool):
            raise ValueError(f"fast_math: must be a bool, got {self.fast_math!r}")


class BackwardEstimator(_StrEnum):
    """How a recipe's backward (dgrad, wgrad) quantizes its operands in place of the per-operand
    RHT and SR fields: MS_EDEN, Quartet II's (arXiv 2601.22813; :class:`MSEden`)."""

    MS_EDEN = "ms_eden"


# The MS-EDEN rotation sizes (MSEden.rotation, NVFP4Recipe.ms_eden_rotation): powers of two up to
# Quartet II's 128, whose signs one Philox call gives (128 bits, ``reference.rotation_signs``).
MS_EDEN_ROTATIONS = (16, 32, 64, 128)
MS_EDEN_DEFAULT_ROTATION = 128  # Quartet II's (its kernels' and its training scripts')


@dataclass(frozen=True)
class MSEden:
    """MS-EDEN quantization of one backward operand (docs/recipe.md, "MS-EDEN"; Quartet II, arXiv
    2601.22813, IST-DASLab/Quartet-II ``src/models/quantization/schemes/quartet_2.py``): rotated
    along K by a random Hadamard transform of ``rotation`` points, its values rounded to nearest
    and each block scale multiplied by its rotation group's EDEN correction and then rounded
    stochastically between its two neighbouring E4M3 values, so that the operand is unbiased.

    Fields:
        rotation: the rotation size, one of MS_EDEN_ROTATIONS (default 128, Quartet II's), also
            the group the EDEN correction is taken over; along a K that is not a multiple of it,
            the largest power of two that divides K (``reference.rotation_size``).

    Raises:
        ValueError: another rotation size.
    """

    rotation: int = MS_EDEN_DEFAULT_ROTATION

    def __post_init__(self):
        if isinstance(self.rotation, bool) or self.rotation not in MS_EDEN_ROTATIONS:
            raise ValueError(f"rotation: must be one of {MS_EDEN_ROTATIONS}, got {self.rotation!r}")
        object.__setattr__(self, "rotation", int(self.rotation))


class BackendName(_StrEnum):
    """The implementation NVFP4 GEMMs run on: AUTO picks NATIVE on sm100+, TRITON on other CUDA
    GPUs, REFERENCE (plain PyTorch, the numerics spec) elsewhere."""

    AUTO = "auto"
    REFERENCE = "reference"
    TRITON = "triton"
    NATIVE = "native"


class GemmRole(enum.Enum):
    """The five quantized operands of one training linear (docs/recipe.md)::

        fprop  Y  = X W^T      X_FPROP (A)    W_FPROP (B; dgrad takes its exact transpose)
        dgrad  dX = dY W       DY_DGRAD (A)
        wgrad  dW = dY^T X     DY_WGRAD (A)   X_WGRAD (B)   (blocks along tokens)
    """

    X_FPROP = "x_fprop"
    W_FPROP = "w_fprop"
    DY_DGRAD = "dy_dgrad"
    DY_WGRAD = "dy_wgrad"
    X_WGRAD = "x_wgrad"

    @property
    def is_gradient(self) -> bool:
        return self in (GemmRole.DY_DGRAD, GemmRole.DY_WGRAD)

    @property
    def is_wgrad(self) -> bool:
        return self in (GemmRole.DY_WGRAD, GemmRole.X_WGRAD)


@dataclass(frozen=True)
class QuantSpec:
    """The quantization of one operand (docs/numerics.md).

    Fields:
        block: Block.D1 (blocks of 16 along K) or Block.D2 (16x16 tiles; per-tensor only).
        scaling: Scaling.PER_TENSOR or Scaling.PER_TOKEN.
        rounding: Rounding.RN or Rounding.SR.
        rht: quantize the 16-point random Hadamard transform of the operand along K.
        amax_scale: None (measure the amax of what is quantized) or the factor applied to the
            amax of the untransformed operand instead (amax estimation, spec item 8).
        four_over_six: None, or the :class:`FourOverSix` block scaling (spec item 11).
        ms_eden: None, or the :class:`MSEden` quantization (docs/recipe.md), which brings its own
            rotation, rounding and scales: 1d blocks, per-tensor, RN, no RHT, amax scale or 4/6.
    Strings are accepted for the enum fields and converted.

    Raises:
        ValueError: an unknown enum value, 2d blocks with per-token scaling, an amax_scale
            that is not a finite positive number, a four_over_six that is not a FourOverSix, an
            ms_eden that is not an MSEden or comes with another of the fields it excludes.
    """

    block: Block = Block.D1
    scaling: Scaling = Scaling.PER_TENSOR
    rounding: Rounding = Rounding.RN
    rht: bool = False
    amax_scale: Optional[float] = None
    four_over_six: Optional[FourOverSix] = None
    ms_eden: Optional[MSEden] = None

    def __post_init__(self):
        for name, kind in (("block", Block), ("scaling", Scaling), ("rounding", Rounding)):
            object.__setattr__(self, name, parse_enum(kind, getattr(self, name), name))
        if self.block is Block.D2 and self.scaling is Scaling.PER_TOKEN:
            raise ValueError("2d blocks take a per-tensor outer scale; per_token scaling needs 1d blocks")
        if self.amax_scale is not None and not (math.isfinite(self.amax_scale) and self.amax_scale > 0):
            raise ValueError(f"amax_scale must be None or a finite positive number, got {self.amax_scale!r}")
        if self.four_over_six is not None and not isinstance(self.four_over_six, FourOverSix):
            raise ValueError(f"four_over_six must be None or a FourOverSix, got {self.four_over_six!r}")
        if self.ms_eden is not None:
            self._check_ms_eden()

    def _check_ms_eden(self) -> None:
        if not isinstance(self.ms_eden, MSEden):
            raise ValueError(f"ms_eden must be None or an MSEden, got {self.ms_eden!r}")
        excluded = [name for name, off in (
            ("block", self.block is Block.D1), ("scaling", self.scaling is Scaling.PER_TENSOR),
            ("rounding", self.rounding is Rounding.RN), ("rht", not self.rht),
            ("amax_scale", self.amax_scale is None), ("four_over_six", self.four_over_six is None))
            if not off]
        if excluded:
            raise ValueError(f"ms_eden brings its own rotation, rounding and scales (1d blocks, "
                             f"per_tensor, rn); it takes no {', '.join(excluded)} of another value")

    @property
    def sr(self) -> bool:
        return self.rounding is Rounding.SR

    @property
    def per_token(self) -> bool:
        return self.scaling is Scaling.PER_TOKEN


def _types_defined_here() -> Tuple[type, ...]:
    """Every enum with members and every dataclass this module defines, in definition order."""
    return tuple(v for v in list(globals().values())
                 if isinstance(v, type) and v.__module__ == __name__
                 and (is_dataclass(v) or (issubclass(v, enum.Enum) and len(v) > 0)))


# What specs and the backends' typed arguments are made of: the operator boundary
# (backends/operators.py) encodes and decodes exactly these, and torch.load(weights_only=True)
# accepts them in an NVFP4Tensor. Derived, so an enum or dataclass added above is in it.
SPEC_TYPES = _types_defined_here()
