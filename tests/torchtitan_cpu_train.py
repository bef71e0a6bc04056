"""torchtitan 0.2's trainer (``python -m torchtitan.train``) on CPU processes, for the CI tests:
``torchrun --nproc-per-node 2 tests/torchtitan_cpu_train.py --job.config_file ...`` takes
torchtitan.train's arguments and runs its ``main(Trainer)`` unchanged, after two patches where the
trainer assumes an accelerator:

- The device module. ``torchtitan.tools.utils`` takes ``torch._utils._get_available_device_type()
  or "cuda"`` and its device module at import; without an accelerator that is torch.cuda, whose
  ``set_device`` fails in ``Trainer.__init__``. Here the device type is "cpu" and the module a
  stand-in answering the calls the trainer makes: ``set_device``, ``current_device`` and
  ``synchronize`` do nothing, and the memory monitor (``components/metrics.py``) reads no
  allocator statistics, so the logged memory is -1 bytes (-0.00GiB).
- FSDP2's gradient reduce-scatter. torchtitan sets every FSDP module's gradient divide factor to 1
  (``disable_fsdp_gradient_division``: it divides by the global token count itself), which FSDP2
  runs as a ``PREMUL_SUM(1)`` reduce-scatter that gloo does not implement. Here FSDP2 is also told
  to reduce with SUM and divide afterwards (``set_force_sum_reduction_for_comms``), by 1: the same
  gradients.

torch.compile is left to the job config (the tests turn it off: Inductor's CPU code around the
Triton interpreter's NVFP4 kernels is not what runs on GPUs).
"""

import os
import runpy
import sys
import types

import torch
import torch._utils
from torch import nn
from torch.distributed.fsdp import FSDPModule


def _cpu_properties(device=None):
    return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


CPU_DEVICE_MODULE = types.SimpleNamespace(
    set_device=lambda device: None, current_device=lambda: 0, synchronize=lambda device=None: None,
    get_device_name=lambda device=None: "cpu", get_device_properties=_cpu_properties,
    memory_stats=lambda device=None: {}, reset_peak_memory_stats=lambda device=None: None,
    empty_cache=lambda: None)


def _import_torchtitan_on_cpu() -> None:
    """Import ``torchtitan.tools.utils`` with "cpu" and :data:`CPU_DEVICE_MODULE` as its device."""
    saved = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type: CPU_DEVICE_MODULE
    try:
        import torchtitan.tools.utils  # noqa: F401  (reads the two functions once)
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = saved


def _sum_then_divide_by_one(model: nn.Module) -> None:
    """torchtitan's ``disable_fsdp_gradient_division`` in a form gloo runs."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def main() -> None:
    _import_torchtitan_on_cpu()
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize
    llama3_parallelize.disable_fsdp_gradient_division = _sum_then_divide_by_one
    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    runpy.run_module("torchtitan.train", run_name="__main__")


if __name__ == "__main__":
    main()
