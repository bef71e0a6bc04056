"""Backends: the implementations of NVFP4 quantization and the NVFP4 GEMM for a device.

- ``reference``: plain PyTorch (``reference.py``), any device; the spec.
- ``triton``: fused Triton kernels (``kernels/``) for CUDA GPUs before Blackwell and, in tests, the
  Triton interpreter on CPU.
- ``native``: sm100+ FP4 tensor cores through ``torch._scaled_mm``.

Every backend implements :class:`Backend`; a backend may leave a method to the reference
implementation it inherits. ``get_backend`` resolves "auto" and logs a fallback once.
"""

import logging
from typing import Optional, Tuple

import torch

from . import reference as R
from .recipe import OperandSpec
from .reference import NVFP4Data
from .streams import SideStream

log = logging.getLogger("nvfp4_recipe")


class Backend:
    """The reference backend; subclasses override methods with faster kernels that give the same bits.

    Operand convention: an operand is an :class:`NVFP4Data` of an (M, K) matrix with blocks along K.
    """

    name = "reference"

    def quantize(self, x: torch.Tensor, spec: OperandSpec, seed: R.IntOrTensor = 0,
                 offset: R.IntOrTensor = 0, rht_signs: Optional[torch.Tensor] = None) -> NVFP4Data:
        """Rowwise quantization of x (..., M, K) along K as ``spec`` says (RHT along K if spec.rht)."""
        signs = rht_signs if spec.rht else None
        amax_ = None
        if spec.amax_scale is not None:
            amax_ = spec.amax_scale * R.amax(x, spec.scaling)
        return R.quantize(x, block=spec.block, scaling=spec.scaling, rounding=spec.rounding,
                          seed=seed, offset=offset, rht_signs=signs, amax_=amax_)

    def quantize_pair(self, x: torch.Tensor, row: OperandSpec, col: OperandSpec,
                      seed: R.IntOrTensor = 0, row_offset: R.IntOrTensor = 0,
                      col_offset: R.IntOrTensor = 0, rht_signs: Optional[torch.Tensor] = None,
                      ) -> Tuple[NVFP4Data, NVFP4Data]:
        """Rowwise copy of x (M, K) and columnwise copy (the quantization of x^T, (K, M), blocks along M).

        The fused kernels read x once for both; the result equals two calls of :meth:`quantize`.
        """
        return (self.quantize(x, row, seed, row_offset, rht_signs),
                self.quantize(x.t(), col, seed, col_offset, rht_signs))

    def quantize_weight(self, w: torch.Tensor, spec: OperandSpec) -> Tuple[NVFP4Data, NVFP4Data]:
        """W (N, K) for fprop and W^T (K, N) for dgrad. 2d: one quantization, W^T its exact transpose;
        1d: two quantizations, blocks along K for W and along N for W^T."""
        wq = self.quantize(w, spec)
        if spec.block == "2d":
            return wq, R.transpose_2d(wq)
        return wq, self.quantize(w.t(), spec)

    def scaled_mm(self, a: NVFP4Data, b: NVFP4Data, a_block: str = "1d", b_block: str = "1d",
                  bias: Optional[torch.Tensor] = None,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """D (M, N) = (s_a * s_b) * (A_deq @ B_deq^T) + bias for A (M, K) and B (N, K)."""
        return R.scaled_mm(a, b, a_block=a_block, b_block=b_block, bias=bias, out_dtype=out_dtype)

    def gemm_operands(self, x: torch.Tensor, row: Optional[OperandSpec],
                      col: Optional[OperandSpec], seed: R.IntOrTensor = 0,
                      row_offset: R.IntOrTensor = 0, col_offset: R.IntOrTensor = 0,
                      rht_signs: Optional[torch.Tensor] = None,
                      transient: Tuple[bool, bool] = (True, True), b: Optional[NVFP4Data] = None):
        """The rowwise copy of x (M, K) under ``row`` and the columnwise copy (x^T's, (K, M)) under
        ``col`` (each None to skip) as A operands of :meth:`operand_mm`, and ``b`` (a 1d B operand
        or None) prepared by :meth:`b_operand`, which a backend may do in the same pass.

        ``transient[i]``: copy i only feeds the GEMM that follows, so a backend may return it in a
        form only :meth:`operand_mm` takes (the Triton backend: fp16 inner values); the other
        copies are :class:`NVFP4Data` (kept for backward). Here all are NVFP4Data.
        Returns (rowwise copy or None, columnwise copy or None, prepared b or None).
        """
        if row is not None and col is not None:
            copies = self.quantize_pair(x, row, col, seed, row_offset, col_offset, rht_signs)
        else:
            copies = (None if row is None else self.quantize(x, row, seed, row_offset, rht_signs),
                      None if col is None else self.quantize(x.t(), col, seed, col_offset,
                                                             rht_signs))
        return (*copies, None if b is None else self.b_operand(b, "1d"))

    def b_operand(self, b: NVFP4Data, block: str):
        """B (N, K) with ``block`` blocks in the form :meth:`operand_mm` takes; a backend may
        prepare it ahead of the GEMM (the Triton backend: its fp16 inner values). Here: b."""
        return b

    def operand_mm(self, a, b, b_block: str, bias: Optional[torch.Tensor],
                   out_dtype: torch.dtype) -> torch.Tensor:
        """:meth:`scaled_mm` of an A (1d blocks) from :meth:`gemm_operands` and a B
        (NVFP4Data or from :meth:`b_operand`)."""
        return self.scaled_mm(a, b, "1d", b_block, bias, out_dtype)

    def linear_fprop(self, x: torch.Tensor, weight: torch.Tensor, w_spec: OperandSpec,
                     x_spec: OperandSpec, xt_spec: Optional[OperandSpec], need_wt: bool,
                     bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                     seed: R.IntOrTensor = 0, rht_signs: Optional[torch.Tensor] = None,
                     ) -> Tuple[torch.Tensor, Optional[NVFP4Data], Optional[NVFP4Data]]:
        """The fprop of an NVFP4 linear layer: Y = Q(x) @ Q(W)^T + bias.

        x: (M, K) activations, quantized rowwise under ``x_spec`` (SR offset 0); weight: W (N, K),
        quantized under ``w_spec`` (with ``need_wt`` also W^T (K, N) for dgrad,
        :meth:`quantize_weight`). With ``xt_spec`` also quantizes x^T (K, M) for wgrad (from the
        same read where a backend fuses it). In a CUDA-graph capture the weight is quantized on a
        side stream while x is (``streams.SideStream``). Returns (Y (M, N) of ``out_dtype``, the
        W^T copy or None, the X^T copy or None).
        """
        with SideStream(x.device) as side:  # forked, W and X are quantized at the same time
            wq, wtq = (self.quantize_weight(weight, w_spec) if need_wt
                       else (self.quantize(weight, w_spec), None))
            # inline, operand_mm prepares W after X's copies exist: a lower peak of memory
            w = self.b_operand(wq, w_spec.block) if side.forked else wq
        xq, xtq, _ = self.gemm_operands(x, x_spec, xt_spec, seed, 0, 0, rht_signs, (True, False))
        side.join(w, wtq)
        return self.operand_mm(xq, w, w_spec.block, bias, out_dtype), wtq, xtq

    def linear_grads(self, dy: torch.Tensor, wt: Optional[NVFP4Data], xt: Optional[NVFP4Data],
                     w_block: str, dy_spec: OperandSpec, dyt_spec: OperandSpec,
                     dx_dtype: torch.dtype, dw_dtype: torch.dtype, seed: R.IntOrTensor = 0,
                     dy_offset: R.IntOrTensor = 0, dyt_offset: R.IntOrTensor = 0,
                     rht_signs: Optional[torch.Tensor] = None,
                     ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The dgrad and wgrad of an NVFP4 linear layer from dY (M, N).

        dgrad (when ``wt``, the W^T (K, N) copy with ``w_block`` blocks, is given):
        dX = Q(dY) @ (W^T)^T, dY quantized rowwise under ``dy_spec`` at SR offset ``dy_offset``.
        wgrad (when ``xt``, the X^T (K, M) copy, is given): dW = Q(dY^T) @ (X^T)^T, dY^T (N, M)
        quantized under ``dyt_spec`` at ``dyt_offset``. Returns (dX (M, K) of ``dx_dtype`` or None,
        dW (N, K) of ``dw_dtype`` or None).
        """
        with SideStream(dy.device) as side:  # W^T's preparation beside dY's passes
            if wt is not None and side.forked:
                wt = self.b_operand(wt, w_block)
        # X^T, wgrad's B, is prepared with dY's copies (the Triton backend: in the same pass)
        dyq, dytq, xt = self.gemm_operands(dy, dy_spec if wt is not None else None,
                                           dyt_spec if xt is not None else None, seed, dy_offset,
                                           dyt_offset, rht_signs, b=xt)
        side.join(wt)
        dx = None if dyq is None else self.operand_mm(dyq, wt, w_block, None, dx_dtype)
        del dyq  # frees dY's copy before the wgrad GEMM
        dw = None if dytq is None else self.operand_mm(dytq, xt, "1d", None, dw_dtype)
        return dx, dw


_BACKENDS = {"reference": Backend}
_INSTANCES = {}
_WARNED = set()


def register_backend(cls) -> type:
    """Class decorator: make a :class:`Backend` subclass selectable by its ``name``."""
    _BACKENDS[cls.name] = cls
    return cls


def warn_once(msg: str, key: Optional[str] = None) -> None:
    """Log a fallback warning once per ``key`` (default: the message) for the whole package."""
    key = msg if key is None else key
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg)


def _load(name: str) -> None:
    """Import the module that registers backend ``name`` (Triton may be missing off Linux)."""
    import importlib
    module = {"triton": "triton_backend", "native": "native"}.get(name)
    if module is not None and name not in _BACKENDS:
        try:
            importlib.import_module(f"{__package__}.{module}")
        except ImportError as e:  # reported by _available as "not built"
            log.debug("cannot import the %s backend: %s", name, e)


def _available(name: str, device: torch.device) -> Optional[str]:
    """None if backend ``name`` can run on ``device``, else the reason it cannot."""
    if name == "reference":
        return None
    _load(name)
    if name not in _BACKENDS:
        return f"the {name} backend is not built into this installation"
    if device.type != "cuda":
        import os
        if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return f"the {name} backend needs a CUDA device, got {device}"
    if name == "native" and torch.cuda.get_device_capability(device) < (10, 0):
        return "the native backend needs an sm100+ (Blackwell) GPU"
    return None


def get_backend(name: str, device: torch.device) -> Backend:
    """The backend for ``name`` ("auto", "reference", "triton", "native") on ``device``.

    "auto" picks native on sm100+, triton on other CUDA GPUs and reference elsewhere, falling back
    to the next one (with a warning logged once) when a backend is unavailable.

    Raises:
        ValueError: a backend named explicitly cannot run on ``device``.
    """
    device = torch.device(device)
    if name == "auto":
        order = ["native", "triton", "reference"] if device.type == "cuda" else ["reference"]
        for i, candidate in enumerate(order):
            why = _available(candidate, device)
            if why is None:
                break
            warn_once(f"NVFP4 backend {candidate!r} unavailable ({why}); falling back to {order[i + 1]!r}")
        name = candidate
    else:
        why = _available(name, device)
        if why is not None:
            raise ValueError(f"NVFP4 backend {name!r} cannot run here: {why}")
    if name not in _INSTANCES:
        _INSTANCES[name] = _BACKENDS[name]()
    return _INSTANCES[name]
