"""Backends: the implementations of NVFP4 quantization and the NVFP4 GEMM for a device.

- ``reference`` (:mod:`.reference`): plain PyTorch, any device; the spec.
- ``triton`` (:mod:`.triton`): fused Triton kernels (``kernels/``) for CUDA GPUs before Blackwell
  and, in tests, the Triton interpreter on CPU.
- ``native`` (:mod:`.native`): sm100+ FP4 tensor cores through ``torch._scaled_mm``.

A backend is the narrow set of primitives of :class:`Backend`, typed with :class:`QuantSpec` and
:class:`NVFP4Operand`; what a layer does with them (which operand is quantized how, which GEMM
runs on what) is ``gemms.py``'s. :func:`get_backend` resolves "auto" and logs a fallback once.
"""

import abc
import functools
import importlib
import importlib.util
import logging
import os
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from ..operand import GroupedOperand, NVFP4Operand
from ..spec import BackendName, QuantSpec
from .operators import register_methods

log = logging.getLogger("nvfp4_recipe")

IntOrTensor = Union[int, torch.Tensor]
# Called with the fp32 amax an operand's quantization measures (``reference.operand_amax``: a
# scalar or one per row; under amax estimation before its amax_scale factor) between the amax pass
# and the quantize pass; returns the amax to use instead (distributed.py: the max over the shards
# of a tensor-parallel operand). A tensor: the amax to use, the operand's own not measured (a
# fused group's shared weight amax); unlike a callable it crosses the operator boundary under
# torch.compile. None: the operand's own amax.
AmaxReduce = Optional[Union[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]


def reduced_amax(amax_reduce: AmaxReduce,
                 measured: Callable[[], torch.Tensor]) -> Optional[torch.Tensor]:
    """The amax a copy is quantized with under ``amax_reduce``: None (the copy's own, measured by
    the quantization) without one, the given tensor, or the callable applied to ``measured()``."""
    if amax_reduce is None or isinstance(amax_reduce, torch.Tensor):
        return amax_reduce
    return amax_reduce(measured())
NAMES = tuple(b.value for b in BackendName if b is not BackendName.AUTO)


class Backend(abc.ABC):
    """The primitives an NVFP4 layer is built from. Every backend gives the reference's bits for
    quantization and the reference's GEMM up to fp32 accumulation order.

    Operand convention: an operand is an :class:`NVFP4Operand` of a (rows, K) matrix with its blocks
    along K, so every GEMM is ``A @ B^T``. Every operand a primitive returns carries the spec it
    was quantized under (``NVFP4Operand.spec``; a prepared operand keeps its own) and says its form
    (``NVFP4Operand.form``: codes, or the inner values a ``transient`` copy may come back as). Seeds and offsets may be ints or device int64 scalars
    (nothing synchronises with the host). ``amax_reduce`` (:data:`AmaxReduce`, per copy) maps the
    amax an operand's outer scale is computed from to the one used, so that the shards of a
    tensor-parallel operand quantize with the whole tensor's amax.
    """

    name: str
    PRIMITIVES = ("quantize", "quantize_pair", "prepare_weight", "prepare", "transpose_2d", "mm",
                  "quantize_groups", "quantize_experts", "grouped_mm")
    # the primitives torch.compile traces into (triton_op) rather than keeps opaque (custom_op)
    traced: Tuple[str, ...] = ()
    # primitive -> fake of an opaque one whose body cannot run on fake tensors
    fakes: Dict[str, Callable] = {}
    # whether the quantize primitives run MS-EDEN specs (QuantSpec.ms_eden): the reference only,
    # until the Triton kernels do
    runs_ms_eden = False

    def check_spec(self, spec: QuantSpec) -> None:
        """Raises ValueError, naming the field, when this backend cannot quantize under ``spec``:
        an MS-EDEN spec (``QuantSpec.ms_eden``, from ``NVFP4Recipe.backward_estimator``) where
        :attr:`runs_ms_eden` is False."""
        if spec.ms_eden is not None and not self.runs_ms_eden:
            raise ValueError(f"the {self.name} backend does not run MS-EDEN yet "
                             f"(QuantSpec.ms_eden, from NVFP4Recipe.backward_estimator='ms_eden'); "
                             f"backend='reference' runs it")

    @abc.abstractmethod
    def quantize(self, x: torch.Tensor, spec: QuantSpec, *, seed: IntOrTensor = 0,
                 offset: IntOrTensor = 0, signs: Optional[torch.Tensor] = None,
                 amax_reduce: AmaxReduce = None) -> NVFP4Operand:
        """x (..., M, K) quantized along K under ``spec`` (``reference.quantize``)."""

    @abc.abstractmethod
    def quantize_pair(self, x: torch.Tensor, row: Optional[QuantSpec], col: Optional[QuantSpec], *,
                      seed: IntOrTensor = 0, row_offset: IntOrTensor = 0,
                      col_offset: IntOrTensor = 0, signs: Optional[torch.Tensor] = None,
                      transient: Tuple[bool, bool] = (False, False),
                      prepare: Optional[NVFP4Operand] = None,
                      amax_reduce: Tuple[AmaxReduce, AmaxReduce] = (None, None),
                      ) -> Tuple[Optional[NVFP4Operand], Optional[NVFP4Operand], Optional[NVFP4Operand]]:
        """The rowwise copy of x (M, K) under ``row`` and the columnwise copy (the quantization of
        x^T, (K, M), blocks along M) under ``col``, each None to skip, from one read of x where the
        backend fuses it.

        ``transient[i]``: copy i only feeds the :meth:`mm` that follows, so it may come back as
        inner values (``NVFP4Operand.values``) instead of codes. ``prepare``: a saved operand that
        a later :meth:`mm` takes as B; the backend may prepare it in the same pass (the Triton
        backend dequantizes it there). Returns (rowwise, columnwise, prepared ``prepare`` or None).
        """

    @abc.abstractmethod
    def prepare_weight(self, w: torch.Tensor, spec: QuantSpec, *, need_t: bool,
                       amax_reduce: AmaxReduce = None,
                       ) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
        """W (N, K) quantized under ``spec``, ready to be fprop's B in :meth:`mm`, and with
        ``need_t`` W^T (K, N) for dgrad, as codes (kept for backward): for 2d blocks the exact
        transpose of W's quantization, for 1d blocks W quantized along N. Both copies share the
        per-tensor amax (``amax_reduce`` applies to it)."""

    @abc.abstractmethod
    def prepare(self, b: NVFP4Operand) -> NVFP4Operand:
        """A saved operand made ready to be B in :meth:`mm` (the Triton backend: its inner values)."""

    @abc.abstractmethod
    def transpose_2d(self, b: NVFP4Operand) -> NVFP4Operand:
        """The exact transpose (K, N) of a 2d-blocked (N, K) operand in codes, packed along N:
        codes and tile scales moved, nothing requantized (``reference.transpose_2d``); dgrad's
        W^T of a weight that arrives quantized (FSDP2's FP4 all-gather)."""

    @abc.abstractmethod
    def mm(self, a: NVFP4Operand, b: NVFP4Operand, *, bias: Optional[torch.Tensor] = None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """D (M, N) = (s_a * s_b) * (A_inner @ B_inner^T) + bias for A (M, K), B (N, K)."""


    @abc.abstractmethod
    def quantize_groups(self, x: torch.Tensor, offs: torch.Tensor, row: Optional[QuantSpec],
                        col: Optional[QuantSpec], *, seed: IntOrTensor = 0,
                        row_offset: IntOrTensor = 0, col_offset: IntOrTensor = 0,
                        signs: Optional[torch.Tensor] = None,
                        transient: Tuple[bool, bool] = (False, False),
                        prepare: Optional[NVFP4Operand] = None,
                        ) -> Tuple[Optional[GroupedOperand], Optional[GroupedOperand],
                                   Optional[NVFP4Operand]]:
        """The rowwise copy of the token groups of x (T, K) under ``row`` and the columnwise
        copy (each group's x_g^T, blocks along its tokens) under ``col``, each None to skip; one
        outer scale per group (or per token). Groups end at ``offs`` (int32 (G,), on the device;
        ``grouped.check_offsets``); group g's SR counters start at ``offset + s_g * K / 16``.
        ``transient``/``prepare`` as in :meth:`quantize_pair` (``prepare``: a stacked expert
        operand, dgrad's W^T). Returns (rowwise, columnwise, prepared ``prepare`` or None).

        Raises:
            TypeError, ValueError: see ``grouped.check_quantize_args``.
        """

    @abc.abstractmethod
    def quantize_experts(self, w: torch.Tensor, spec: QuantSpec, *, need_t: bool,
                         transient: bool = False) -> Tuple[NVFP4Operand, Optional[NVFP4Operand]]:
        """Expert weights (G, N, K), each W_g quantized alone under ``spec`` (per-tensor, no
        RHT), and with ``need_t`` each W_g^T (2d: the exact transpose; 1d: W_g^T quantized along
        N): stacked operands (G, N, K) and (G, K, N), outer scales (G,). ``transient``: W only
        feeds the next :meth:`grouped_mm` and may come back as inner values.

        Raises:
            ValueError: see ``grouped.check_experts``.
        """

    @abc.abstractmethod
    def grouped_mm(self, a: GroupedOperand, b: Union[NVFP4Operand, GroupedOperand], *,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The grouped GEMM: with ``b`` a stacked (G, N, K) expert operand (fprop, dgrad),
        ``D[r] = s_a * s_b[g] * A_inner[r] @ B_inner[g]^T`` for the rows r of group g, (T, N);
        with ``b`` grouped along K like ``a`` (wgrad), ``D[g] = s_a * s_b * A_g @ B_g^T`` over
        each group's tokens, (G, M, N). Rows past the last group are zeros."""


def quantize_each(backend: Backend, x: torch.Tensor, row: Optional[QuantSpec],
                  col: Optional[QuantSpec], seed: IntOrTensor, row_offset: IntOrTensor,
                  col_offset: IntOrTensor, signs: Optional[torch.Tensor],
                  amax_reduce: Tuple[AmaxReduce, AmaxReduce] = (None, None)):
    """The rowwise and columnwise copies of :meth:`Backend.quantize_pair` as two
    ``backend.quantize`` calls (on x and x.t()), each None to skip."""
    r = None if row is None else backend.quantize(x, row, seed=seed, offset=row_offset, signs=signs,
                                                  amax_reduce=amax_reduce[0])
    c = None if col is None else backend.quantize(x.t(), col, seed=seed, offset=col_offset,
                                                  signs=signs, amax_reduce=amax_reduce[1])
    return r, c


_CLASSES = {}
_INSTANCES = {}
_WARNED = set()


def register_backend(cls) -> type:
    """Class decorator: make a :class:`Backend` subclass selectable by its ``name``, with its
    primitives registered as torch operators (``operators.py``: the compile boundary)."""
    _CLASSES[cls.name] = cls
    _INSTANCES[cls.name] = cls()
    register_methods(cls, _INSTANCES[cls.name], Backend.PRIMITIVES, cls.name, traced=cls.traced,
                     fakes=cls.fakes)
    return cls


def warn_once(msg: str, key: Optional[str] = None) -> None:
    """Log a fallback warning once per ``key`` (default: the message) for the whole package."""
    key = msg if key is None else key
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg)


# Triton is installed on Linux only (pyproject); the backends that need it are registered only
# where it is: the Triton backend (its kernels) and the native one (its grouped primitives run
# on the Triton backend's)
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
_NEEDS_TRITON = ("triton", "native")


def _load(name: str) -> Optional[str]:
    """Register backend ``name`` (import its module, and the Triton backend's for the native
    one); None once it is registered, else why it cannot be."""
    if name in _NEEDS_TRITON and not TRITON_INSTALLED:
        return (f"the {name} backend needs triton, which is not installed (pyproject installs it "
                f"on Linux only; pip install triton)")
    if name == "native":
        _load("triton")
    if name not in _CLASSES:
        importlib.import_module(f"{__name__}.{name}")
    return None


def _available(name: str, device: torch.device) -> Optional[str]:
    """None if backend ``name`` can run on ``device``, else the reason it cannot."""
    why = _load(name)
    if why is not None or name == "reference":
        return why
    if device.type != "cuda":
        if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return f"the {name} backend needs a CUDA device, got {device}"
    if name == "native" and torch.cuda.get_device_capability(device) < (10, 0):
        return "the native backend needs an sm100+ (Blackwell) GPU"
    return None


def resolved(name: str) -> Backend:
    """The backend registered as ``name``, a resolved name (:func:`get_backend`'s ``.name``): a
    dict lookup that torch.compile traces."""
    return _INSTANCES[name]


def get_backend(name: str, device: torch.device) -> Backend:
    """The backend for ``name`` ("auto", "reference", "triton", "native") on ``device``.

    "auto" picks triton on CUDA GPUs (Blackwell included, until the native backend has been tested
    on one) and reference elsewhere, falling back to the next one (with a warning logged once)
    when a backend is unavailable. "native" (sm100+ FP4 tensor cores) is opt-in and logs once
    that it is untested on hardware. The answer for a
    CUDA device is cached (a layer asks on every forward and backward); off CUDA it depends on
    ``TRITON_INTERPRET`` and is worked out each time.

    Raises:
        ValueError: an unknown name, or a backend named explicitly that cannot run on ``device``.
    """
    device = torch.device(device)
    if isinstance(name, BackendName):  # one cache entry and one spelling in messages per backend
        name = name.value
    if device.type == "cuda":
        return _cuda_backend(name, device)
    return _resolve(name, device)


def _resolve(name: str, device: torch.device) -> Backend:
    if name == "auto":
        order = ["triton", "reference"] if device.type == "cuda" else ["reference"]
        for i, candidate in enumerate(order):
            why = _available(candidate, device)
            if why is None:
                break
            warn_once(f"NVFP4 backend {candidate!r} unavailable ({why}); falling back to {order[i + 1]!r}")
        name = candidate
    elif name not in NAMES:
        raise ValueError(f"unknown NVFP4 backend {name!r}; expected 'auto' or one of {NAMES}")
    else:
        why = _available(name, device)
        if why is not None:
            raise ValueError(f"NVFP4 backend {name!r} cannot run here: {why}")
        if name == "native":
            warn_once("NVFP4 backend 'native' (FP4 tensor-core GEMMs on Blackwell) has not run on a "
                      "Blackwell GPU yet: its results are untested; backend='triton' runs the tested "
                      "kernels there", key="native-untested")
    return _INSTANCES[name]


_cuda_backend = functools.lru_cache(maxsize=None)(_resolve)
