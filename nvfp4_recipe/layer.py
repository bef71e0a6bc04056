"""The base of every NVFP4 module: :class:`NVFP4Module`, shared by ``NVFP4Linear`` (and
``NVFP4Conv1D``), the experts modules of ``moe.py`` and the frozen ``NVFP4FrozenLinear``.

What a module that runs in NVFP4 keeps and does besides its parameters, written once:

- the recipe (a frozen :class:`NVFP4Recipe`) and a layer seed, from which the buffers come:
  ``rht_signs`` (16,) float32, and per SR stream (one per projection) ``sr_seed`` and ``sr_step``
  int64, saved in the state dict; a checkpoint without them (the high-precision module's) keeps
  the module's own, and moving off the meta device (``to_empty``) sets them;
- ``sr_rank``, the data-parallel rank folded into the SR keys (``distributed.set_sr_rank``);
- the SR key of a backward (:func:`next_sr_key`);
- the fprop weight operands kept inside :func:`cached_weights`;
- the operands recorded by ``inspect.capture`` and ``inspect.QuantStats`` (``captured``, a
  :class:`Recording`, filled by :meth:`NVFP4Module._capture`);
- the conversion from the high-precision module it replaces (:meth:`NVFP4Module.from_module`)
  and back (:meth:`NVFP4Module.dequantize`, which ``dequantize_`` calls);
- the check that its GEMM dimensions are whole blocks of 16 (:func:`check_sizes`).
"""

import contextlib
import weakref
import zlib
from contextvars import ContextVar
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Tuple

import torch
from torch import nn

from . import quantizers
from .backends import TRITON_INSTALLED, get_backend, resolved
from .backends.operators import autocast_disabled
from .formats import BLOCK
from .operand import NVFP4Operand
from .quantizers import OperandQuantizer, TensorQuantizer, Usage
from .recipe import NVFP4Recipe
from .tensor import NVFP4Tensor
from .tracing import tracing

if TRITON_INSTALLED:  # a backward's SR key in one launch on CUDA; torch ops without Triton
    from .kernels.philox import next_key

__all__ = ["NVFP4Module", "cached_weights", "layer_seed", "sr_key", "next_sr_key", "out_dtype", "backend_name",
           "training", "local", "size_problem", "check_sizes", "DenseRecorder"]

_BUFFERS = ("rht_signs", "sr_seed", "sr_step")
# the modules that cached a weight in the innermost cached_weights() context, None outside one
_CACHING: ContextVar[Optional[weakref.WeakSet]] = ContextVar("nvfp4_cached_weights", default=None)


@contextlib.contextmanager
def cached_weights() -> Iterator[None]:
    """Within this context each NVFP4 module (``NVFP4Linear`` and the experts modules) quantizes
    each weight once and reuses the result in every forward that records no autograd graph
    (evaluation under ``torch.no_grad()``, ``generate()``), instead of quantizing the master
    weight on every call.

    The outputs are those of uncached forwards, bit for bit: the weight's quantization is
    round-to-nearest (no random bits), and a module quantizes again when its weight is another
    tensor or has a new version (any in-place update through the tensor: an optimizer step,
    ``load_state_dict``, ``copy_``). Use it around evaluation or generation, not around training
    steps: updates that bypass the version counter (writes through ``weight.data``, FSDP2's
    all-gathers into its unsharded parameters) are not seen. Forwards that record autograd
    (training), torch.compile tracing, CUDA-graph capture and tensor-parallel layers do not use
    the cache. Each module holds its fprop weight operands (fp16 inner values on sm89+ GPUs, 2
    bytes an element; codes and scales elsewhere, 0.5625) until the context exits. The same idea
    as TransformerEngine's ``is_first_microbatch`` and ``torch.nn.utils.parametrize.cached()``.

    Example::

        with torch.no_grad(), nvfp4_recipe.cached_weights():
            model.generate(input_ids, max_new_tokens=64)
    """
    modules = weakref.WeakSet()
    token = _CACHING.set(modules)
    try:
        yield
    finally:
        _CACHING.reset(token)
        for module in modules:
            module._weight_cache = {}


def layer_seed(fqn: str) -> int:
    """A layer's SR stream key from its fully qualified name, the same in every process:
    ``crc32(fqn)`` (``quantize_`` and ``load_frozen`` give each layer its own stream)."""
    return zlib.crc32(fqn.encode())


