"""NVFP4 layers under PyTorch's data and tensor parallelism (docs/distributed.md).

Data parallelism (DDP, FSDP2): every rank quantizes its own tokens, so nothing changes but the
stochastic-rounding streams, which must differ between ranks for the SR noise of the averaged
gradient to shrink with their number. :func:`set_sr_rank` folds a process's rank into the Philox key
of every ``NVFP4Linear`` (``layer.sr_key``: ``sr_seed + sr_rank + (sr_step << 32)``); rank 0, and
a single process, keep the keys of a layer that never heard of ranks.

Tensor parallelism lives in ``tensor_parallel.py`` (below the layers, which call it).
"""

from typing import Union

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .layer import NVFP4Module

__all__ = ["set_sr_rank", "data_parallel_rank"]

GroupLike = Union[None, dist.ProcessGroup, DeviceMesh]


def data_parallel_rank(group: GroupLike = None) -> int:
    """This process's rank in ``group``: a ProcessGroup, a 1-D DeviceMesh, or None for the default
    process group (0 when torch.distributed is not initialized).

    Raises:
        ValueError: a DeviceMesh that is not 1-D, or a group this process is not part of.
    """
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"pass the 1-D data-parallel mesh (e.g. mesh['dp']), got a "
                             f"{group.ndim}-D mesh {group.mesh_dim_names}")
        return group.get_local_rank()
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return rank


def set_sr_rank(model: nn.Module, group: GroupLike = None) -> int:
    """Give every NVFP4 module (``layer.NVFP4Module``: NVFP4Linear, the experts modules) of ``model`` this
    process's data-parallel rank as its ``sr_rank``, so
    that data-parallel ranks draw independent SR streams; returns the rank.

    Call it once per process after ``quantize_`` (before or after wrapping the model in DDP or
    ``fully_shard``), with the group whose ranks see different data and average their gradients:
    the whole world for plain DDP/FSDP, the data-parallel dimension of a mesh that also has a
    tensor-parallel one (ranks of one tensor-parallel group must share their streams, so that a
    replicated gradient is quantized alike on all of them). The rank is an attribute, not a
    buffer: it is not saved in checkpoints, and DDP's buffer broadcast leaves it alone. Layers
    made later (another ``quantize_``) start at rank 0.

    Raises:
        ValueError: no NVFP4 layer in ``model`` (call ``quantize_`` first), or a bad ``group``
            (:func:`data_parallel_rank`).
    """
    rank = data_parallel_rank(group)
    layers = [m for m in model.modules() if isinstance(m, NVFP4Module)]
    if not layers:
        raise ValueError("set_sr_rank: the model has no NVFP4 layer; call "
                         "nvfp4_recipe.quantize_(model, recipe) first")
    for layer in layers:
        layer.sr_rank = rank
    return rank
