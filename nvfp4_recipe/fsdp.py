"""FSDP2 with NVFP4 weight all-gather: each rank quantizes its shard of W, FSDP2 gathers the codes.

FSDP2 (``fully_shard``) keeps each weight W (N, K) sharded along dim 0 (rows) and all-gathers it
before the forward (and again before the backward): by default in ``param_dtype`` (bf16, 2 bytes
an element), after which every rank quantizes the whole W. :func:`enable_fp4_all_gather` wraps
the weights of a model's ``NVFP4Linear`` layers in :class:`FP4AllGatherWeight`, a tensor subclass
implementing FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``,
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``), as torchao's float8 training does with
``WeightWithDynamicFloat8CastTensor`` (``torchao/float8/fsdp_utils.py``):

- before the all-gather, each rank casts its shard to ``param_dtype``, takes its amax, all-reduces
  the amaxes (max, one scalar: ``tensor_parallel.all_reduce_amax``) and quantizes its rows with
  the whole weight's outer scale in 16x16 tiles (the recipe's W spec);
- the all-gather moves the packed E2M1 codes (N, K/2) uint8 and the E4M3 tile scales
  (N/16, K/16): 0.5 + 1/256 bytes an element against 2 for bf16; the outer scale, equal on every
  rank, travels as metadata;
- after it, the unsharded parameter is an :class:`NVFP4Tensor` (N, K) of ``param_dtype``: the
  bits of quantizing the gathered high-precision weight, since 16x16 tiles of whole rows never
  straddle shards and the amax is the whole weight's. ``NVFP4Linear`` runs fprop on it and dgrad
  on its exact transpose, made locally (``Backend.transpose_2d``: codes and tile scales moved,
  one kernel on the Triton backend; TransformerEngine rebuilds the columnwise copy of a gathered
  2D weight alike); wgrad's dense dW (N, K) in ``param_dtype`` is the gradient FSDP2
  reduce-scatters;
- the gather FSDP2 repeats before the backward (``reshard_after_forward``) sends the forward's
  codes again: each rank quantizes its shard once a step.

Layers fall back to the high-precision gather (said once, naming the layer and the reason) where
the gathered codes cannot be the operands: 1x16 weight blocks (W^T is not a transpose of W's
codes), a forward or backward override (they need the high-precision W), a tensor-parallel
weight (its amax spans the tensor-parallel group too), and shards whose rows are not a whole
number of 16-row tiles (``out_features`` not a multiple of 16 x the FSDP group size).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from .backends import get_backend, warn_once
from .formats import BLOCK
from .linear import NVFP4Linear
from .spec import GemmRole
from .tensor import NVFP4Tensor
from .tensor_parallel import all_reduce_amax

__all__ = ["enable_fp4_all_gather", "all_gather_bytes", "FP4AllGatherWeight"]

FP4, HIGH_PRECISION = "fp4", "high_precision"
aten = torch.ops.aten

# The ops FSDP2 applies to a sharded parameter (padding on dim 0, chunking, moving, copying)
# whose results must stay wrapped (torchao's _ops_to_preserve_subclass); every other op sees the
# high-precision tensor.
_PRESERVED = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default,
              aten.view.default, aten.as_strided.default, aten._to_copy.default,
              aten._pin_memory.default, aten.split.Tensor, aten.clone.default, aten.detach.default}


@dataclass(eq=False)
class GatherState:
    """What the wrappers of one layer's weight share (FSDP2 rewraps the shard as it pads and
    moves it): the layer's name, the gather's mode (FP4 or HIGH_PRECISION, fixed by the first
    all-gather: FSDP2 allocates its buffers once), the bytes this rank has received from the
    all-gathers of this weight, and this rank's shard as the last all-gather outside a backward
    quantized it (what the gathers inside the backward send: :meth:`FP4AllGatherWeight.fsdp_pre_all_gather`)."""

    name: str
    mode: Optional[str] = None
    gathered_bytes: int = 0
    quantized: Optional[NVFP4Tensor] = None


def _high_precision_reason(module: nn.Module, outer_size: torch.Size, world: int) -> Optional[str]:
    """Why ``module``'s weight must be gathered in high precision, or None (gather NVFP4)."""
    recipe = module.recipe
    if not recipe.weight_2d:
        return "1x16 weight blocks (weight_2d=False): dgrad's W^T is not a transpose of W's codes"
    if recipe.forward_override is not None or recipe.backward_override is not None:
        return "a forward/backward override computes with the high-precision weight"
    if tuple(outer_size) != (module.out_features, module.in_features):
        return ("the weight FSDP2 gathers is a tensor-parallel shard, whose amax spans the "
                "tensor-parallel group")
    if outer_size[0] % (BLOCK * world):
        return (f"out_features={outer_size[0]} is not a multiple of {BLOCK} x {world} ranks: a "
                f"shard would cut a {BLOCK}x{BLOCK} tile")
    return None


