"""Whether torch.compile is tracing the code that runs now, for the layers (which keep a weight
cache and a kernel-launched SR key out of a graph) and the kernels' launcher (which records a
launch instead of running it). Imports only torch, so that it is there without Triton."""

import torch

__all__ = ["tracing"]

_FUNCTIONAL = torch._C._TorchDispatchModeKey.FUNCTIONAL
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def tracing() -> bool:
    """Whether torch.compile is tracing (a fake or functional tensor mode is active, as while it
    traces a ``triton_op``'s body or a backward): a kernel launch must then be recorded, not run.
    Asked on every launch, so two C calls and nothing else."""
    get = torch._C._get_dispatch_mode
    return get(_FUNCTIONAL) is not None or get(_FAKE) is not None
