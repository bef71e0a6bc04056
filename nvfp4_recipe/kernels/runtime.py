"""The kernels' runtime layer: where they run and how they are launched.

The interpreter flag (``TRITON_INTERPRET=1``, read once at import as ``triton.jit`` reads it),
device queries cached per device (the SM count sizes persistent grids; the compute capability picks
hardware paths), the check that tensors can run the kernels at all, scalar arguments given by value
or as device pointers, the allocation of kernel outputs (:func:`empty`), the autotuner's tile
pruning, and :class:`Launcher`, which launches a compiled kernel with a few microseconds of host
time, or, while torch.compile traces a ``triton_op`` (``backends/operators.py``), records the
launch with ``wrap_triton`` so that Inductor calls the kernel itself.
Imports nothing from the package but ``tracing`` (which Triton-free code shares), and changes
nothing outside it at import.
"""

import functools
import inspect
import logging
import os
import re
from typing import Callable, Dict, Tuple, Union

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton import knobs
from triton.runtime.autotuner import Autotuner

from ..tracing import tracing

log = logging.getLogger(__name__)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETED = tl.constexpr(_INTERPRET)  # the same, for @triton.jit code's compile-time branches


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints. Host code uses this, not ``triton.cdiv``: that is a Triton
    ``constexpr_function`` whose call costs about 1.5 µs of host time, and a layer's fwd+bwd
    computes a few dozen grid sizes."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), in plain Python (see :func:`cdiv`)."""
    return 1 << max(n - 1, 0).bit_length()


