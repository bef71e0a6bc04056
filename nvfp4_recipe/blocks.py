"""A model's repeated transformer blocks, found from its module tree.

The blocks are the children of the largest ``nn.ModuleList`` or ``nn.ModuleDict`` whose entries
all share one class (one entry is enough: a one-layer model): Hugging Face's ``model.layers``, torchtitan's ``layers`` (a ModuleDict), the
main job's ``blocks``. Used to keep the first or last blocks in high precision and to compile one
block at a time (the compiled code of the first block is reused by the others).
"""

from typing import List, Tuple

from torch import nn


def _candidates(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module):
            children = list(module.named_children())
            if len({type(child) for _, child in children}) == 1:
                prefix = f"{name}." if name else ""
                yield [(prefix + key, child) for key, child in children]


def repeated_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(fully qualified name, block)`` of each of ``model``'s repeated blocks, in order.

    The blocks are the entries of the nonempty ``nn.ModuleList``/``nn.ModuleDict`` of modules of
    one class holding the most parameters (ties: the first in module order).

    Raises:
        ValueError: the model has no such list (name the layers with ``keep_bf16`` instead).
    """
    def size(blocks):
        return sum(p.numel() for _, block in blocks for p in block.parameters())

    found = list(_candidates(model))
    if not found:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (an nn.ModuleList or "
                         "nn.ModuleDict of modules of one class)")
    return max(found, key=size)