def _mode(state: GatherState, module: nn.Module, outer_size: torch.Size, world: int) -> str:
    """The gather mode of this all-gather; the first decides it, and a fallback is said once.

    Raises:
        RuntimeError: the layer's recipe changed (``set_recipe``) to one that needs the other
            mode after FSDP2 allocated the first one's buffers.
    """
    reason = _high_precision_reason(module, outer_size, world)
    mode = FP4 if reason is None else HIGH_PRECISION
    if state.mode is None:
        state.mode = mode
        if reason is not None:
            warn_once(f"FSDP2 fp4 all-gather: {state.name} gathers its weight in high precision: "
                      f"{reason}", key=f"fsdp-fp4:{state.name}:{reason}")
    elif mode != state.mode:
        raise RuntimeError(f"FSDP2 fp4 all-gather: {state.name} was gathered as {state.mode} and "
                           f"its recipe now needs {mode} ({reason or 'a 2d recipe'}); change the "
                           f"recipe before the first forward under fully_shard")
    return mode


def _quantize_shard(module: nn.Module, shard: torch.Tensor,
                    group: torch.distributed.ProcessGroup) -> NVFP4Tensor:
    """This rank's rows of W quantized under the layer's W spec with the whole W's amax."""
    spec = module.recipe.spec(GemmRole.W_FPROP)
    backend = get_backend(module.recipe.backend, shard.device)
    op = backend.quantize(shard, spec, amax_reduce=lambda amax: all_reduce_amax(amax, group))
    return NVFP4Tensor.from_operand(op, shard.dtype, backend=backend.name)


