"""A side CUDA stream for work that does not depend on what the current stream is about to do.

The Triton backend quantizes a layer's weight on it (``TritonBackend.prepare_weight``: W's amax
and quantize passes) while the current stream quantizes the activations, and
dequantizes W^T on it in backward (``TritonBackend.prepare``) while dY is quantized. Those are a
dozen small kernels a layer (a few µs each at a 512-wide layer) that would otherwise add their
launch ramps and tails to the critical path; beside the activations' passes they cost almost
nothing (measured on the ``train --preset gpu`` step, CHANGELOG.md).

Usage: the body of ``with SideStream(device) as side:`` runs on the side stream, which first waits
for everything already queued on the current stream. Joining makes the current stream wait for
the side stream and marks the outputs as used by the current stream (so the caching allocator
does not hand their memory to the side stream while the current one may still read it), either
at once (``side.join(outputs...)``) or where the outputs are first read
(``side.defer_join(outputs...)``): :func:`join_reads`, called with a consumer's arguments before
it launches anything, joins every deferred fork when one of those arguments shares storage with a
deferred output. The class decorator :func:`joins_reads` puts that call at the top of methods, so
a consumer cannot forget it: the Triton backend decorates all its primitives, which makes ``mm``,
``grouped_mm``, a quantize pass given a ``prepare=`` operand and ``prepare`` itself join the forks
they read, while a pass that reads none (the activations' quantization beside the fork) does not
wait for them.

Deferred forks are one list for the process, not one per thread: autograd runs a CUDA backward on
its own thread, where a fork made in the forward can be read first (W^T, made in a forward whose
fprop runs in high precision, read by dgrad).

The fork happens only while a CUDA graph is being captured (``torch.cuda.graph``, torch.compile's
"reduce-overhead" mode), where it becomes two graph edges and costs nothing at replay. In eager
mode the body runs inline on the current stream and nothing is deferred: there the fork and join
cost more host time a layer call than the few µs of GPU time they save a small layer (the
host-bound eager training step measured slower with them).
"""

import functools
import threading
from typing import Callable, FrozenSet, List, Tuple

import torch


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    # High priority: its few small blocks are scheduled ahead of the waiting blocks of the large
    # kernels beside it, so they finish early instead of queueing behind a whole pass (at normal
    # priority some layers measured slower than on one stream).
    return torch.cuda.Stream(device, priority=-1)


def _tensors(outputs):
    for out in outputs:
        if isinstance(out, torch.Tensor):
            yield out
        elif isinstance(out, (tuple, list)):  # NVFP4Operand and other tuples of tensors
            yield from _tensors(out)


def _storages(values) -> FrozenSet[Tuple[torch.device, int]]:
    """Where the tensors in ``values`` keep their data: (device, storage address) each. A tensor
    without real storage (a fake one, while torch.compile traces) is none of a fork's outputs."""
    keys = set()
    for t in _tensors(values):
        try:
            keys.add((t.device, t.untyped_storage().data_ptr()))
        except (RuntimeError, NotImplementedError):
            continue
    return frozenset(keys)


class SideStream:
    """Fork the current CUDA stream of ``device`` to a per-device side stream while a CUDA graph is
    being captured on it (see the module docstring); otherwise the body runs inline and ``join``
    and ``defer_join`` do nothing."""

    def __init__(self, device: torch.device):
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        self._main = torch.cuda.current_stream(device) if capturing else None
        self._side = None if self._main is None else _side_stream(self._main.device)
        self._context = None

    @property
    def forked(self) -> bool:
        """Whether the body runs on the side stream (else inline)."""
        return self._side is not None

    def __enter__(self) -> "SideStream":
        if self._side is not None:
            self._side.wait_stream(self._main)
            self._context = torch.cuda.stream(self._side)
            self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)

    def join(self, *outputs) -> None:
        """The current stream waits for the side stream; ``outputs`` (tensors, tuples of tensors
        or None) made on the side stream are recorded as used by the current stream."""
        if self._side is None:
            return
        self._main.wait_stream(self._side)
        for t in _tensors(outputs):
            t.record_stream(self._main)

    def defer_join(self, *outputs) -> None:
        """:meth:`join` with ``outputs``, left to the first :func:`join_reads` given a tensor on
        the storage of one of them (a view or another operand built on it included)."""
        if not self.forked:
            return
        with _LOCK:
            _DEFERRED.append((self, outputs, _storages(outputs)))


_LOCK = threading.Lock()
# forks whose join waits for a reader: (fork, its outputs, their storages)
_DEFERRED: List[Tuple[SideStream, tuple, FrozenSet]] = []


def join_reads(*args) -> None:
    """Join every deferred fork (:meth:`SideStream.defer_join`) if ``args`` (tensors, tuples and
    lists of them; other values are ignored) hold a tensor on the storage of a deferred output.
    All of them, not only the one read: they share the side stream, whose wait covers them all,
    and none stays pending past its first reader. Returns at once with nothing deferred (eager
    mode)."""
    if not _DEFERRED:
        return
    read = _storages(args)
    with _LOCK:
        if not any(read & stored for _, _, stored in _DEFERRED):
            return
        forks = list(_DEFERRED)
        _DEFERRED.clear()
    for side, outputs, _ in forks:
        side.join(*outputs)


def joins_reads(names: Tuple[str, ...]) -> Callable[[type], type]:
    """Class decorator: each method in ``names`` calls :func:`join_reads` with its arguments
    before it runs."""
    def decorate(cls: type) -> type:
        for name in names:
            setattr(cls, name, _joining(getattr(cls, name)))
        return cls
    return decorate


def _joining(method: Callable) -> Callable:
    def joined(self, *args, **kwargs):
        join_reads(args, tuple(kwargs.values()))
        return method(self, *args, **kwargs)
    functools.update_wrapper(joined, method)
    # no __wrapped__: backends.operators.register_methods registers a method's __wrapped__ (to
    # unwrap a registered class's operator wrapper), which would drop the join
    del joined.__wrapped__
    return joined
