"""NVFP4Tensor: a tensor subclass holding packed E2M1 codes, E4M3 block scales and an fp32 outer scale.

The data layout is that of :class:`operand.NVFP4Operand` (docs/numerics.md). The
logical tensor is ``dequantize()``; its ``dtype`` is the high-precision dtype it was quantized from.
Matmuls of two NVFP4Tensors run as NVFP4 GEMMs on the backend the tensor was made with
(``backends``, resolved for its device).
"""

import functools
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import return_and_correct_aliasing
from . import _torchao  # noqa: F401  (imports torchao quietly, before the line below)
from torchao.utils import TorchAOBaseTensor

from . import reference as R
from .backends import get_backend
from .formats import BLOCK
from .operand import NVFP4Operand
from .recipe import NVFP4Recipe, _is_int, parse_signs
from .spec import (FOUR_OVER_SIX_DEFAULT_E4M3_MAX, SPEC_TYPES, Block, FourOverSix, Form, QuantSpec,
                   Rounding, Scaling)


@functools.lru_cache(maxsize=64)
def _signs_on(device: torch.device, signs: Optional[tuple]) -> torch.Tensor:
    """RHT signs (None: the default vector) as a (16,) float32 tensor on ``device``, made once:
    a host-to-device copy on every ``from_hp`` call would wait for the device's queued work."""
    return NVFP4Recipe(rht_signs=signs).signs().to(device)

aten = torch.ops.aten

__all__ = ["NVFP4Tensor"]

SUPPORTED_OPS = ("mm/addmm/bmm/matmul/linear of two NVFP4Tensors, t/T/mT/transpose of the last two "
                 "dims, row indexing and slicing, view/reshape of the leading dims, "
                 "==/!=/torch.equal/allclose/isclose (on the dequantized values), "
                 "detach/clone/copy_/to, pickle/torch.save")


def _check_x(x) -> None:
    if isinstance(x, NVFP4Tensor):
        raise TypeError("from_hp: x is already quantized (an NVFP4Tensor); call .dequantize() first")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"from_hp: x must be a torch.Tensor, got {type(x).__name__}")


def _check_stream_arg(value, name: str) -> R.IntOrTensor:
    """A seed or offset of the SR stream as the reference and the kernels take it: an int (as a
    Python int) or a one-element integer tensor (unchecked values: reading them would sync)."""
    what = f"from_hp: {name} must be an int in [0, 2**63) or a one-element integer tensor, got {value!r}"
    if isinstance(value, torch.Tensor):
        dtype = value.dtype
        if value.numel() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(what)
        return value
    if not _is_int(value):
        raise TypeError(what)
    if not 0 <= value < 2**63:
        raise ValueError(what)
    return int(value)


def _four_over_six(error, e4m3_max, fast_math) -> Optional[FourOverSix]:
    """from_hp's 4/6 arguments as a spec field (None without 4/6).

    Raises:
        ValueError: ``"from_hp: <argument>: ..."`` for a bad value, or a bound or fast_math
            given with ``four_over_six=None``.
    """
    if error is None:
        if e4m3_max != FOUR_OVER_SIX_DEFAULT_E4M3_MAX or fast_math is not False:
            raise ValueError("from_hp: four_over_six_e4m3_max / four_over_six_fast_math given, but "
                             "four_over_six=None")
        return None
    try:
        return FourOverSix(error, e4m3_max, fast_math)
    except ValueError as e:  # FourOverSix names its field: error, e4m3_max or fast_math
        field, _, problem = str(e).partition(":")
        arg = "four_over_six" if field == "error" else f"four_over_six_{field}"
        raise ValueError(f"from_hp: {arg}:{problem}") from None


