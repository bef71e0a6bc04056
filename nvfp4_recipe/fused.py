"""Fused projection groups: the linears a serving engine runs as one GEMM.

vLLM, SGLang and TensorRT-LLM load q/k/v into one QKV projection and gate/up into one gate-up
projection, and dequantize every shard of it with one weight global scale (vLLM's
``CompressedTensorsW4A4Fp4`` and ModelOpt NVFP4 take the group's max). A group whose members were
quantized with different per-tensor amaxes is then served with weights other than the trained ones.
TransformerEngine's fused QKV quantizes the fused weight with one amax; here the members stay
separate ``NVFP4Linear`` layers and share their amax through a :class:`WeightGroup`, which
``quantize_`` attaches to each member (:func:`attach_groups`); a layer uses it while its recipe's
``shared_weight_amax`` is on (``NVFP4Linear.shared_weight_amax``).

Groups are recognized by name (:data:`GROUPS`): at least two sibling modules of one parent whose
names belong to one group.
"""

from typing import Callable, List, Tuple

import torch
from torch import nn

from . import reference as R
from .layer import local
from .linear import NVFP4Linear
from .spec import Scaling

__all__ = ["GROUPS", "WeightGroup", "fused_groups", "attach_groups"]

# the sibling names of the projections serving engines fuse: Hugging Face's attention and MLP,
# torchtitan's attention and feed-forward
GROUPS: Tuple[Tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                                       ("wq", "wk", "wv"), ("w1", "w3"))


class WeightGroup:
    """The layers of one fused group, whose weights are quantized with one per-tensor amax.

    Args:
        layers: the group's ``NVFP4Linear`` layers (two or more).
    """

    def __init__(self, layers):
        self.layers = tuple(layers)

    def amax(self) -> torch.Tensor:
        """The shared amax: the max over the members of ``max |W|`` (fp32, 0-d, on the weights'
        device; NaN and Inf propagate). Of the local shards under tensor parallelism, which the
        layer's amax reducer then reduces over the group of ranks."""
        amaxes = [R.amax(local(m.fprop_weight()).detach(), Scaling.PER_TENSOR) for m in self.layers]
        return torch.stack(amaxes).amax()

    def versions(self) -> Tuple[int, ...]:
        """The version counters of the members' weights (``cached_weights`` keys on them)."""
        return tuple(m.weight._version for m in self.layers)


def fused_groups(model: nn.Module, accept: Callable[[nn.Module], bool]) -> List[Tuple[str, ...]]:
    """The fused groups of ``model``: per parent module and name group of :data:`GROUPS`, the
    fqns of its children of those names for which ``accept(module)`` is True, when there are two
    or more, in the group's order."""
    groups = []
    for fqn, parent in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        for names in GROUPS:
            members = [f"{prefix}{n}" for n in names if accept(parent._modules.get(n))]
            if len(members) > 1:
                groups.append(tuple(members))
    return groups


def attach_groups(model: nn.Module) -> int:
    """Give each ``NVFP4Linear`` of a fused group of ``model`` (:func:`fused_groups`) the group's
    :class:`WeightGroup` (``layer.weight_group``); returns the number of groups."""
    groups = fused_groups(model, lambda m: isinstance(m, NVFP4Linear))
    for fqns in groups:
        group = WeightGroup(model.get_submodule(f) for f in fqns)
        for layer in group.layers:
            layer.weight_group = group
    return len(groups)
