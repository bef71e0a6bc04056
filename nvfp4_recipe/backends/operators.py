"""The compile boundary: every backend primitive is one registered torch operator.

A layer's algorithm (``gemms.py``) is ordinary Python that torch.compile's Dynamo
traces; the primitives it calls (quantize an operand, prepare a weight, the GEMM, and their grouped
forms) are where tracing stops. Each primitive of each backend is registered as
``nvfp4_recipe::<backend>_<primitive>``:

- the Triton and native backends on a GPU: ``torch.library.triton_op``. torch.compile traces its
  body, the kernels' launches are recorded with ``wrap_triton`` (``kernels.runtime.Launcher``),
  and Inductor compiles and launches the same Triton kernels from its own code;
- elsewhere (the reference backend, the Triton interpreter): ``torch.library.custom_op``, opaque,
  with a fake implementation that runs the body on fake tensors (or a shape function given where
  the body reads device values, as the reference's per-group loop does).

In eager mode a call goes straight to the Python implementation: no dispatcher on the hot path.

The operators take a flat list of tensors and one string ``key``: the ``repr`` of the call's
structure (operands as :class:`NVFP4Operand` / :class:`GroupedOperand`, each with its spec,
specs, enums, dtypes and plain values), which Dynamo folds to a constant while tracing, so the
layer's Python passes its typed values unchanged and nothing is written per primitive by hand. The structure of the result
is recorded by the body (or fake) the first time a key runs and read back while tracing.
"""

import ast
import contextlib
import dataclasses
import enum
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..operand import GroupedOperand, NVFP4Operand
from ..spec import SPEC_TYPES

# The one registry of the types that cross the boundary besides tensors, dtypes, dicts and plain
# values, by name: tuples, the operands' NamedTuples, and every enum and dataclass of spec.py
# (SPEC_TYPES: specs, their fields' enums, GemmRole, Form, ...). _encode refuses any other type;
# _decode rebuilds a NamedTuple or dataclass from its fields in order and looks an enum member up
# by its value (not constructed: Dynamo 2.11 cannot trace an enum's constructor).
_TYPES: Dict[str, type] = {kind.__name__: kind
                           for kind in (tuple, NVFP4Operand, GroupedOperand, *SPEC_TYPES)}
_MEMBERS = {(name, m.value): m for name, kind in _TYPES.items() if issubclass(kind, enum.Enum)
            for m in kind}
_DATACLASSES = tuple(kind for kind in _TYPES.values() if dataclasses.is_dataclass(kind))
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                               torch.uint8, torch.int32, torch.int64, torch.float8_e4m3fn)}
_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}
# key -> the structure of what the primitive returned for it (encoded as by _encode)
_RESULTS: Dict[str, tuple] = {}


def _encode(obj: Any, tensors: List[Optional[torch.Tensor]]) -> tuple:
    """The structure of ``obj`` as nested tuples of constants, its tensors appended to
    ``tensors`` in order. Plain Python on constants, so Dynamo folds it while tracing.

    Raises:
        TypeError: a value that cannot cross the boundary (a callable, an unknown object, an
            enum, dataclass or tuple type not in ``_TYPES``).
    """
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("T",)
    if isinstance(obj, enum.Enum):  # before the plain values: a str enum is a str
        return ("E", _registered(obj), obj.value)
    if isinstance(obj, _DATACLASSES):  # not is_dataclass(obj): Dynamo cannot guard type(a float)
        return ("F", _registered(obj),
                tuple([_encode(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)]))
    if isinstance(obj, tuple):  # a plain tuple not by type(obj).__name__: Dynamo 2.11 cannot hash it
        name = _registered(obj) if hasattr(obj, "_fields") else "tuple"
        return ("F", name, tuple([_encode(o, tensors) for o in obj]))
    if isinstance(obj, torch.dtype):
        return ("D", _DTYPE_NAMES[obj])
    if isinstance(obj, dict):
        return ("K", tuple([(k, _encode(v, tensors)) for k, v in obj.items()]))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return ("C", obj)
    raise TypeError(f"{type(obj).__name__} cannot be passed to an NVFP4 operator under "
                    f"torch.compile (tensors, dtypes, plain values and the types of "
                    f"backends/operators._TYPES can)")


def _registered(obj: Any) -> str:
    """The name under which ``obj``'s type is in ``_TYPES``.

    Raises:
        TypeError: its type is not there (add it to ``_TYPES``, or define it in spec.py).
    """
    name = type(obj).__name__
    kind = _TYPES.get(name)  # isinstance, not type(obj) is kind: Dynamo cannot guard type(a tuple)
    if kind is None or not isinstance(obj, kind):
        raise TypeError(f"{type(obj).__module__}.{name} cannot be passed to an NVFP4 operator "
                        f"under torch.compile: it is not among the types of "
                        f"backends/operators._TYPES")
    return name


def _decode(struct: tuple, tensors) -> Any:
    """The value :func:`_encode` described, its tensors taken from the iterator ``tensors``."""
    tag = struct[0]
    if tag == "T":
        return next(tensors)
    if tag == "E":
        return _MEMBERS[(struct[1], struct[2])]
    if tag == "F":
        items = [_decode(s, tensors) for s in struct[2]]
        kind = _TYPES[struct[1]]
        return tuple(items) if kind is tuple else kind(*items)
    if tag == "D":
        return _DTYPES[struct[1]]
    if tag == "K":
        return {k: _decode(v, tensors) for k, v in struct[1]}
    return struct[1]