class NVFP4Tensor(TorchAOBaseTensor):
    """An NVFP4-quantized tensor (NVIDIA NVFP4 format; docs/numerics.md).

    Stored (for a tensor of logical shape (..., M, K) quantized along K):
        qdata: uint8 (..., M, K // 2), two E2M1 codes per byte, even element in the low nibble.
        scale: float8_e4m3fn block scales, (..., M, K // 16) for 1d blocks, (M // 16, K // 16) for 2d.
        outer_scale: float32, () per-tensor or (..., M) per-token, equal to amax / (448 * 6)
            (with 4/6, amax / (bound * 6)).
        rht_signs: (16,) float32 signs if the data holds RHT(x) along K (``spec.rht``), else None.
    Attributes: ``spec``, the :class:`QuantSpec` the data was quantized under (held whole: its
    fields are read from it, never copied); ``orig_dtype`` (the logical dtype); ``transposed``:
    True for the view ``t()`` of a quantized (M, K) tensor, whose logical shape is (K, M) while
    the blocks still run along the stored last dimension; ``backend``: the backend name its
    matmuls run on ("auto", "reference", "triton", "native"). Read-only, from the spec: ``block``
    (Block, a str enum: ``== "2d"`` holds), ``scaling``, ``rounding``, ``amax_scale`` (None or a
    float) and ``four_over_six`` (None or a ``FourOverSix``). ``operand`` is the stored data as an
    :class:`NVFP4Operand` carrying the spec.

    Build one with :meth:`from_hp`; inspect it with ``repr``; get a dense tensor with
    :meth:`dequantize`. ``t.to(device)`` keeps it NVFP4; ``t.to(dtype)`` changes only the logical
    dtype (the dtype matmuls return), never the data.

    Ops (``SUPPORTED_OPS``); every other op raises ``NotImplementedError`` naming the op and
    asking for ``.dequantize()`` first:
        - ``mm``, ``addmm`` (1-D bias), ``bmm``, ``matmul``, ``F.linear`` of two NVFP4Tensors:
          NVFP4 GEMMs, the second operand a transposed view (``w.t()``, ``w.T``).
        - ``t()``, ``.T`` (2-D), ``.mT``, ``transpose``/``permute`` swapping the last two dims: views.
        - Indexing and slicing along rows, any dim but the one the blocks run along (the stored
          last dim): ``t[i]``, ``t[a:b]``, ``t[a:b:s]``, ``t[:, a:b]`` of a transposed view. Whole
          rows keep their codes, block scales and per-token outer scales; a per-tensor outer
          scale is shared. 2d-blocked tensors slice at multiples of 16 rows only (no ``t[i]``).
        - ``view``/``reshape`` of the leading dims (1d blocks, not transposed).
        - ``==``, ``!=``, ``torch.equal``, ``allclose``, ``isclose``: on ``dequantize()``, the
          logical values, so two tensors holding different codes that dequantize alike are equal.
        - ``detach``, ``clone``, ``copy_``, ``to``; ``pickle``, ``copy``, ``deepcopy``,
          ``torch.save``/``torch.load``.
    """

    tensor_data_names = ["qdata", "scale", "outer_scale"]
    # the spec is one attribute: flattened whole (frozen and hashable, a compile-time constant)
    tensor_attribute_names = ["spec", "orig_dtype", "transposed", "backend"]
    optional_tensor_data_names = ["rht_signs"]

    def __new__(cls, qdata, scale, outer_scale, spec, orig_dtype, transposed, backend="auto",
                rht_signs=None):
        shape = list(qdata.shape[:-1]) + [qdata.shape[-1] * 2]
        if transposed:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=orig_dtype,
                                                   device=qdata.device, requires_grad=False)

    def __init__(self, qdata, scale, outer_scale, spec, orig_dtype, transposed, backend="auto",
                 rht_signs=None):
        """The tensor holding these fields as they are (see the class docstring); build one with
        :meth:`from_hp` or :meth:`from_operand`.

        Raises:
            TypeError: ``spec`` is not a QuantSpec.
            ValueError: ``rht_signs`` given without ``spec.rht``, or missing with it.
        """
        if not isinstance(spec, QuantSpec):
            raise TypeError(f"NVFP4Tensor: spec must be a QuantSpec, got {spec!r}")
        if spec.rht != (rht_signs is not None):
            raise ValueError(f"NVFP4Tensor: the spec has rht={spec.rht}, but rht_signs is "
                             f"{'None' if rht_signs is None else 'given'}")
        self.qdata = qdata
        self.scale = scale
        self.outer_scale = outer_scale
        self.spec = spec
        self.orig_dtype = orig_dtype
        self.transposed = transposed
        self.backend = backend
        self.rht_signs = rht_signs

    @property
    def block(self) -> Block:
        """``spec.block``: Block.D1 ("1d", 1x16 scales) or Block.D2 ("2d", 16x16)."""
        return self.spec.block

    @property
    def scaling(self) -> Scaling:
        """``spec.scaling``: Scaling.PER_TENSOR ("per_tensor") or PER_TOKEN ("per_token")."""
        return self.spec.scaling

    @property
    def rounding(self) -> Rounding:
        """``spec.rounding``: Rounding.RN ("rn") or SR ("sr")."""
        return self.spec.rounding

    @property
    def amax_scale(self) -> Optional[float]:
        """``spec.amax_scale``: None, or the amax estimation factor."""
        return self.spec.amax_scale

    @property
    def four_over_six(self) -> Optional[FourOverSix]:
        """``spec.four_over_six``: None, or the 4/6 block scaling."""
        return self.spec.four_over_six

    # ------------------------------------------------------------------ construction / export
    @classmethod
    def from_hp(cls, x: torch.Tensor, block: str = "1d", scaling: str = "per_tensor",
                rounding: str = "rn", seed: R.IntOrTensor = 0, offset: R.IntOrTensor = 0,
                rht: bool = False, rht_signs: Optional[torch.Tensor] = None,
                backend: str = "auto", four_over_six: Optional[str] = None,
                four_over_six_e4m3_max: int = FOUR_OVER_SIX_DEFAULT_E4M3_MAX,
                four_over_six_fast_math: bool = False) -> "NVFP4Tensor":
        """Quantize a high-precision tensor along its last dimension.

        The result carries no autograd history: ``x`` is detached first (E2M1 rounding has no
        useful derivative, and a gradient through the amax alone would reach only the block
        maxima). NVFP4Linear defines the gradients of NVFP4 training (dgrad and wgrad GEMMs).

        Args:
            x: (..., M, K) bfloat16/float16/float32 torch.Tensor, K a multiple of 16 (2d: a 2-D
                (M, K) tensor with M a multiple of 16 too). An ``x`` with no elements gives an
                empty NVFP4Tensor of its shape (zero outer scale, as an all-zero tensor).
            block: "1d" (1x16 blocks along K) or "2d" (16x16 tiles, per-tensor scaling only).
            scaling: "per_tensor" or "per_token" (one outer scale per row).
            rounding: "rn" (nearest even) or "sr" (stochastic, Philox-4x32-10 bits from
                ``seed``/``offset``: the same bits on every backend).
            seed: the 64-bit Philox key, an int in [0, 2**63) (the reference holds it in int64)
                or a one-element integer tensor (e.g. on the device, not read on the host).
            offset: the Philox counter of the first 16 elements, the same kinds as ``seed``;
                counters are 32-bit, so offsets are taken modulo 2**32.
            rht: bool, quantize ``rht(x, rht_signs)`` (the 16-point random Hadamard transform
                along K).
            rht_signs: 16 values +-1 (a tensor or a sequence); None with ``rht=True`` uses
                ``NVFP4Recipe().signs()``.
            backend: "auto", "reference", "triton" or "native" (see ``backends.get_backend``).
            four_over_six: None, "mae" or "mse": 4/6 block scaling (each block's scale maps its
                amax to 4 or to 6, whichever RN error of that kind is smaller; TransformerEngine's
                ``nvfp4_use_4over6``, docs/numerics.md), after the RHT if any, with SR the block
                rounded stochastically under the chosen scale.
            four_over_six_e4m3_max: 256 (the default, as ``NVFP4Recipe``'s and ``FourOverSix``'s:
                the paper's, leaving the largest block's map-to-4 scale inside E4M3) or 448
                (TE's default): the E4M3 bound of the 4/6 outer scale (``S_enc = 6 * bound / amax``).
            four_over_six_fast_math: the 4/6 error on the scaled values (TE's fast math).
        Raises:
            TypeError: ``x`` not a tensor or already an NVFP4Tensor, unsupported dtype, ``seed``
            or ``offset`` not an int or a one-element integer tensor, ``rht`` not a bool.
            ValueError: bad option or shape (names the problem), ``seed``/``offset`` outside
            [0, 2**63), ``rht_signs`` not 16 values +-1 or given with ``rht=False``, a 4/6
            setting outside its values or given with ``four_over_six=None``.
        """
        _check_x(x)
        seed, offset = _check_stream_arg(seed, "seed"), _check_stream_arg(offset, "offset")
        if not isinstance(rht, bool):
            raise TypeError(f"from_hp: rht must be a bool, got {rht!r}")
        x = x.detach()
        spec = QuantSpec(block, scaling, rounding, rht, four_over_six=_four_over_six(
            four_over_six, four_over_six_e4m3_max, four_over_six_fast_math))
        R.check_input(x, spec)
        if rht_signs is not None and not rht:
            raise ValueError("from_hp: rht_signs given, but rht=False")
        signs = None
        if rht:
            signs = _signs_on(x.device, tuple(parse_signs(rht_signs, "from_hp: rht_signs"))
                              if rht_signs is not None else None)
        op = get_backend(backend, x.device).quantize(x, spec, seed=seed, offset=offset, signs=signs)
        return cls.from_operand(op, x.dtype, signs, backend)

    @classmethod
    def from_operand(cls, op: NVFP4Operand, orig_dtype: torch.dtype,
                     rht_signs: Optional[torch.Tensor] = None, backend: str = "auto") -> "NVFP4Tensor":
        """Wrap an operand with codes (how NVFP4Linear hands out what it used), under the spec it
        carries (``op.spec``); ``rht_signs``, the (16,) signs, when the codes hold the RHT of the
        data (``op.spec.rht``). No copy: the tensor holds the operand's tensors.

        Raises:
            ValueError: ``op`` holds inner values, not codes (``op.form``), or ``rht_signs`` is
                given without ``op.spec.rht`` or missing with it.
        """
        if op.form is not Form.CODES:
            raise ValueError(f"from_operand: an NVFP4Tensor holds codes; the operand holds "
                             f"{op.form} (quantize it with transient=False)")
        return cls(op.qdata, op.scale, op.outer_scale, op.spec, orig_dtype, False, backend,
                   rht_signs)

    @property
    def operand(self) -> NVFP4Operand:
        """The stored data as an :class:`NVFP4Operand` (codes, blocks along the stored last
        dimension) carrying :attr:`spec`."""
        return NVFP4Operand(self.qdata, self.scale, self.outer_scale, self.spec)

    def dequantize(self, output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The dense tensor (in the RHT domain if the data went through the RHT), logical shape.

        Returns ``codes * block_scale * outer_scale`` in ``output_dtype`` (default: ``self.dtype``).
        """
        x = R.dequantize(self.operand)
        if self.transposed:
            x = x.transpose(-2, -1)
        return x.to(output_dtype or self.orig_dtype)

    def _with(self, qdata=None, scale=None, outer_scale=None, **attrs) -> "NVFP4Tensor":
        """A copy with some tensors or attributes (``tensor_attribute_names``) replaced."""
        kw = {name: getattr(self, name) for name in self.tensor_attribute_names}
        kw.update(attrs)
        return NVFP4Tensor(self.qdata if qdata is None else qdata,
                           self.scale if scale is None else scale,
                           self.outer_scale if outer_scale is None else outer_scale,
                           rht_signs=self.rht_signs, **kw)

    def gemm_operand(self) -> NVFP4Operand:
        """This tensor as a GEMM operand with blocks along its logical reduction dim (the last).

        A 2d tensor in the transposed view is transposed exactly (codes and scales moved, no
        requantization). Raises ``ValueError`` for a 1d tensor whose blocks run along the other dim.
        """
        if not self.transposed:
            return self.operand
        if self.block is Block.D2:
            return R.transpose_2d(self.operand)
        raise ValueError("a transposed 1d NVFP4Tensor has its blocks along the wrong dimension for "
                         "this operand position; quantize the transpose instead")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """The op table (torchao's), with one message for every op not in it."""
        impl = cls._ATEN_OP_TABLE[cls].get(func)
        if impl is None:
            raise NotImplementedError(f"NVFP4Tensor supports {SUPPORTED_OPS}; "
                                      f"call .dequantize() first for {func}")
        return impl(func, types, args, kwargs or {})

    def __reduce_ex__(self, protocol):
        """Pickle as its plain tensors and attributes, the block scales as their bits: plain
        pickle cannot load a float8 tensor (torch 2.13 pickles its storage without the dtype)."""
        names = self.tensor_attribute_names + self.optional_tensor_data_names
        return _from_pickle, (self.qdata, self.scale.view(torch.uint8), self.outer_scale,
                              *(getattr(self, name) for name in names))

    # ------------------------------------------------------------------ REPL
    def __repr__(self) -> str:
        head = (f"NVFP4Tensor(shape={tuple(self.shape)}, dtype={self.orig_dtype}, device={self.device},\n"
                f"  block={self.block} ({'16x16' if self.block is Block.D2 else '1x16'} E4M3 scales), "
                f"scaling={self.scaling}, rounding={self.rounding}, rht={self.spec.rht}"
                f"{'' if self.amax_scale is None else f', amax_scale={self.amax_scale:g}'}"
                f"{self._four_over_six_repr()}{', transposed view' if self.transposed else ''}")
        if (torch.compiler.is_compiling() or isinstance(self.qdata, FakeTensor) or self.qdata.is_meta
                or self.numel() == 0):
            return head + ")"  # no values to show (or none while tracing)
        return head + ",\n" + self._value_summary() + ")"

    def _four_over_six_repr(self) -> str:
        """", 4/6=<error> (E4M3 bound <b>[, fast-math])" for a 4/6-quantized tensor, else ""."""
        fos = self.four_over_six
        if fos is None:
            return ""
        return (f", 4/6={fos.error.value} (E4M3 bound {fos.e4m3_max}"
                f"{', fast-math' if fos.fast_math else ''})")

    def _value_summary(self) -> str:
        s = self.scale.float()
        codes = torch.stack([self.qdata & 0x7, (self.qdata >> 4) & 0x7])
        zero = (codes == 0).float().mean().item()
        outer = self.outer_scale
        outer_txt = (f"{outer.item():.4g}" if outer.dim() == 0 else
                     f"per-token {tuple(outer.shape)} in [{outer.min().item():.4g}, {outer.max().item():.4g}]")
        return (f"  outer_scale={outer_txt}, block_scale in [{s.min().item():.4g}, {s.max().item():.4g}], "
                f"zero codes={100 * zero:.1f}%,\n"
                f"  values[{self._head_index()}]={self._head_values()}")

    def _head_index(self) -> str:
        """The logical index of the values ``_head_values`` shows."""
        if self.transposed:
            return "0, " * (self.dim() - 2) + ":8, 0"
        return "0, " * (self.dim() - 1) + ":8"

    def _head_values(self) -> str:
        """The first few dequantized values of the first stored row (nothing else is dequantized)."""
        row = self.qdata.reshape(-1, self.qdata.shape[-1])[:1, :BLOCK // 2]
        scale = self.scale.reshape(-1, self.scale.shape[-1])[:1, :1]
        outer = self.outer_scale.reshape(-1)[:1]
        outer = outer if self.spec.per_token else outer.reshape(())
        vals = R.dequantize(NVFP4Operand(row, scale, outer))
        return "[" + ", ".join(f"{v:.4g}" for v in vals.reshape(-1)[:8].tolist()) + "]"


implements = NVFP4Tensor.implements
implements_torch_function = NVFP4Tensor.implements_torch_function


def _not_nvfp4(func, x) -> None:
    if not isinstance(x, NVFP4Tensor):
        raise TypeError(f"{func}: both operands must be NVFP4Tensors (got {type(x).__name__}); "
                        "quantize the other one with NVFP4Tensor.from_hp")


def _check_rht(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    sa, sb = a.rht_signs, b.rht_signs
    if (sa is None) != (sb is None) or (sa is not None and not torch.equal(sa, sb.to(sa.device))):
        raise ValueError("NVFP4 matmul operands must both skip the RHT or share the same RHT signs; "
                         "otherwise the transform does not cancel in the product")


def _mm(a: NVFP4Tensor, b: NVFP4Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) as an NVFP4 GEMM: b must be the transposed view of an (N, K) tensor."""
    _not_nvfp4("mm", a)
    _not_nvfp4("mm", b)
    _check_rht(a, b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"mm: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    b_rows = b._with(transposed=not b.transposed)  # (N, K), blocks must run along K
    backend = get_backend(a.backend, a.device)
    return backend.mm(a.gemm_operand(), b_rows.gemm_operand(), bias=bias, out_dtype=a.orig_dtype)


@implements(aten.mm.default)
def _(func, types, args, kwargs):
    return _mm(args[0], args[1])


@implements(aten.addmm.default)
def _(func, types, args, kwargs):
    bias, a, b = args[:3]
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1 or bias.dim() != 1:
        raise NotImplementedError("addmm on NVFP4Tensor supports a 1-D bias with beta=alpha=1")
    return _mm(a, b, bias)


@implements(aten.bmm.default)
def _(func, types, args, kwargs):
    a, b = args
    _not_nvfp4("bmm", a)
    _not_nvfp4("bmm", b)
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
        raise ValueError(f"bmm: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    return torch.stack([_mm(_select(a, 0, i), _select(b, 0, i)) for i in range(a.shape[0])])


@implements_torch_function([torch.nn.functional.linear])
def _(func, types, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    _not_nvfp4("linear", x)
    lead = x.shape[:-1]
    y = _mm(_flatten_rows(x), w.t(), bias)
    return y.reshape(*lead, y.shape[-1])


@implements_torch_function([torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__])
def _(func, types, args, kwargs):
    a, b = args
    _not_nvfp4("matmul", a)
    _not_nvfp4("matmul", b)
    if a.dim() >= 2 and b.dim() == 2:
        y = _mm(_flatten_rows(a), b)
        return y.reshape(*a.shape[:-1], y.shape[-1])
    if a.dim() == 3 and b.dim() == 3:
        return torch.bmm(a, b)
    raise NotImplementedError(f"matmul of NVFP4Tensors of shapes {tuple(a.shape)} and {tuple(b.shape)}")


def _flatten_rows(x: NVFP4Tensor) -> NVFP4Tensor:
    """(..., M, K) -> (prod(...) * M, K), a view of the stored data (1d blocks, not transposed)."""
    if x.dim() == 2:
        return x
    if x.transposed or x.block is not Block.D1:
        raise ValueError("only a non-transposed 1d NVFP4Tensor can have leading dimensions")
    outer = x.outer_scale.reshape(-1) if x.outer_scale.dim() else x.outer_scale
    return x._with(x.qdata.reshape(-1, x.qdata.shape[-1]), x.scale.reshape(-1, x.scale.shape[-1]), outer)


def _view(func, args, kwargs, x: NVFP4Tensor, swap: bool) -> NVFP4Tensor:
    """The result of the view op ``func``: x itself, or with its last two dims swapped."""
    return return_and_correct_aliasing(func, args, kwargs, x._with(transposed=x.transposed != swap))


@implements([aten.t.default])
def _(func, types, args, kwargs):
    x = args[0]
    if x.dim() != 2:
        raise ValueError(f"t() expects a 2-D tensor, got {x.dim()}-D")
    return _view(func, args, kwargs, x, True)


@implements([aten.transpose.int])
def _(func, types, args, kwargs):
    x, d0, d1 = args
    dims = sorted(d % x.dim() for d in (d0, d1))
    if dims[0] != dims[1] and dims != [x.dim() - 2, x.dim() - 1]:
        raise NotImplementedError("NVFP4Tensor.transpose supports swapping the last two dims only")
    return _view(func, args, kwargs, x, dims[0] != dims[1])


@implements([aten.permute.default])
def _(func, types, args, kwargs):
    """``.T`` of a 2-D tensor (permute [1, 0]) and any permutation that swaps the last two dims."""
    x, dims = args
    n = x.dim()
    keep = list(range(n))
    dims = [d % n for d in dims]
    if dims != keep and dims != keep[:-2] + [n - 1, n - 2]:
        raise NotImplementedError(f"NVFP4Tensor.permute supports swapping the last two dims only, "
                                  f"got {dims}")
    return _view(func, args, kwargs, x, dims != keep)


@implements([aten.view.default, aten.reshape.default, aten._unsafe_view.default])
def _(func, types, args, kwargs):
    x, shape = args[0], list(args[1])
    shape = _infer_shape(shape, x.numel())
    if x.transposed or x.block is not Block.D1 or shape[-1] != x.shape[-1] or len(shape) < 2:
        raise NotImplementedError(f"{func}: NVFP4Tensor supports reshaping its leading dims only "
                                  f"(last dim kept, 1d blocks, not transposed); {tuple(x.shape)} -> {tuple(shape)}")
    lead = shape[:-1]
    qdata = x.qdata.reshape(*lead, x.qdata.shape[-1])
    scale = x.scale.reshape(*lead, x.scale.shape[-1])
    outer = x.outer_scale.reshape(lead) if x.outer_scale.dim() else x.outer_scale
    return return_and_correct_aliasing(func, args, kwargs, x._with(qdata, scale, outer))


def _infer_shape(shape, numel):
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        shape[shape.index(-1)] = numel // known
    return shape


def _row_dim(x: NVFP4Tensor, dim: int) -> int:
    """The stored dim of the logical dim ``dim``, which must run along rows (not along blocks)."""
    dim = dim % x.dim()
    if x.transposed and dim >= x.dim() - 2:
        dim = 2 * x.dim() - 3 - dim  # the last two dims swap
    if dim == x.dim() - 1:
        raise NotImplementedError("NVFP4Tensor indexing and slicing run along rows only, not along "
                                  "the dim its blocks of 16 run along; call .dequantize() first")
    return dim


def _on_rows(x: NVFP4Tensor, dim: int, take) -> NVFP4Tensor:
    """x with ``take(tensor, dim)`` applied to its codes, its 1d block scales and its per-token
    outer scales along the stored row dim ``dim`` (a per-tensor outer scale is shared)."""
    qdata = take(x.qdata, dim)
    outer = take(x.outer_scale, dim) if x.outer_scale.dim() else x.outer_scale
    return x._with(qdata, take(x.scale, dim), outer, transposed=x.transposed and qdata.dim() >= 2)


def _select(x: NVFP4Tensor, dim: int, index: int) -> NVFP4Tensor:
    """x[..., index, ...] along the logical row dim ``dim`` (1d blocks)."""
    dim = _row_dim(x, dim)
    if x.block is Block.D2:
        raise ValueError(f"indexing one row of a 2d-blocked NVFP4Tensor would split its {BLOCK}x{BLOCK} "
                         f"tiles; slice at multiples of {BLOCK} rows")
    return _on_rows(x, dim, lambda t, d: t.select(d, index))


@implements([aten.select.int])
def _(func, types, args, kwargs):
    x, dim, index = args
    return return_and_correct_aliasing(func, args, kwargs, _select(x, dim, index))


@implements([aten.slice.Tensor])
def _(func, types, args, kwargs):
    x, dim, start, end, step = list(args) + [0, None, None, 1][len(args) - 1:]
    dim = _row_dim(x, dim)
    if x.block is Block.D1:
        out = _on_rows(x, dim, lambda t, d: aten.slice.Tensor(t, d, start, end, step))
        return return_and_correct_aliasing(func, args, kwargs, out)
    start, end = _clip(start, end, x.qdata.shape[dim])
    if step != 1 or start % BLOCK or end % BLOCK:
        raise ValueError(f"slicing a 2d-blocked NVFP4Tensor needs step 1 and row bounds that are "
                         f"multiples of {BLOCK}, got [{start}:{end}:{step}]")
    out = x._with(x.qdata[start:end], x.scale[start // BLOCK:end // BLOCK])
    return return_and_correct_aliasing(func, args, kwargs, out)


def _clip(start, end, size):
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return min(start, size), min(end, size)


def _dequantized(a):
    return a.dequantize() if isinstance(a, NVFP4Tensor) else a


@implements_torch_function([torch.isclose, torch.Tensor.isclose])
@implements([aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.equal.default,
             aten.allclose.default])
def _(func, types, args, kwargs):
    """Comparisons of the logical values (torch.isclose is composite: its parts would reach the op
    table one by one)."""
    return func(*map(_dequantized, args), **kwargs)


@implements([aten._to_copy.default])
def _(func, types, args, kwargs):
    x = args[0]
    dtype = kwargs.get("dtype") or x.orig_dtype
    device = kwargs.get("device") or x.device
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the logical dtype of an NVFP4Tensor must be bf16/fp16/fp32, got {dtype}")
    moved = x._apply_fn_to_data(lambda t: t.to(device))
    return return_and_correct_aliasing(func, args, kwargs, moved._with(orig_dtype=dtype))


@implements_torch_function([torch.Tensor.to])
def _(func, types, args, kwargs):
    x = args[0]
    kw = x._get_to_kwargs(*args[1:], **kwargs)
    if kw["device"] == x.device and kw["dtype"] == x.dtype:
        return x
    return aten._to_copy.default(x, dtype=kw["dtype"], device=kw["device"])


# The attributes, in order, that an NVFP4Tensor pickled before it held its spec (versions up to
# 2026-11-28): the spec's fields one by one (amax_scale and four_over_six from 2026-11-27 on).
_FIELD_BY_FIELD = ("block", "scaling", "rounding", "orig_dtype", "transposed", "backend",
                   "rht_signs", "amax_scale", "four_over_six")
_SPEC_FIELDS = ("block", "scaling", "rounding", "amax_scale", "four_over_six")


def _with_spec(attributes: dict) -> dict:
    """The attributes of a tensor pickled field by field, the spec's fields (``_SPEC_FIELDS``,
    the RHT from ``rht_signs``) gathered into ``spec``; the others as they are."""
    rest = {k: v for k, v in attributes.items() if k not in _SPEC_FIELDS}
    fields = {k: v for k, v in attributes.items() if k in _SPEC_FIELDS}
    return dict(rest, spec=QuantSpec(rht=rest.get("rht_signs") is not None, **fields))


def _from_pickle(qdata, scale_bits, outer_scale, *attributes) -> NVFP4Tensor:
    """The tensor ``NVFP4Tensor.__reduce_ex__`` pickled (a stable name: pickles refer to it)."""
    scale = scale_bits.view(torch.float8_e4m3fn)
    if not isinstance(attributes[0], QuantSpec):  # pickled field by field
        return NVFP4Tensor(qdata, scale, outer_scale,
                           **_with_spec(dict(zip(_FIELD_BY_FIELD, attributes))))
    return NVFP4Tensor(qdata, scale, outer_scale, *attributes)


_torchao_setstate = NVFP4Tensor.__setstate__


def _setstate(self: NVFP4Tensor, state: dict) -> None:
    """torchao's ``__setstate__`` (a file written with torch.Tensor's reduction, before
    ``__reduce_ex__``), the spec gathered from the fields of one written field by field."""
    _torchao_setstate(self, state if "spec" in state else _with_spec(state))


NVFP4Tensor.__setstate__ = _setstate  # after the class: torchao's __init_subclass__ sets its own

# the types an NVFP4Tensor's pickle holds besides tensors and strings: the spec's
torch.serialization.add_safe_globals([NVFP4Tensor, _from_pickle, *SPEC_TYPES])
