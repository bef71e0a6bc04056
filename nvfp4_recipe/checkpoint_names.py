"""Tensor names as Hugging Face transformers' ``save_pretrained`` writes them.

transformers 5 holds some architectures in another layout than their checkpoints and converts on
load (its ``conversion_mapping.py``): the experts of Qwen-MoE, DeepSeek, OLMoE and others are one
stacked ``experts.gate_up_proj`` (G, 2I, H) and ``experts.down_proj`` (G, H, I) Parameter in the
model and per-expert linears ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` in the
checkpoint; Mixtral's ``block_sparse_moe`` (experts ``w1`` / ``w3`` / ``w2``) is the module
``mlp``. ``save_pretrained`` reverts the conversion (``core_model_loading.revert_weight_conversion``),
so that checkpoints keep the layout serving engines (vLLM, SGLang, TensorRT-LLM) load; an export
writes the same names.
"""

import sys
from typing import Dict

import torch
from torch import nn

__all__ = ["saved_layout"]


def saved_layout(model: nn.Module, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``tensors`` (named as in ``model.state_dict()``) under the names, and split as,
    ``save_pretrained`` writes them: transformers' weight conversion of ``model`` reverted.
    Unchanged (a new dict) for a model that is not a transformers ``PreTrainedModel`` or has no
    conversion."""
    transformers = sys.modules.get("transformers")  # not imported: model cannot be one of its
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return dict(tensors)
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415
    except ImportError:  # transformers 4 holds models in their checkpoint layout
        return dict(tensors)
    return revert_weight_conversion(model, dict(tensors))
