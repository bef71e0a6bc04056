"""A side CUDA stream for work that does not depend on what the current stream is about to do.

The Triton backend quantizes a layer's weight on it (``TritonBackend.prepare_weight``: W's amax
and quantize passes) while the current stream quantizes the activations, and
dequantizes W^T on it in backward (``TritonBackend.prepare``) while dY is quantized. Those are a
dozen small kernels a layer (a few µs each at a 512-wide layer) that would otherwise add their
launch ramps and tails to the critical path; beside the activations' passes they cost almost
nothing (measured on the ``train --preset gpu`` step, CHANGELOG.md).

Usage: the body of ``with SideStream(device) as side:`` runs on the side stream, which first waits
for everything already queued on the current stream; ``side.join(outputs...)`` makes the current
stream wait for the side stream and marks the outputs as used by the current stream (so the caching
allocator does not hand their memory to the side stream while the current one may still read it).

The fork happens only while a CUDA graph is being captured (``torch.cuda.graph``, torch.compile's
"reduce-overhead" mode), where it becomes two graph edges and costs nothing at replay. In eager
mode the body runs inline on the current stream: there the fork and join cost more host time a
layer call than the few µs of GPU time they save a small layer (the host-bound eager training step
measured slower with them).
"""

import functools

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


class SideStream:
    """Fork the current CUDA stream of ``device`` to a per-device side stream while a CUDA graph is
    being captured on it (see the module docstring); otherwise the body runs inline and ``join``
    does nothing."""

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