def sr_key(sr_seed: torch.Tensor, sr_step: torch.Tensor, sr_rank: int = 0) -> torch.Tensor:
    """The 64-bit Philox key of a backward's SR stream: ``sr_seed + sr_rank + (sr_step << 32)``,
    an int64 device scalar (no host sync). Distinct for every (rank, step) of a stream, since
    ``sr_seed`` and ``sr_rank`` are below 2**32; ``sr_rank`` 0 (one process) adds nothing."""
    key = torch.add(sr_seed, sr_step, alpha=1 << 32)  # one kernel
    return key + sr_rank if sr_rank else key


def next_sr_key(sr_seed: torch.Tensor, sr_step: torch.Tensor, sr_rank: int = 0) -> torch.Tensor:
    """A backward's SR key, :func:`sr_key` of the counters as they are, and ``sr_step`` advanced by
    one in place (a mutation torch.compile and CUDA graphs keep). On a GPU in eager mode with
    Triton installed one small kernel does both (``kernels.philox.next_key``): the launches saved
    are host time in a host-bound backward; elsewhere torch ops, also while torch.compile traces
    (its backward graph too), which fuses them and keeps the mutation as an ordinary in-place op."""
    if TRITON_INSTALLED and sr_step.is_cuda and not (torch.compiler.is_compiling() or tracing()):
        return next_key(sr_seed, sr_step, sr_rank)
    key = sr_key(sr_seed, sr_step, sr_rank)
    sr_step.add_(1)
    return key


def autocast_off(device_type: str):
    """The context the layers run their GEMMs in: autocast off where it is on, so that every operand
    keeps the dtype the layer chose for it (autocast would recast the high-precision GEMMs' inputs
    and the reference backend's arithmetic). Nothing is entered while torch.compile traces: Dynamo
    records an autocast switch as a call in the graph, and AOTAutograd's cache refuses such graphs,
    so every process would trace the layers again. There the primitives' bodies switch autocast off
    themselves (``backends.operators.register``), and the traced code between them casts
    explicitly to the dtypes autocast would pick."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return autocast_disabled(device_type)


def out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would return: the autocast dtype when autocast is on, else x.dtype."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


@torch.compiler.assume_constant_result
def backend_name(name: str, device: torch.device) -> str:
    """The backend that runs on ``device``, resolved in Python even under torch.compile (it may
    import a backend module and log a fallback, neither of which belongs in a graph)."""
    return get_backend(name, device).name


def training(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a layer call records autograd: grad mode on and a tensor requiring grad (else it
    runs fprop only, for any token count)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (``parallelize_module`` replicates a module's buffers), else t."""
    return t.to_local() if hasattr(t, "to_local") else t


def size_problem(sizes: Dict[str, int]) -> Optional[str]:
    """Why an NVFP4 layer cannot have these GEMM dimensions (``{name: size}``; NVFP4 quantizes
    every one of them in blocks of 16): ``"name=size is not a positive multiple of 16"`` for the
    first that is not, None if every one is."""
    return next((f"{name}={n} is not a positive multiple of {BLOCK}" for name, n in sizes.items()
                 if n <= 0 or n % BLOCK), None)


def check_sizes(layer: str, sizes: Dict[str, int]) -> None:
    """Raises ValueError, ``"<layer>: <name>=<size> is not a positive multiple of 16"``, for the
    first of ``sizes`` (:func:`size_problem`) an NVFP4 layer cannot have."""
    problem = size_problem(sizes)
    if problem is not None:
        raise ValueError(f"{layer}: {problem}")


def nvfp4_operands(recipe: NVFP4Recipe) -> Tuple[str, ...]:
    """The operands a layer's GEMMs take in NVFP4 under ``recipe``, by the names ``inspect``
    records them under: "w", "x" (fprop), "xt" (wgrad), "dy", "dyt" (dgrad, wgrad), without those
    of the GEMMs ``forward_override`` / ``backward_override`` take out of NVFP4, nor those an
    MS-EDEN backward (``backward_estimator``) quantizes under its per-step rotation (not
    recorded)."""
    fprop = () if recipe.forward_override else ("w", "x")
    backward = recipe.backward_override or recipe.backward_estimator
    return fprop + (() if backward else ("xt", "dy", "dyt"))


