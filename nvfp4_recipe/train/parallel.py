"""Data parallelism of ``nvfp4-recipe train`` when torchrun launches it on several processes.

``torchrun --nproc-per-node N -m nvfp4_recipe train ...`` (or the ``nvfp4-recipe`` script) runs one
process per GPU (or N CPU processes with ``--device cpu``): every rank draws the same global batch
of ``--batch-size`` sequences and trains on its contiguous 1/N of them, the model is wrapped in
DDP (gradients averaged in fp32, NCCL on GPUs, gloo on the CPU), each rank draws its own SR
streams (``nvfp4_recipe.distributed.set_sr_rank``), and rank 0 evaluates, prints and writes the
results. The optimization is the single-process one with the same global batch: only the SR draws
and the rounding of the gradient average differ.
"""

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import set_sr_rank
from ..layer import NVFP4Module


@dataclass
class DataParallel:
    """This process's place among the data-parallel ranks torchrun started.

    Fields:
        rank, world: this process's rank and the number of processes.
        device: the device this rank trains on (``cuda:LOCAL_RANK`` for CUDA).
    """

    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 evaluates, prints and writes the results."""
        return self.rank == 0

    @classmethod
    def from_env(cls, device: torch.device) -> Optional["DataParallel"]:
        """The data-parallel setup torchrun's environment describes (WORLD_SIZE > 1), with the
        default process group initialized (NCCL for CUDA, gloo otherwise); None for one process.

        Args:
            device: the device the command line asked for; a CUDA device becomes this rank's
                ``cuda:LOCAL_RANK``.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), device)

    def check_batch(self, batch_size: int) -> None:
        """Raises ValueError unless the global batch splits evenly over the ranks."""
        if batch_size % self.world:
            raise ValueError(f"--batch-size ({batch_size}) must be a multiple of the number of "
                             f"processes ({self.world}): each trains on an equal share of a batch")

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a global batch (B, ...): B / world rows."""
        n = batch.shape[0] // self.world
        return batch[self.rank * n:(self.rank + 1) * n]

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` (on this rank's device) with this rank's SR streams, in DDP."""
        if any(isinstance(m, NVFP4Module) for m in model.modules()):
            set_sr_rank(model)
        ids = [self.device.index] if self.device.type == "cuda" else None
        # the only buffers are the NVFP4 layers' signs and SR counters, equal on every rank
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over the ranks (every rank gets it)."""
        value = value.detach().clone()
        dist.all_reduce(value)
        return value / self.world

    def close(self) -> None:
        """Destroy the process group (at the end of the command)."""
        if dist.is_initialized():
            dist.destroy_process_group()
