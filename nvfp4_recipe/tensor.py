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
from torchao.utils import TorchAOBaseTensor

from . import reference as R
from .backends import get_backend
from .formats import BLOCK
from .operand import NVFP4Operand
from .recipe import NVFP4Recipe, parse_signs
from .spec import Block, QuantSpec


@functools.lru_cache(maxsize=64)
def _signs_on(device: torch.device, signs: Optional[tuple]) -> torch.Tensor:
    """RHT signs (None: the default vector) as a (16,) float32 tensor on ``device``, made once:
    a host-to-device copy on every ``from_hp`` call would wait for the device's queued work."""
    return NVFP4Recipe(rht_signs=signs).signs().to(device)

aten = torch.ops.aten

__all__ = ["NVFP4Tensor"]


class NVFP4Tensor(TorchAOBaseTensor):
    """An NVFP4-quantized tensor (NVIDIA NVFP4 format; docs/numerics.md).

    Stored (for a tensor of logical shape (..., M, K) quantized along K):
        qdata: uint8 (..., M, K // 2), two E2M1 codes per byte, even element in the low nibble.
        scale: float8_e4m3fn block scales, (..., M, K // 16) for 1d blocks, (M // 16, K // 16) for 2d.
        outer_scale: float32, () per-tensor or (..., M) per-token, equal to amax / (448 * 6).
        rht_signs: (16,) float32 signs if the data holds RHT(x) along K, else None.
    Attributes: ``block`` ("1d"/"2d"), ``scaling``, ``rounding`` ("rn"/"sr"), ``orig_dtype`` (the
    logical dtype), ``transposed``: True for the view ``t()`` of a quantized (M, K) tensor, whose
    logical shape is (K, M) while the blocks still run along the stored last dimension, and
    ``backend``: the backend name its matmuls run on ("auto", "reference", "triton", "native").

    Build one with :meth:`from_hp`; inspect it with ``repr``; get a dense tensor with
    :meth:`dequantize`. ``t.to(device)`` keeps it NVFP4; ``t.to(dtype)`` changes only the logical
    dtype (the dtype matmuls return), never the data.
    """

    tensor_data_names = ["qdata", "scale", "outer_scale"]
    tensor_attribute_names = ["block", "scaling", "rounding", "orig_dtype", "transposed", "backend"]
    optional_tensor_data_names = ["rht_signs"]

    def __new__(cls, qdata, scale, outer_scale, block, scaling, rounding, orig_dtype, transposed,
                backend="auto", rht_signs=None):
        shape = list(qdata.shape[:-1]) + [qdata.shape[-1] * 2]
        if transposed:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=orig_dtype,
                                                   device=qdata.device, requires_grad=False)

    def __init__(self, qdata, scale, outer_scale, block, scaling, rounding, orig_dtype, transposed,
                 backend="auto", rht_signs=None):
        self.qdata = qdata
        self.scale = scale
        self.outer_scale = outer_scale
        self.block = block
        self.scaling = scaling
        self.rounding = rounding
        self.orig_dtype = orig_dtype
        self.transposed = transposed
        self.backend = backend
        self.rht_signs = rht_signs

    # ------------------------------------------------------------------ construction / export
    @classmethod
    def from_hp(cls, x: torch.Tensor, block: str = "1d", scaling: str = "per_tensor",
                rounding: str = "rn", seed: R.IntOrTensor = 0, offset: R.IntOrTensor = 0,
                rht: bool = False, rht_signs: Optional[torch.Tensor] = None,
                backend: str = "auto") -> "NVFP4Tensor":
        """Quantize a high-precision tensor along its last dimension.

        The result carries no autograd history: ``x`` is detached first (E2M1 rounding has no
        useful derivative, and a gradient through the amax alone would reach only the block
        maxima). NVFP4Linear defines the gradients of NVFP4 training (dgrad and wgrad GEMMs).

        Args:
            x: (..., M, K) bfloat16/float16/float32, K a multiple of 16 (2d: a 2-D (M, K) tensor
                with M a multiple of 16 too). An ``x`` with no elements gives an empty
                NVFP4Tensor of its shape (zero outer scale, as an all-zero tensor).
            block: "1d" (1x16 blocks along K) or "2d" (16x16 tiles, per-tensor scaling only).
            scaling: "per_tensor" or "per_token" (one outer scale per row).
            rounding: "rn" (nearest even) or "sr" (stochastic, Philox-4x32-10 bits from
                ``seed``/``offset``: the same bits on every backend).
            rht: quantize ``rht(x, rht_signs)`` (the 16-point random Hadamard transform along K).
            rht_signs: 16 values +-1 (a tensor or a sequence); None with ``rht=True`` uses
                ``NVFP4Recipe().signs()``.
            backend: "auto", "reference", "triton" or "native" (see ``backends.get_backend``).
        Raises:
            TypeError: unsupported dtype. ValueError: bad option or shape (names the problem),
            ``rht_signs`` not 16 values +-1 or given with ``rht=False``.
        """
        x = x.detach()
        spec = QuantSpec(block, scaling, rounding, rht)
        R.check_input(x, spec)
        if rht_signs is not None and not rht:
            raise ValueError("from_hp: rht_signs given, but rht=False")
        signs = None
        if rht:
            signs = _signs_on(x.device, tuple(parse_signs(rht_signs, "from_hp: rht_signs"))
                              if rht_signs is not None else None)
        op = get_backend(backend, x.device).quantize(x, spec, seed=seed, offset=offset, signs=signs)
        return cls.from_operand(op, spec, x.dtype, signs, backend)

    @classmethod
    def from_operand(cls, op: NVFP4Operand, spec: QuantSpec, orig_dtype: torch.dtype,
                     rht_signs: Optional[torch.Tensor] = None, backend: str = "auto") -> "NVFP4Tensor":
        """Wrap an operand with codes that a backend quantized under ``spec`` (how NVFP4Linear
        hands out what it used); ``rht_signs`` when the codes hold the RHT of the data."""
        return cls(op.qdata, op.scale, op.outer_scale, spec.block.value, spec.scaling.value,
                   spec.rounding.value, orig_dtype, False, backend, rht_signs)

    @property
    def operand(self) -> NVFP4Operand:
        """The stored data as an :class:`NVFP4Operand` (blocks along the stored last dimension)."""
        return NVFP4Operand(self.qdata, self.scale, self.outer_scale, Block(self.block))

    def dequantize(self, output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The dense tensor (in the RHT domain if the data went through the RHT), logical shape.

        Returns ``codes * block_scale * outer_scale`` in ``output_dtype`` (default: ``self.dtype``).
        """
        x = R.dequantize(self.operand)
        if self.transposed:
            x = x.transpose(-2, -1)
        return x.to(output_dtype or self.orig_dtype)

    def _with(self, qdata=None, scale=None, outer_scale=None, **attrs) -> "NVFP4Tensor":
        """A copy with some fields replaced."""
        kw = {name: getattr(self, name) for name in self.tensor_attribute_names}
        kw.update(attrs)
        return NVFP4Tensor(self.qdata if qdata is None else qdata,
                           self.scale if scale is None else scale,
                           self.outer_scale if outer_scale is None else outer_scale,
                           kw["block"], kw["scaling"], kw["rounding"], kw["orig_dtype"],
                           kw["transposed"], kw["backend"], self.rht_signs)

    def gemm_operand(self) -> NVFP4Operand:
        """This tensor as a GEMM operand with blocks along its logical reduction dim (the last).

        A 2d tensor in the transposed view is transposed exactly (codes and scales moved, no
        requantization). Raises ``ValueError`` for a 1d tensor whose blocks run along the other dim.
        """
        if not self.transposed:
            return self.operand
        if self.block == "2d":
            return R.transpose_2d(self.operand)
        raise ValueError("a transposed 1d NVFP4Tensor has its blocks along the wrong dimension for "
                         "this operand position; quantize the transpose instead")

    # ------------------------------------------------------------------ REPL
    def __repr__(self) -> str:
        head = (f"NVFP4Tensor(shape={tuple(self.shape)}, dtype={self.orig_dtype}, device={self.device},\n"
                f"  block={self.block} ({'16x16' if self.block == '2d' else '1x16'} E4M3 scales), "
                f"scaling={self.scaling}, rounding={self.rounding}, rht={self.rht_signs is not None}"
                f"{', transposed view' if self.transposed else ''}")
        if (torch.compiler.is_compiling() or isinstance(self.qdata, FakeTensor) or self.qdata.is_meta
                or self.numel() == 0):
            return head + ")"  # no values to show (or none while tracing)
        return head + ",\n" + self._value_summary() + ")"

    def _value_summary(self) -> str:
        s = self.scale.float()
        codes = torch.stack([self.qdata & 0x7, (self.qdata >> 4) & 0x7])
        zero = (codes == 0).float().mean().item()
        outer = self.outer_scale
        outer_txt = (f"{outer.item():.4g}" if outer.dim() == 0 else
                     f"per-token {tuple(outer.shape)} in [{outer.min().item():.4g}, {outer.max().item():.4g}]")
        return (f"  outer_scale={outer_txt}, block_scale in [{s.min().item():.4g}, {s.max().item():.4g}], "
                f"zero codes={100 * zero:.1f}%,\n"
                f"  values[{':8, 0' if self.transposed else '0, :8'}]={self._head_values()}")

    def _head_values(self) -> str:
        """The first few dequantized values of the first stored row (nothing else is dequantized)."""
        row = self.qdata.reshape(-1, self.qdata.shape[-1])[:1, :BLOCK // 2]
        scale = self.scale.reshape(-1, self.scale.shape[-1])[:1, :1]
        outer = self.outer_scale.reshape(-1)[:1]
        vals = R.dequantize(NVFP4Operand(row, scale, outer.reshape(()) if self.scaling == "per_tensor"
                                         else outer))
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
    return torch.stack([_mm(_select(a, i), _select(b, i)) for i in range(a.shape[0])])


def _select(x: NVFP4Tensor, i: int) -> NVFP4Tensor:
    """x[i] along the first (batch) dim of a 3-D 1d-blocked tensor."""
    outer = x.outer_scale[i] if x.outer_scale.dim() else x.outer_scale
    return x._with(x.qdata[i], x.scale[i], outer)


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
    if x.transposed or x.block != "1d":
        raise ValueError("only a non-transposed 1d NVFP4Tensor can have leading dimensions")
    outer = x.outer_scale.reshape(-1) if x.outer_scale.dim() else x.outer_scale
    return x._with(x.qdata.reshape(-1, x.qdata.shape[-1]), x.scale.reshape(-1, x.scale.shape[-1]), outer)


@implements([aten.t.default])
def _(func, types, args, kwargs):
    x = args[0]
    if x.dim() != 2:
        raise ValueError(f"t() expects a 2-D tensor, got {x.dim()}-D")
    return return_and_correct_aliasing(func, args, kwargs, x._with(transposed=not x.transposed))


@implements([aten.transpose.int])
def _(func, types, args, kwargs):
    x, d0, d1 = args
    dims = sorted(d % x.dim() for d in (d0, d1))
    if dims == [d0 % x.dim()] * 2:
        return return_and_correct_aliasing(func, args, kwargs, x._with())
    if dims != [x.dim() - 2, x.dim() - 1]:
        raise NotImplementedError("NVFP4Tensor.transpose supports swapping the last two dims only")
    return return_and_correct_aliasing(func, args, kwargs, x._with(transposed=not x.transposed))


@implements([aten.view.default, aten.reshape.default, aten._unsafe_view.default])
def _(func, types, args, kwargs):
    x, shape = args[0], list(args[1])
    shape = _infer_shape(shape, x.numel())
    if x.transposed or x.block != "1d" or shape[-1] != x.shape[-1] or len(shape) < 2:
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


@implements([aten.slice.Tensor])
def _(func, types, args, kwargs):
    x, dim, start, end, step = list(args) + [0, None, None, 1][len(args) - 1:]
    dim = dim % x.dim()
    start, end = _clip(start, end, x.shape[dim])
    if x.transposed or dim != x.dim() - 2 or step != 1:
        raise NotImplementedError("NVFP4Tensor slicing is supported along the row dim M with step 1")
    if x.block == "2d" and (start % BLOCK or end % BLOCK):
        raise ValueError(f"slicing a 2d-blocked NVFP4Tensor needs row bounds that are multiples of "
                         f"{BLOCK}, got [{start}:{end}]")
    if x.block == "1d":
        scale = x.scale.narrow(dim, start, end - start)
    else:
        scale = x.scale[start // BLOCK:end // BLOCK]
    outer = x.outer_scale.narrow(dim, start, end - start) if x.outer_scale.dim() else x.outer_scale
    qdata = x.qdata.narrow(dim, start, end - start)
    return return_and_correct_aliasing(func, args, kwargs, x._with(qdata, scale, outer))


def _clip(start, end, size):
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return min(start, size), min(end, size)


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


torch.serialization.add_safe_globals([NVFP4Tensor])