class FP4AllGatherWeight(torch.Tensor):
    """A high-precision weight (its FSDP2 shard, (rows, K)) that FSDP2 all-gathers as NVFP4.

    Every op but FSDP2's layout ops (``_PRESERVED``, which keep the wrapper) runs on the wrapped
    tensor, so the optimizer, the state dict and the checkpoints see the plain weight.

    Args:
        tensor: the high-precision weight (the master, e.g. fp32).
        state: the :class:`GatherState` of its layer.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, state: GatherState):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, state: GatherState):
        self._tensor = tensor
        self._state = state

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        states = []

        def unwrap(t):
            states.append(t._state)
            return t._tensor

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, states[0]), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._state

    @staticmethod
    def __tensor_unflatten__(inner_tensors, state, outer_size, outer_stride):
        return FP4AllGatherWeight(inner_tensors["_tensor"], state)

    def __repr__(self):
        return f"FP4AllGatherWeight({self._state.name}, tensor={self._tensor})"

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride: Tuple[int, ...],
                            module: nn.Module, mp_policy) -> Tuple[Tuple[torch.Tensor, ...], Any]:
        """FSDP2's pre-all-gather hook: the all-gather inputs of this rank's shard and metadata.

        FP4: ((rows, K/2) uint8 codes, (rows/16, K/16) E4M3 scales), metadata the quantized
        shard (an NVFP4Tensor: its outer scale, a float32 scalar equal on every rank, its spec,
        backend and RHT signs are the gathered weight's). High precision: ((padded rows, K) in
        ``param_dtype``,), None: the shard padded as FSDP2 pads an uneven one. Counts the bytes
        this rank receives. An FP4 gather inside the backward sends the codes of the last gather
        outside it (the forward's): one quantization and one amax all-reduce a step.
        """
        dtype = mp_policy.param_dtype or self.dtype
        world = mesh.size()
        if _mode(self._state, module, outer_size, world) == FP4:
            # FSDP2 gathers the weight again for the backward (reshard_after_forward): that gather,
            # inside the autograd engine, sends the forward's codes (the weight is unchanged until
            # the optimizer's step), not a second quantization and amax all-reduce
            state = self._state
            if state.quantized is None or torch._C._current_graph_task_id() == -1:
                state.quantized = _quantize_shard(module, self._tensor.to(dtype), mesh.get_group())
            w = state.quantized
            inputs, metadata = (w.qdata, w.scale), w
        else:
            shard = self._tensor.to(dtype)
            padded = -(-outer_size[0] // world)
            inputs, metadata = (F.pad(shard, (0, 0, 0, padded - shard.shape[0])),), None
        self._state.gathered_bytes += world * sum(t.numel() * t.element_size() for t in inputs)
        return inputs, metadata

    def fsdp_post_all_gather(self, outputs: Tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: Optional[torch.Tensor] = None):
        """FSDP2's post-all-gather hook: the unsharded weight from the gathered tensors.

        FP4: an :class:`NVFP4Tensor` (N, K) of ``param_dtype`` holding the gathered codes and
        scales (no copy) and the shard's outer scale, spec (whole), backend and RHT signs; with
        ``out`` (later all-gathers into the same buffers) only its outer scale and spec change.
        High precision: the gathered tensor itself.
        Returns (unsharded tensor, the tensors FSDP2 frees after use), or None with ``out``.
        """
        if self._state.mode == HIGH_PRECISION:
            return None if out is not None else (outputs[0], outputs)
        if out is not None:
            out.outer_scale, out.spec = metadata.outer_scale, metadata.spec
            return None
        qdata, scale = outputs
        w = _GatheredWeight(qdata, scale, metadata.outer_scale, metadata.spec, param_dtype, False,
                            metadata.backend, metadata.rht_signs)
        return w, outputs


class _GatheredWeight(NVFP4Tensor):
    """The unsharded NVFP4 weight FSDP2 makes a Parameter of: an NVFP4Tensor that also takes
    FSDP2's ``as_strided`` to its own (contiguous) shape."""


@_GatheredWeight.implements(aten.as_strided.default)
def _(func, types, args, kwargs):
    w, size, stride = args[:3]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    if tuple(size) != tuple(w.shape) or tuple(stride) != tuple(w.stride()) or offset:
        raise NotImplementedError(f"as_strided of the gathered NVFP4 weight {tuple(w.shape)} to "
                                  f"{tuple(size)}, {tuple(stride)}, offset {offset}")
    return w._apply_fn_to_data(lambda t: t)


def enable_fp4_all_gather(model: nn.Module) -> List[str]:
    """Make FSDP2 all-gather the weights of ``model``'s ``NVFP4Linear`` layers as NVFP4 (module
    docstring); call it after ``quantize_`` and before ``fully_shard``. The counterpart of
    torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``.

    Each weight Parameter becomes an :class:`FP4AllGatherWeight` wrapping the same tensor (an
    optimizer made earlier holds the old Parameter: make it after). Layers whose fprop takes a
    view of the weight (``NVFP4Conv1D``) keep theirs. Which layers fall back to the
    high-precision gather, and why, is logged once per layer at the first all-gather.

    Returns:
        the names of the layers whose weights were wrapped.
    Raises:
        ValueError: no NVFP4Linear in ``model`` (call ``quantize_`` first), or a weight that is
            already a DTensor (call this before ``fully_shard``).
    """
    names = []
    for name, layer in model.named_modules():
        if not isinstance(layer, NVFP4Linear) or layer.fprop_weight() is not layer.weight:
            continue
        weight = layer.weight
        if isinstance(weight, torch.distributed.tensor.DTensor):
            raise ValueError(f"enable_fp4_all_gather: {name}.weight is already a DTensor; call it "
                             f"before fully_shard and parallelize_module")
        if not isinstance(weight.data, FP4AllGatherWeight):
            layer.weight = nn.Parameter(FP4AllGatherWeight(weight.data, GatherState(name)),
                                        requires_grad=weight.requires_grad)
        names.append(name)
    if not names:
        raise ValueError("enable_fp4_all_gather: the model has no NVFP4Linear layer; call "
                         "nvfp4_recipe.quantize_(model, recipe) first")
    return names


def _states(model: nn.Module) -> Dict[str, GatherState]:
    """The GatherState of every wrapped weight of ``model`` (sharded by FSDP2 or not)."""
    found = {}
    for layer in model.modules():
        weight = getattr(layer, "weight", None)
        weight = getattr(weight, "_local_tensor", weight)  # FSDP2's sharded DTensor
        if isinstance(weight, FP4AllGatherWeight):
            found[weight._state.name] = weight._state
    return found


def all_gather_bytes(model: nn.Module, reset: bool = False) -> Dict[str, int]:
    """Bytes this rank has received from the all-gathers of each wrapped weight since the last
    reset (its own shard included), by layer name; ``reset`` zeroes the counts after reading."""
    counts = {}
    for name, state in _states(model).items():
        counts[name] = state.gathered_bytes
        if reset:
            state.gathered_bytes = 0
    return counts
