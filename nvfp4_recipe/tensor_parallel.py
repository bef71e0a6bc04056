"""NVFP4 layers under tensor parallelism (docs/distributed.md), below the layers that use it.

Tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``): an
``NVFP4Linear`` whose weight is a DTensor runs :func:`tensor_parallel_forward`: the layer's
algorithm on the local shards, with the amax of every sharded operand reduced (max) over the
tensor-parallel group between the amax and the quantize pass, so each shard is quantized with the
whole tensor's outer scale, as torchao's float8 training scales DTensor operands by their global
amax. Which operand is split how (:data:`SPLITS`)::

    ColwiseParallel (W: Shard(0), N split)   RowwiseParallel (W: Shard(1), K split)
    W (fprop, W^T) rows                       W (fprop, W^T) columns
    X, X^T         replicated                 X columns, X^T rows
    dY cols, dY^T  rows                       dY, dY^T replicated

A per-tensor amax is reduced wherever the operand is split; a per-token amax (one per row) only
where the rows are cut (columns split), since a row that is whole on its rank already has its amax.
SR counters: the shard of an SR operand starts its Philox counters where its rows start in the whole
operand (``rank * rows * cols / 16``), which for rows split is exactly the unsharded tensor's
counter of every element; for columns split (ColwiseParallel's dY in dgrad) every element still
gets its own byte of the same stream, but in shard-major rather than row-major order, so those bits
(and dX) differ from the unsharded layer's while having the same distribution.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .backends import AmaxReduce
from .formats import BLOCK
from .spec import GemmRole, QuantSpec

__all__ = ["all_reduce_amax", "TensorParallelShard", "tensor_parallel_forward", "SPLITS"]

ROWS, COLS = "rows", "cols"
# style -> operand -> which dimension of the local operand (rows, K) is cut; absent: replicated
SPLITS = {
    "colwise": {GemmRole.W_FPROP: ROWS, GemmRole.DY_DGRAD: COLS, GemmRole.DY_WGRAD: ROWS},
    "rowwise": {GemmRole.W_FPROP: COLS, GemmRole.X_FPROP: COLS, GemmRole.X_WGRAD: ROWS},
}


def all_reduce_amax(amax: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The elementwise max over the ranks of ``group`` of fp32 amaxes (same shape everywhere), as
    a new tensor: what the amax of the whole tensor would be, NaN included (spec item 9). Taken on
    the int32 bit patterns of |amax|, which order non-negative floats as their values and put NaN
    above Inf (a float max through a collective may drop a NaN)."""
    bits = amax.abs().view(torch.int32)
    dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=group)
    return bits.view(torch.float32)


@dataclass(frozen=True)
class TensorParallelShard:
    """How the local operands of a tensor-parallel NVFP4Linear are cut from the whole ones.

    Fields:
        style: "colwise" (weight Shard(0)) or "rowwise" (weight Shard(1)).
        group: the tensor-parallel process group; rank: this process's rank in it.
    """

    style: str
    group: dist.ProcessGroup
    rank: int

    def split(self, role: GemmRole) -> Optional[str]:
        """ROWS or COLS: which dimension of operand ``role`` (rows, K) is split; None: replicated."""
        return SPLITS[self.style].get(role)

    def amax_reduce(self, role: GemmRole, spec: QuantSpec) -> AmaxReduce:
        """The amax reducer of operand ``role`` quantized under ``spec``: the max over the group
        where the operand is split and its amax covers more than the local rows (per tensor, or
        per token with the rows cut); None otherwise."""
        split = self.split(role)
        if split is None or (split == ROWS and spec.per_token):
            return None
        return functools.partial(all_reduce_amax, group=self.group)

    def sr_offset(self, role: GemmRole, rows: int, cols: int) -> int:
        """Shift of the SR counters of the local (rows, cols) operand ``role``: the number of
        16-element blocks of the shards before it (0 for a replicated operand)."""
        return self.rank * rows * (cols // BLOCK) if self.split(role) else 0


def _style(layer) -> str:
    """'colwise' or 'rowwise' from the placement of a DTensor weight.

    Raises:
        ValueError: a mesh that is not 1-D, another placement, or shards that are not whole
            multiples of 16 (NVFP4 blocks must not straddle ranks).
    """
    w = layer.weight
    mesh = w.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"a tensor-parallel NVFP4Linear needs a 1-D mesh, got {mesh.ndim}-D "
                         f"{mesh.mesh_dim_names}")
    placement = w.placements[0]
    styles = {0: ("colwise", "out_features"), 1: ("rowwise", "in_features")}
    if not isinstance(placement, Shard) or placement.dim not in styles:
        raise ValueError(f"a tensor-parallel NVFP4Linear takes a weight sharded along dim 0 "
                         f"(ColwiseParallel) or 1 (RowwiseParallel), got {placement}")
    style, name = styles[placement.dim]
    n = w.shape[placement.dim]
    if n % (BLOCK * mesh.size()):
        raise ValueError(f"{style} tensor-parallel NVFP4Linear: {name}={n} must be a multiple of "
                         f"{BLOCK} x {mesh.size()} ranks, so that every shard holds whole blocks "
                         f"of {BLOCK}")
    return style


def tensor_parallel_forward(layer, x: DTensor) -> DTensor:
    """Forward of an NVFP4Linear whose weight is a DTensor on a 1-D tensor-parallel mesh.

    Colwise (weight Shard(0)): x is made Replicate; returns Y sharded along its last dim, and the
    input gradient comes back as partial sums (Partial). Rowwise (weight Shard(1)): x is made
    Shard(-1); returns Y as Partial sums (the RowwiseParallel output hook all-reduces or
    reduce-scatters them in the output dtype), the bias entering each rank's sum divided by the
    group size (DTensor's rule for turning a replicated tensor into partial sums). The local
    computation is the layer's algorithm with amaxes reduced over the group
    (:class:`TensorParallelShard`); eager mode only.

    Args:
        layer: the NVFP4Linear (its ``local_forward``; weight and bias DTensors as ColwiseParallel / RowwiseParallel
            distribute them).
        x: (..., in_features) DTensor on the same mesh.
    Raises:
        TypeError: x is not a DTensor. ValueError: see :func:`_style`.
    """
    style = _style(layer)
    if not isinstance(x, DTensor):
        raise TypeError("a tensor-parallel NVFP4Linear (DTensor weight) takes a DTensor input; "
                        "parallelize_module's ColwiseParallel / RowwiseParallel make one")
    w, mesh = layer.weight, layer.weight.device_mesh
    colwise = style == "colwise"
    want = Replicate() if colwise else Shard(x.dim() - 1)
    if tuple(x.placements) != (want,):
        x = x.redistribute(mesh, [want])
    x_local = x.to_local(grad_placements=[Partial()] if colwise else None)
    bias = layer.bias
    if bias is not None:
        # rowwise: each rank adds bias / size to its partial sum; the local gradient is a share
        bias = bias.to_local() if colwise else bias.to_local(grad_placements=[Partial()]) / mesh.size()
    shard = TensorParallelShard(style, mesh.get_group(), mesh.get_local_rank())
    y = layer.local_forward(x_local, w.to_local(), bias, shard)
    return DTensor.from_local(y, mesh, [Shard(y.dim() - 1) if colwise else Partial()],
                              run_check=False)


def is_tensor_parallel(weight) -> bool:
    """Whether ``weight`` is a DTensor, which makes its NVFP4 layer tensor parallel."""
    return isinstance(weight, DTensor)