@functools.lru_cache(maxsize=None)
def _parse(key: str) -> tuple:
    return ast.literal_eval(key)


@torch.compiler.assume_constant_result
def _result_structure(key: str) -> tuple:
    return _RESULTS[key]


def autocast_disabled(device_type: str):
    """``torch.autocast(device_type, enabled=False)`` where autocast is on for that device type,
    else a no-op context. Around a primitive's body under torch.compile, so that it computes in the
    dtypes it is given, as in eager mode (where the layers switch autocast off around their
    primitives: ``layer.autocast_off`` says why not while compiling)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def _unaliased(outputs: List[torch.Tensor], inputs: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """``outputs`` with a clone for each one that shares storage with an input or an earlier
    output (a custom operator's outputs may alias neither: a shared outer scale, an operand
    passed through unchanged)."""
    seen = {_storage(t) for t in inputs if t is not None}
    out = []
    for t in outputs:
        ref = _storage(t)
        out.append(t.clone() if ref in seen else t)
        seen.add(ref)
    return out


def _storage(t: torch.Tensor):
    """A key of t's storage; t itself where it has none to compare (a functional tensor while
    torch.compile traces a body: the aliases there are tensors passed through)."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return id(t)


def _stored(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` as an ``as_strided`` view of its own storage, for a traced body. An input is often a
    reshape of a fused elementwise result (the RMSNorm or GELU before a linear); Inductor gives
    every kernel argument reading such a reshape a buffer of its own, all written by the
    producer, unless the body takes it as a view of one stored buffer. The storage offset stays
    implicit: Inductor before torch 2.13 applied an explicit one to a graph input whose pointer
    already included it."""
    return None if t is None else t.as_strided(t.shape, t.stride())


def register(name: str, impl: Callable, *, traced: bool,
             fake: Optional[Callable] = None) -> Callable:
    """Register ``impl`` (structured arguments and result) as ``nvfp4_recipe::name``.

    Args:
        name: the operator's name in the ``nvfp4_recipe`` namespace.
        impl: the primitive; its arguments and result are tensors, None, :class:`NVFP4Operand`,
            :class:`GroupedOperand`, :class:`QuantSpec`, enums, dtypes, plain values and tuples
            and dicts of these.
        traced: a ``triton_op`` (torch.compile traces the body) rather than an opaque
            ``custom_op``.
        fake: for an opaque operator whose body cannot run on fake tensors, a function with
            ``impl``'s signature returning a result of the same structure and shapes.
    Returns:
        A function with ``impl``'s signature: ``impl`` itself in eager mode, the operator while
        torch.compile traces.
    """
    def flat(run: Callable):
        def body(tensors: List[Optional[torch.Tensor]], key: str) -> List[torch.Tensor]:
            given = tensors
            if traced:
                tensors = [_stored(t) for t in tensors]
            args, kwargs = _decode(_parse(key), iter(tensors))
            outputs: List[torch.Tensor] = []
            with autocast_disabled(next((t.device.type for t in given if t is not None), "cpu")):
                _RESULTS[key] = _encode(run(*args, **kwargs), outputs)
            return _unaliased(outputs, given + tensors)
        return body

    qualname = f"nvfp4_recipe::{name}"
    if traced:
        op = torch.library.triton_op(qualname, flat(impl), mutates_args=())
    else:
        op = torch.library.custom_op(qualname, flat(impl), mutates_args=())
        op.register_fake(flat(fake or impl))

    def call(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return impl(*args, **kwargs)
        tensors: List[Optional[torch.Tensor]] = []
        key = repr(_encode((args, kwargs), tensors))
        outputs = op(tensors, key)  # first: its body or fake records the result's structure
        return _decode(_result_structure(key), iter(outputs))

    call.operator = op
    return call


def register_methods(cls: type, instance: Any, names: Tuple[str, ...], prefix: str, *,
                     traced: Tuple[str, ...] = (),
                     fakes: Optional[Dict[str, Callable]] = None) -> None:
    """Replace the methods ``names`` of the backend class ``cls`` by registered operators
    (:func:`register`), ``nvfp4_recipe::<prefix>_<name>``, whose bodies run on ``instance`` (the
    backend's one instance). Methods inherited from a registered class are registered again
    under this class's prefix. ``traced``: the methods registered as ``triton_op``; ``fakes``:
    method name -> fake method of an opaque one (see :func:`register`)."""
    for method in names:
        raw = getattr(getattr(cls, method), "__wrapped__", getattr(cls, method))
        fake = (fakes or {}).get(method)
        call = register(f"{prefix}_{method}", functools.partial(raw, instance),
                        traced=method in traced,
                        fake=None if fake is None else functools.partial(fake, instance))
        setattr(cls, method, _method(call, raw))


def _method(call: Callable, raw: Callable) -> Callable:
    """A method running ``raw`` in eager mode and the registered operator ``call`` while
    torch.compile traces (``__wrapped__``: ``raw``)."""
    @functools.wraps(raw)
    def method(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return raw(self, *args, **kwargs)
        return call(*args, **kwargs)
    return method