class Recording:
    """Where a module records the operands of its GEMMs while ``inspect`` asks it to.

    ``store`` holds ``{name: keep(hp, q)}`` for a linear and ``{projection: {name: [one per
    expert or token group]}}`` for an experts module, where ``hp`` is the high-precision operand
    (rows, K) as the GEMM takes it (before the RHT) and ``q`` its :class:`NVFP4Tensor` (the bits
    the GEMM used, and ``q.spec``): ``inspect.capture`` keeps ``q``, ``inspect.QuantStats``
    statistics of the pair.
    """

    def __init__(self, keep: Callable[[torch.Tensor, object], object]):
        self.store: Dict[str, object] = {}
        self.keep = keep


class DenseRecorder(NamedTuple):
    """How a dense layer (``NVFP4Linear``, ``NVFP4FrozenLinear``) records its operands for
    :meth:`NVFP4Module._capture`: each copy quantized again on its own by ``Backend.quantize`` with
    its quantizer's spec, signs, SR stream and amax (the bits its GEMM used), as an
    :class:`NVFP4Tensor` kept by ``keep(hp, q)`` (:class:`Recording`).

    Fields:
        backend: the resolved backend name the layer's GEMMs ran on.
        keep: ``Recording.keep``.
    """

    backend: str
    keep: Callable[[torch.Tensor, object], object]

    def weight(self, w: torch.Tensor, q: OperandQuantizer) -> object:
        """W (N, K) quantized along K by ``q``, kept."""
        return self._kept(w, q)

    def tokens(self, t: torch.Tensor, q: TensorQuantizer) -> Tuple[object, object]:
        """(t (M, K) quantized by ``q.rowwise``, t^T (K, M) by ``q.columnwise``), each kept, or
        None where ``q`` has no such copy."""
        return (q.rowwise and self._kept(t, q.rowwise),
                q.columnwise and self._kept(t.t(), q.columnwise))

    def _kept(self, t: torch.Tensor, q: OperandQuantizer) -> object:
        op = resolved(self.backend).quantize(t, q.spec, seed=q.seed, offset=q.offset, signs=q.signs,
                                             amax_reduce=quantizers.amax_reducer(q))
        return self.keep(t, NVFP4Tensor.from_operand(op, t.dtype, q.signs, self.backend))


def _record(store: dict, recorder, t: torch.Tensor, q: TensorQuantizer,
            names: Tuple[str, str]) -> None:
    """``store[names[i]]`` = the rowwise (0) and columnwise (1) copies of ``t`` that ``q`` asks for,
    recorded by ``recorder.tokens`` (every copy as codes: ``quantizers.inspected``)."""
    q = quantizers.inspected(q)
    if q.rowwise or q.columnwise:
        for name, kept in zip(names, recorder.tokens(t, q)):
            if kept is not None:
                store[name] = kept