def interpreting() -> bool:
    """Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRET


@functools.lru_cache(maxsize=None)
def _cuda_props(device: torch.device):
    """``torch.cuda.get_device_properties`` of a CUDA ``device``, cached: the uncached query costs
    several µs of host time, and a layer's fwd+bwd asks a dozen times."""
    return torch.cuda.get_device_properties(device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, the size of a persistent grid (4 under the
    interpreter or off CUDA)."""
    if interpreting() or device.type != "cuda":
        return 4
    return _cuda_props(device).multi_processor_count


def capability(device: torch.device) -> Tuple[int, int]:
    """(major, minor) compute capability of a CUDA ``device``."""
    props = _cuda_props(device)
    return props.major, props.minor


def has_e4m3_convert(device: torch.device) -> bool:
    """Whether ``device`` converts E4M3 to fp16 in hardware (CUDA sm89+), which the inline-PTX
    dequantization and the quantize kernels' inner-value output need."""
    return device.type == "cuda" and capability(device) >= (8, 9)


def inner_values_supported(device: torch.device) -> bool:
    """Whether the quantize kernels can write fp16 inner values on ``device`` (E4M3 conversion,
    or the interpreter)."""
    return interpreting() or has_e4m3_convert(device)


def ptx_dequant(device: torch.device) -> bool:
    """Whether the kernels can use the inline-PTX dequantization (a GPU with E4M3 conversion)."""
    return not interpreting() and has_e4m3_convert(device)


def check_runnable(device: torch.device) -> None:
    """Raise ValueError unless the kernels can run on ``device`` (CUDA, or the interpreter)."""
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton NVFP4 kernels need CUDA tensors (or TRITON_INTERPRET=1 to run "
                         f"them in the Triton interpreter), got tensors on {device}")


def tuning() -> bool:
    """Whether the quantize and amax kernels try their tile configs at a shape's first launch
    (``NVFP4_AUTOTUNE=1``). By default each launch takes the first config that fits (the lists
    lead with those measured fastest on an H200): the same step times, and a first step without
    a compile and a timing run per config."""
    return os.environ.get("NVFP4_AUTOTUNE") == "1"


_AUTOTUNE_PARAMS = inspect.signature(triton.autotune).parameters


def autotune(configs, key, prune):
    """``triton.autotune(configs, key, prune_configs_by={"early_config_prune": prune})``, with
    the tuned configs cached on disk across processes (``cache_results``, where this Triton has
    it), so that a later run with NVFP4_AUTOTUNE=1 tunes nothing twice."""
    cache = {"cache_results": True} if "cache_results" in _AUTOTUNE_PARAMS else {}
    return triton.autotune(configs=configs, key=key,
                           prune_configs_by={"early_config_prune": prune}, **cache)


def prune_wide_tiles(tile_cols, lead=None):
    """An autotune ``early_config_prune``: drops the configs whose tile spans more columns
    (``tile_cols(config)``) than the matrix's K rounded up to a power of two (at least 128), whose
    lanes would mostly be masked off (e.g. K = 512 in a small model), keeping at least the last
    config; keeps only the first survivor unless :func:`tuning`. ``lead(config, args)``, given,
    moves the configs it holds true for to the front for a launch's arguments (positional and
    keyword, by name): a first config for one mode of a kernel."""
    def prune(configs, named_args, **kwargs):
        if lead is not None:
            args = {**named_args, **kwargs}
            configs = sorted(configs, key=lambda c: not lead(c, args))  # stable
        width = max(128, next_pow2(named_args["K"]))
        fit = [c for c in configs if tile_cols(c) <= width] or list(configs[-1:])
        return fit if tuning() else fit[:1]
    return prune


def empty(shape: Tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` for a kernel's output; a 0-d one is a view
    of one element. Inductor makes an empty buffer as a fill over zero iterations, which for a 0-d
    shape is one iteration: every 0-d ``torch.empty`` in a compiled graph would cost a kernel
    launch (the quantize kernels' per-tensor outer scales: five per linear layer and step)."""
    if len(shape) == 0:
        return torch.empty(1, dtype=dtype, device=device).view(())
    return torch.empty(shape, dtype=dtype, device=device)


def scalar(v: Union[int, torch.Tensor], device) -> Tuple[Union[int, torch.Tensor], bool]:
    """A seed/offset as a kernel argument: an int by value, a tensor as a device pointer. While
    torch.compile traces, an int beyond int32 (the wgrad SR offset 2**31) also becomes a device
    scalar: Inductor (torch 2.11) fails on such a constant argument of a user kernel."""
    if isinstance(v, int) and not -2**31 <= v < 2**31 and tracing():
        v = torch.tensor(v, dtype=torch.int64, device=device)
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype.is_floating_point:
            raise TypeError(f"seeds and offsets must be ints or one-element integer tensors, got {v}")
        return v.to(device=device, dtype=torch.int64, non_blocking=True).reshape(()), True
    return int(v), False


@triton.jit
def scalar_arg(arg, IS_PTR: tl.constexpr):
    """A scalar kernel argument given either by value or as a pointer to a device scalar."""
    if IS_PTR:
        return tl.load(arg)
    else:
        return arg


_TENSOR = torch.Tensor


def launch_key(args: tuple, kwargs: dict) -> tuple:
    """The :class:`Launcher` cache key of a launch: per tensor argument its dtype, 16-byte alignment
    and device (what Triton specializes a binary on; binaries are per device), every other
    argument by type and value (finer than Triton's specialization of ints, which also makes an
    autotuner's key arguments exact), then the keyword constexprs. One comprehension: it runs on
    every launch."""
    key = tuple([(a.dtype, not a.data_ptr() & 15, a.get_device()) if isinstance(a, _TENSOR)
                 else (type(a), a) for a in args])
    return key + tuple(kwargs.items()) if kwargs else key


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """A Triton allocator: ``size`` bytes of global scratch from torch's caching allocator on the
    current device, stream-ordered on the current stream as the launch is. ``alignment`` (128 for
    TMA descriptors) is met without asking: the allocator's blocks start at multiples of 512."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_scratch_allocator(*args, **kwargs) -> None:
    """Make :func:`_scratch` Triton's allocator in the calling context (``triton.set_allocator``:
    a ContextVar, so per thread). A ``pre_run_hook`` of the kernels that need global scratch, so
    that it runs in whichever thread launches them through Triton: autograd's backward thread, or
    the one where torch.compile's aot_eager backend runs a recorded launch."""
    triton.set_allocator(_scratch)


# The Triton versions whose CompiledKernel.run takes (gridX, gridY, gridZ, stream, function,
# packed_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, *kernel_args), as their
# CompiledKernel.__getitem__ calls it.
_RUN_ABI_VERSIONS = ((3, 6), (3, 7))


def run_abi_known(version: str) -> bool:
    """Whether Triton ``version`` (``triton.__version__``, e.g. "3.7.1" or "3.6.0+git1234") is one
    whose private ``CompiledKernel.run`` signature :func:`_run_compiled` calls."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and (int(match[1]), int(match[2])) in _RUN_ABI_VERSIONS


@functools.lru_cache(maxsize=None)
def direct_launch() -> bool:
    """Whether :class:`Launcher` may call compiled kernels directly (:func:`run_abi_known` of the
    installed Triton); decided at the first launch, logged at debug level when not."""
    if run_abi_known(triton.__version__):
        return True
    log.debug("Triton %s: unknown CompiledKernel.run signature, every kernel launches through "
              "kernel[grid]", triton.__version__)
    return False


def _run_compiled(compiled, grid: tuple, stream: int, args: tuple, tail: tuple) -> None:
    """Launch ``compiled`` on ``grid`` (3 ints) and ``stream`` as ``compiled[grid](*args, *tail)``
    does, without its per-call closure and stream object. Triton's private ABI: only called where
    :func:`direct_launch` holds; launch hooks are passed as None (the caller checks there are
    none)."""
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)


def _launch_hooks() -> bool:
    """Whether a launch hook is installed (a HookChain with calls in newer Triton, a callable or
    None in older ones)."""
    hook = knobs.runtime.launch_enter_hook
    return bool(getattr(hook, "calls", hook))


def _tensor_device(args: tuple) -> int:
    """The CUDA device index of the first tensor among a launch's arguments."""
    return next(a.get_device() for a in args if isinstance(a, _TENSOR))


class Launcher:
    """Launches a ``@triton.jit`` kernel, autotuned or not, through a cache of its compiled binaries.

    ``Launcher(kernel)[grid](*args, **constexprs)`` launches like ``kernel[grid](...)``: the first
    launch for a key goes through Triton (compiling and, for an autotuned kernel, tuning), and keeps
    the compiled kernel and the chosen config; later launches with the same key call the compiled
    kernel directly (:func:`_run_compiled`; every launch goes through Triton where
    :func:`direct_launch` says its ABI is unknown). The key (:func:`launch_key`) is at least as fine
    as what Triton specializes on and what an autotuner tunes on, so a cached binary is only reused
    where Triton would reuse it; the cache is emptied when it reaches ``MAX_KEYS`` keys (scalars
    keyed by value, such as a from_hp seed that changes on every call, would grow it without end).
    This skips Triton's per-launch argument binding and the autotuner's dispatch, the bulk of a
    small layer's host time. ``grid`` is a tuple or a function of the config's meta-parameters.
    Under the interpreter every launch goes through Triton; while torch.compile traces, through
    ``wrap_triton`` (Inductor then compiles, tunes and launches the kernel from its own code).
    Positional arguments are the kernel's leading parameters; keyword arguments are constexprs or
    launch options (``num_warps``). A launch returns the compiled kernel (None while tracing).
    Tensors on another GPU than the current one (a model split over GPUs in one process) are
    launched on their own device, as torch's operators are.

    ``needs_scratch=True`` (a kernel that needs global scratch, such as device-side TMA
    descriptors): every launch makes :func:`_scratch` Triton's allocator in the launching thread
    first (``triton.set_allocator``), directly on a cached launch and through a ``pre_run_hook``
    added to the kernel for launches through Triton, those of a launch torch.compile recorded
    included.
    """

    MAX_KEYS = 4096

    def __init__(self, kernel, needs_scratch: bool = False):
        self.kernel = kernel
        self.needs_scratch = needs_scratch
        self._cache: Dict[tuple, tuple] = {}
        jit = kernel.fn if isinstance(kernel, Autotuner) else kernel
        if needs_scratch:
            jit.add_pre_run_hook(_set_scratch_allocator)
        if not interpreting():  # the interpreter's kernels have no parameter list to read
            self._names = [p.name for p in jit.params]

    def __getitem__(self, grid) -> Callable:
        return functools.partial(self._launch, grid)

    def clear(self) -> None:
        """Forget the cached binaries, so that the next launch of every key goes through Triton
        again: after an autotuner's configs changed (``benchmarks/sweep_quantize.py``)."""
        self._cache.clear()

    def compiled(self, *args, **kwargs):
        """The compiled kernel that a launch with these arguments calls, for inspection
        (``asm["ptx"]``, ``n_regs``): None before such a launch, under the interpreter, or where
        :func:`direct_launch` does not hold (no binaries are kept then)."""
        hit = self._cache.get(launch_key(args, kwargs))
        return None if hit is None else hit[0]

    def _launch(self, grid, *args, **kwargs):
        if tracing():
            if interpreting():  # the fake pass of an opaque operator: outputs are allocated
                return None
            return wrap_triton(self.kernel)[grid](*args, **kwargs)
        if interpreting():
            return self.kernel[grid](*args, **kwargs)
        key = launch_key(args, kwargs)
        hit = self._cache.get(key)
        device = hit[3] if hit is not None else _tensor_device(args)
        if device != torch._C._cuda_getDevice():  # Triton launches on the current device
            with torch.cuda.device(device):
                return self._launch_cached(key, hit, grid, args, kwargs)
        return self._launch_cached(key, hit, grid, args, kwargs)

    def _launch_cached(self, key, hit, grid, args, kwargs):
        """The launch on the current device, which holds the tensors: the cached binary, or
        :meth:`_first_launch` for a new key."""
        if hit is None or _launch_hooks():  # profilers (proton) see launches through Triton
            return self._first_launch(key, grid, args, kwargs)
        compiled, tail, meta, device = hit
        g = grid(meta) if callable(grid) else grid
        if self.needs_scratch:
            triton.set_allocator(_scratch)
        _run_compiled(compiled, tuple(g) + (1,) * (3 - len(g)),
                      torch._C._cuda_getCurrentRawStream(device), args, tail)
        return compiled

    def _first_launch(self, key, grid, args, kwargs):
        """Launch through Triton (compiling and tuning as needed) and, where :func:`direct_launch`
        holds, cache what the next launches with this key need: the compiled kernel, the trailing
        constexpr/config arguments, the config's meta-parameters (for a grid function) and the
        device index."""
        compiled = self.kernel[grid](*args, **kwargs)
        if not direct_launch():
            return compiled
        config = getattr(self.kernel, "best_config", None)
        meta = dict(config.kwargs) if config is not None else {}
        values = {**kwargs, **meta}
        tail = tuple(values[name] for name in self._names[len(args):])
        device = _tensor_device(args)
        compiled.run  # loads the binary (CompiledKernel._init_handles) before the direct calls
        if len(self._cache) >= self.MAX_KEYS:
            self._cache.clear()
        self._cache[key] = (compiled, tail, meta, device)
        return compiled
