"""NVFP4Recipe: which NVFP4 techniques a training linear uses, and how each GEMM operand is quantized.

Defaults follow NVIDIA's NVFP4 pretraining recipe (NVIDIA, "Pretraining Large Language Models with
NVFP4", arXiv 2509.25149): 2D 16x16 weight blocks, RHT on the wgrad operands, stochastic rounding on
gradients, per-tensor outer scales. ``docs/recipe.md`` describes every field.
"""

import functools
import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
from torchao.core.config import AOBaseConfig

from .formats import BLOCK
from .spec import Block, GemmRole, QuantSpec, Rounding, Scaling

BACKENDS = ("auto", "reference", "triton", "native")
# SR stream offsets of the two gradient operands: disjoint Philox counter ranges for any tensor of
# fewer than 2**35 elements (16 elements per counter).
SR_OFFSETS = {GemmRole.DY_DGRAD: 0, GemmRole.DY_WGRAD: 2**31}


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"NVFP4Recipe.{name}: {msg}")


def _is_number(x) -> bool:
    """A real number that is not a bool (True == 1 would pass for a sign, a seed or a count)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


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


@functools.lru_cache(maxsize=None)
def _spec(role: GemmRole, weight_2d: bool, scaling: str, sr: bool, rht: bool,
          amax_estimation: Optional[Tuple[float, float]]) -> QuantSpec:
    """:meth:`NVFP4Recipe.spec` of the recipe fields it reads (cached: the layer asks every step)."""
    if role is GemmRole.W_FPROP:
        return QuantSpec(Block.D2 if weight_2d else Block.D1)
    amax_scale = None
    if role.is_wgrad and amax_estimation is not None:
        amax_scale = amax_estimation[1 if role.is_gradient else 0]
    rounding = Rounding.SR if role.is_gradient and sr else Rounding.RN
    return QuantSpec(Block.D1, Scaling(scaling), rounding, role.is_wgrad and rht, amax_scale)


@dataclass
class NVFP4Recipe(AOBaseConfig):
    """Configuration of NVFP4 training for ``quantize_``.

    Fields:
        rht: apply the 16-point random Hadamard transform to both wgrad operands (dY^T and X^T).
        rht_signs: the 16 +-1 signs of the RHT (any sequence or 1-D tensor, stored as a tuple of
            ints); None uses TransformerEngine's and torchao's vector
            (``reference.DEFAULT_RHT_SIGNS``), shared by every layer.
        stochastic_rounding: round the gradient operands (dY for dgrad and wgrad) stochastically.
        amax_estimation: None (measure amax after the RHT) or (act_scale, grad_scale): estimate the
            post-RHT amax of X^T / dY^T as scale * amax before the RHT, skipping a pass. Both
            scales finite and positive.
        weight_2d: quantize weights in 16x16 tiles so that W (fprop) and W^T (dgrad) agree.
        scaling: "per_tensor" or "per_token" outer scales for activations and gradients (weights
            keep a per-tensor outer scale, so W and W^T share one quantization).
        keep_bf16: fnmatch patterns of fully qualified module names left in high precision (a
            tuple or list of str, or one str).
        keep_first_last: keep the first and the last this many nn.Linear layers in high precision.
        backend: "auto" (native on sm100+, triton on other CUDA GPUs, reference on CPU),
            "reference", "triton" or "native".
        seed: base seed of the per-layer SR streams.

    Raises:
        ValueError: at construction, naming the field, for any invalid value or combination.
    """

    rht: bool = True
    rht_signs: Optional[Tuple[int, ...]] = None
    stochastic_rounding: bool = True
    amax_estimation: Optional[Tuple[float, float]] = None
    weight_2d: bool = True
    scaling: str = "per_tensor"
    keep_bf16: Tuple[str, ...] = field(default_factory=tuple)
    keep_first_last: int = 0
    backend: str = "auto"
    seed: int = 0

    def __post_init__(self):
        for name in ("rht", "stochastic_rounding", "weight_2d"):
            _check(isinstance(getattr(self, name), bool), name, f"must be a bool, got {getattr(self, name)!r}")
        if self.rht_signs is not None:
            self.rht_signs = parse_signs(self.rht_signs, "NVFP4Recipe.rht_signs")
            _check(self.rht, "rht_signs", "given, but rht=False")
        if self.amax_estimation is not None:
            est = self.amax_estimation
            _check(isinstance(est, (tuple, list)) and len(est) == 2
                   and all(_is_number(s) and 0 < s < math.inf for s in est), "amax_estimation",
                   f"must be None or two finite positive scales (act_scale, grad_scale), got {est!r}")
            _check(self.rht, "amax_estimation", "estimates the post-RHT amax; it needs rht=True")
            self.amax_estimation = tuple(float(s) for s in est)
        _check(self.scaling in ("per_tensor", "per_token"), "scaling",
               f"must be 'per_tensor' or 'per_token', got {self.scaling!r}")
        _check(self.backend in BACKENDS, "backend", f"must be one of {BACKENDS}, got {self.backend!r}")
        if isinstance(self.keep_bf16, str):
            self.keep_bf16 = (self.keep_bf16,)
        _check(isinstance(self.keep_bf16, (tuple, list)) and all(isinstance(p, str) for p in self.keep_bf16),
               "keep_bf16", f"must be a tuple of fnmatch patterns (str), () for none, got {self.keep_bf16!r}")
        self.keep_bf16 = tuple(self.keep_bf16)
        _check(_is_int(self.keep_first_last) and self.keep_first_last >= 0, "keep_first_last",
               f"must be an int >= 0, got {self.keep_first_last!r}")
        _check(_is_int(self.seed) and 0 <= self.seed < 2**31, "seed",
               f"must be an int in [0, 2**31), got {self.seed!r}")
        self.keep_first_last, self.seed = int(self.keep_first_last), int(self.seed)

    def spec(self, role: GemmRole) -> QuantSpec:
        """How the operand ``role`` of a linear's three GEMMs is quantized (the table of
        docs/recipe.md): weights 2d (or 1d) per-tensor RN; activations and gradients 1d with the
        recipe's scaling, SR on gradients, RHT and amax estimation on the wgrad operands."""
        return _spec(GemmRole(role), self.weight_2d, self.scaling, self.stochastic_rounding,
                     self.rht, self.amax_estimation)

    def signs(self) -> torch.Tensor:
        """The RHT signs as a (16,) float32 tensor (TE's default vector when ``rht_signs`` is None)."""
        from .reference import DEFAULT_RHT_SIGNS
        return torch.tensor(self.rht_signs or DEFAULT_RHT_SIGNS, dtype=torch.float32, device="cpu")