class NVFP4Module(nn.Module):
    """The state every NVFP4 module shares (see the module docstring).

    A subclass sets ``STREAMS``: None for one SR stream with 0-d ``sr_seed`` / ``sr_step`` buffers
    (``NVFP4Linear``, its checkpoint layout), or the projection names, one stream each, with (P,)
    buffers whose seeds add ``crc32(name)``. Its constructor calls :meth:`_init_nvfp4` once the
    parameters exist; a module converted from a high-precision one is made by
    :meth:`from_module` instead, which calls the subclass's :meth:`_adopt`. Every subclass gives
    ``dequantize_`` its high-precision module (:meth:`dequantize`).

    Buffers: ``rht_signs`` (16,) float32, the recipe's RHT signs; ``sr_seed``, the Philox key of a
    stream (low 32 bits): ``(recipe.seed + layer_seed [+ crc32(projection)]) mod 2**32``;
    ``sr_step``, advanced by each backward of the stream, whose key is ``sr_seed + sr_rank +
    (sr_step << 32)`` (:func:`sr_key`) with the value before the advance.
    """

    STREAMS: Optional[Tuple[str, ...]] = None
    # from_module keeps the module converted from, which dequantize() gives back (not a submodule:
    # no second state-dict entry); None for a module built directly
    _original: Optional[nn.Module] = None
    # whether from_module keeps that module; NVFP4Linear builds a new nn.Linear instead, since the
    # old one would keep alive the Parameters that FSDP2 replaces with its shards
    KEEPS_ORIGINAL = True
    # the GEMMs whose operands _capture records (inspect): fprop, dgrad and wgrad
    RECORDED = Usage(dgrad=True, wgrad=True)

    @classmethod
    def from_module(cls, module: nn.Module, recipe: Optional[NVFP4Recipe] = None,
                    layer_seed: int = 0) -> "NVFP4Module":
        """The NVFP4 module of a high-precision ``module`` (what ``quantize_`` swaps in): holding
        ``module``'s Parameters themselves (an optimizer built before keeps training them), with
        the recipe state of ``recipe`` (default ``NVFP4Recipe()``) and ``layer_seed`` on their
        device, in ``module``'s train mode; :meth:`dequantize` gives the high-precision module
        back.

        Raises:
            ValueError: a size of ``module`` that is not a positive multiple of 16
                (:func:`check_sizes`, naming the layer and the dimension).
            TypeError: this class is not made from a module (:meth:`_adopt`).
        """
        # not cls(...): a constructor makes Parameters of its own (allocated, initialized with
        # random draws) and the recipe state, which is made once, below
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._adopt(module)
        new._init_nvfp4(recipe, layer_seed, next(module.parameters()).device)
        if cls.KEEPS_ORIGINAL:
            object.__setattr__(new, "_original", module)
        new.train(module.training)
        return new

    def _adopt(self, module: nn.Module) -> None:
        """Take ``module``'s sizes and Parameters (the same objects), and whatever else its forward
        uses, into this bare module (``nn.Module.__init__`` run, nothing else) for
        :meth:`from_module`; checks the sizes (:func:`check_sizes`).

        Raises:
            TypeError: in this base, and in a subclass not made from another module.
        """
        raise TypeError(f"{type(self).__name__} is not made from a high-precision module")

    def dequantize(self) -> nn.Module:
        """The high-precision module ``dequantize_`` puts in this one's place: here the module this
        one was made from (:meth:`from_module`), holding this module's Parameters as they are now
        (``to_empty`` and FSDP2 replace Parameters), in this module's train mode.

        Raises:
            ValueError: the module was built directly, not converted from one.
        """
        if self._original is None:
            raise ValueError(f"this {type(self).__name__} was built directly; there is no "
                             f"high-precision module to return")
        for name, _ in list(self._original.named_parameters(recurse=False)):
            setattr(self._original, name, getattr(self, name))
        self._original.train(self.training)
        return self._original

    def _init_nvfp4(self, recipe: Optional[NVFP4Recipe], layer_seed: int, device) -> None:
        """Set the recipe, the layer seed and ``sr_rank`` = 0, and register the buffers on
        ``device``."""
        self.recipe = recipe if recipe is not None else NVFP4Recipe()
        self.layer_seed = layer_seed
        self.sr_rank = 0
        self.captured: Optional[Recording] = None  # while inspect records this module
        self._weight_cache: Dict[str, tuple] = {}
        shape = () if self.STREAMS is None else (len(self.STREAMS),)
        self.register_buffer("rht_signs", torch.empty(BLOCK, dtype=torch.float32, device=device))
        self.register_buffer("sr_seed", torch.empty(shape, dtype=torch.int64, device=device))
        self.register_buffer("sr_step", torch.empty(shape, dtype=torch.int64, device=device))
        self.reset_recipe_buffers()

    def _stream_seeds(self) -> torch.Tensor:
        base = self.recipe.seed + self.layer_seed
        if self.STREAMS is None:
            return torch.tensor(base & 0xFFFFFFFF)
        return torch.tensor([(base + zlib.crc32(p.encode())) & 0xFFFFFFFF for p in self.STREAMS])

    @torch.no_grad()
    def reset_recipe_buffers(self) -> None:
        """Set ``rht_signs``, ``sr_seed`` and ``sr_step`` (in place) to a new module's values."""
        local(self.rht_signs).copy_(self.recipe.signs())
        local(self.sr_seed).copy_(self._stream_seeds())
        local(self.sr_step).zero_()

    def sr_state(self, stream: int = 0) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """(sr_seed, sr_step, sr_rank) of SR stream ``stream``: 0-d views of the buffers (the
        backward advances the step in place) and the data-parallel rank."""
        seed, step = local(self.sr_seed), local(self.sr_step)
        if self.STREAMS is not None:
            seed, step = seed[stream], step[stream]
        return seed, step, self.sr_rank

    def _apply(self, fn, recurse=True):
        # to_empty (materializing a meta-device model) gives the buffers uninitialized memory
        was_meta = self.sr_step.is_meta
        self._weight_cache = {}
        super()._apply(fn, recurse)
        if was_meta and not self.sr_step.is_meta:
            self.reset_recipe_buffers()
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # a checkpoint of the high-precision module has no recipe buffers: keep this module's own
        for name in _BUFFERS:
            state_dict.setdefault(prefix + name, getattr(self, name))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def check_recipe(self, recipe: NVFP4Recipe) -> None:
        """Raises ValueError when this module cannot run ``recipe`` (``set_recipe`` asks every
        module before it changes any); every recipe by default."""

    def recipe_repr(self) -> str:
        """The recipe as module reprs and ``summary`` show it: ``recipe=nvfp4(...), backend=...``."""
        r = self.recipe
        parts = ["rht" if r.rht else "no-rht", "sr" if r.stochastic_rounding else "rn",
                 "2d-weights" if r.weight_2d else "1d-weights", r.scaling.value]
        if r.amax_estimation:
            parts.append(f"amax-est{r.amax_estimation}")
        if r.four_over_six:
            parts.append(f"4/6-{r.four_over_six.value}({r.four_over_six_error.value}, "
                         f"{r.four_over_six_e4m3_max}{', fast-math' if r.four_over_six_fast_math else ''})")
        parts += [f"{direction}-{o.value}" for direction, o in (
            ("fwd", r.forward_override), ("bwd", r.backward_override)) if o is not None]
        if r.backward_estimator:
            parts.append(f"bwd-{r.backward_estimator.value}({r.ms_eden_rotation})")
        return f"recipe=nvfp4({', '.join(parts)}), backend={r.backend.value}"

    def cached_operand(self, name: str, weight: torch.Tensor, backend: str,
                       make: Callable[[], NVFP4Operand], depends: tuple = ()) -> Optional[NVFP4Operand]:
        """Weight ``name`` quantized for fprop by ``make()``, kept inside :func:`cached_weights`
        (made again for another weight tensor, version, backend or ``depends``: what else the
        quantization reads, e.g. the versions of a fused group's weights), or None where the
        cache does not apply (outside the context, while tracing or capturing a CUDA graph)."""
        if torch.compiler.is_compiling() or tracing():  # first: Dynamo cannot trace a ContextVar
            return None
        modules = _CACHING.get()
        if modules is None or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        hit = self._weight_cache.get(name)
        key = (weight._version, backend, depends)
        if hit is None or hit[0] is not weight or hit[1:4] != key:
            hit = self._weight_cache[name] = (weight, *key, make())
            modules.add(self)
        return hit[4]

    def _capture(self, stream: int, x: torch.Tensor, w: Optional[torch.Tensor], y: torch.Tensor,
                 recorder, weight_amax: Optional[torch.Tensor] = None) -> None:
        """Record the NVFP4 operands of this call's GEMMs in ``self.captured`` (a
        :class:`Recording`; under the projection's name where ``STREAMS`` names them): those of
        :func:`nvfp4_operands` that the :data:`RECORDED` GEMMs take. W and X now, X^T too where
        autograd records the call (``y`` requires grad) and the tokens fill blocks of 16; dY and
        dY^T when the gradient of ``y`` arrives. Each is quantized again with the call's spec,
        signs, SR key of stream ``stream`` (taken now, before the backward advances it) and amax
        (``weight_amax``: W's, as fprop took it), so it holds the bits the GEMM used;
        ``recorder`` (:class:`DenseRecorder`, ``moe.GroupedRecorder``) quantizes and keeps each
        (``weight(w, q)``, ``tokens(t, q)``). ``w`` None: no weight to record (a frozen one)."""
        r, signs = self.recipe, local(self.rht_signs)
        names = nvfp4_operands(r)
        store = self.captured.store
        if self.STREAMS is not None:
            store = store.setdefault(self.STREAMS[stream], {})
        fwd = quantizers.build(r, signs, self.RECORDED, weight_amax=weight_amax)
        wgrad = y.requires_grad and x.shape[0] % BLOCK == 0  # X^T only where the call makes it
        with torch.no_grad(), autocast_off(x.device.type):
            if w is not None and "w" in names:
                store["w"] = recorder.weight(w.detach(), fwd.w.rowwise)
            _record(store, recorder, x.detach(), TensorQuantizer(
                fwd.x.rowwise if "x" in names else None,
                fwd.x.columnwise if "xt" in names and wgrad else None), ("x", "xt"))
        if y.requires_grad and "dy" in names:
            seed = sr_key(*self.sr_state(stream))

            def record_dy(dy: torch.Tensor) -> None:
                q = quantizers.build(r, signs, self.RECORDED, dy=tuple(dy.shape), sr_key=seed).dy
                with torch.no_grad(), autocast_off(dy.device.type):
                    _record(store, recorder, dy, q, ("dy", "dyt"))
            y.register_hook(record_dy)
