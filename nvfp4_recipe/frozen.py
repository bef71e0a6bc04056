"""Checkpoints in: an NVFP4 checkpoint as a frozen NVFP4 base, for LoRA and other adapters.

:class:`NVFP4FrozenLinear` keeps a linear layer's weight as NVFP4 data only (codes, E4M3 scales,
an fp32 outer scale; 0.5625 bytes a parameter, about 0.5 with 16x16 scales, against bf16's 2) and
runs fprop and dgrad through it: as NVFP4 GEMMs under the recipe (X and dY quantized as
``NVFP4Linear`` quantizes them, on the same backends), or as high-precision GEMMs on the weight
dequantized for the call (exact in bf16). There is no wgrad: the weight is frozen; the input's
gradient flows, so adapters beside the layer (PEFT's LoRA: :func:`lora_config`) and every layer
before it train.

:func:`load_frozen` reads a checkpoint directory in either layout :func:`serving.export` writes
(compressed-tensors ``nvfp4-pack-quantized`` or ModelOpt NVFP4, whoever produced it) into a model:
its linears as NVFP4FrozenLinear, its MoE experts as the frozen experts modules of
``frozen_experts`` (the same fprop and dgrad over the experts' token groups).
"""

import functools
import glob
import json
import os
from typing import Dict, Optional, Set, Tuple

import torch
from torch import nn

from . import gemms
from . import reference as R
from .checkpoint_names import saved_layout
from .forward import forward_gemms
from .frozen_experts import load_experts
from .frozen_weights import GEMMS, FrozenModule, check_weight, weight_operand
from .layer import DenseRecorder, backend_name, layer_seed, out_dtype
from .operand import NVFP4Operand
from .recipe import NVFP4Recipe
from .spec import Block
from .tensor import NVFP4Tensor

__all__ = ["NVFP4FrozenLinear", "load_frozen", "read_checkpoint", "lora_config", "GEMMS"]

class NVFP4FrozenLinear(FrozenModule):
    """A frozen linear layer holding only its NVFP4 weight: ``y = x @ W^T + bias``.

    Shapes as nn.Linear: (..., in_features) -> (..., out_features). Buffers: ``qdata`` uint8
    (out, in / 2) E2M1 codes, even element in the low nibble; ``scale`` float8_e4m3fn, (out, in
    / 16) 1x16 block scales or (out / 16, in / 16) tile scales when the checkpoint's rows agree
    within each tile (a 2d-trained weight); ``outer_scale`` float32 () decode scale; ``bias``
    (out,) or None; plus the recipe buffers of :class:`layer.NVFP4Module` (the SR stream of dY).
    No high-precision copy of the weight is kept; ``weight`` is an :class:`NVFP4Tensor` view of
    the buffers (dtype ``dtype``) for code that reads a layer's weight device and dtype (PEFT);
    ``spec`` the weight's :class:`QuantSpec` (``QuantSpec(block)``, the operands carry it) and
    ``block`` its scale layout.

    :meth:`dequantize` gives a plain nn.Linear holding the weight dequantized.

    ``gemm``: "nvfp4" runs fprop (X quantized as ``recipe.spec(X_FPROP)``) and dgrad (dY as
    ``DY_DGRAD``, SR from the layer's stream; W^T the exact transpose of tile-scaled weights, else
    W requantized along N) as NVFP4 GEMMs on the recipe's backend: the forward of the trained
    ``NVFP4Linear`` bit for bit; "bf16" multiplies by the weight dequantized for the call, in the
    input's dtype (autocast's), nothing quantized.

    Raises:
        ValueError: shapes that disagree or are not multiples of 16; an unknown ``gemm``; a
            recipe with ``forward_override`` or ``backward_override``.
        TypeError: ``qdata`` not uint8 or ``scale`` not float8_e4m3fn.
    """

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, outer_scale: torch.Tensor,
                 bias: Optional[torch.Tensor] = None, recipe: Optional[NVFP4Recipe] = None,
                 dtype: torch.dtype = torch.bfloat16, gemm: str = "nvfp4", layer_seed: int = 0):
        super().__init__()
        if qdata.dim() != 2:
            raise ValueError(f"NVFP4FrozenLinear takes codes (out, in / 2), got {tuple(qdata.shape)}")
        check_weight("NVFP4FrozenLinear", qdata, scale, gemm)
        if recipe is not None:
            self.check_recipe(recipe)
        w = weight_operand(qdata, scale, outer_scale.float().reshape(()))
        self.out_features, self.in_features = qdata.shape[0], 2 * qdata.shape[1]
        self.dtype, self.gemm, self.spec = dtype, gemm, w.spec
        self.register_buffer("qdata", w.qdata)
        self.register_buffer("scale", w.scale)
        self.register_buffer("outer_scale", w.outer_scale)
        self.register_buffer("bias", bias)
        self._init_nvfp4(recipe, layer_seed, qdata.device)

    def frozen_buffers(self) -> Tuple[str, ...]:
        return ("qdata", "scale", "outer_scale")

    @property
    def block(self) -> Block:
        """The weight's scale layout, ``spec.block``."""
        return self.spec.block

    @property
    def operand(self) -> NVFP4Operand:
        """The weight as an fprop operand (N, K), blocks along K, carrying ``self.spec``."""
        return NVFP4Operand(self.qdata, self.scale, self.outer_scale, self.spec)

    @property
    def weight(self) -> NVFP4Tensor:
        """The frozen weight (out, in) as an NVFP4Tensor (no copy); ``.dequantize()`` for values."""
        return NVFP4Tensor.from_operand(self.operand, self.dtype, backend=self.recipe.backend.value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4FrozenLinear expects input (..., {self.in_features}), got "
                             f"{tuple(x.shape)}")
        backend = backend_name(self.recipe.backend.value, self.qdata.device)
        x2 = x.reshape(-1, self.in_features)
        y = forward_gemms(gemms.Dense(given=self.operand), x2, None, self.bias, self.gemm_recipe(),
                          self.rht_signs, self.sr_state(), backend, out_dtype(x))
        if self.captured is not None and self.gemm == "nvfp4" and x2.shape[0]:
            # the weight is not recorded: its stored codes have no high-precision original to
            # measure against (``weight`` gives them)
            self._capture(0, x2, None, y, DenseRecorder(backend, self.captured.keep))
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> nn.Linear:
        """A plain nn.Linear of this layer's shape, in its train mode, holding the weight
        dequantized (``reference.dequantize``: exact in float32) and cast to the layer's
        ``dtype``, and the bias cast to it, as Parameters that do not require grad (the weight
        was frozen)."""
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        lin.weight = nn.Parameter(R.dequantize(self.operand).to(self.dtype), requires_grad=False)
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.to(self.dtype), requires_grad=False)
        lin.train(self.training)
        return lin

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.block.value} scales, gemm={self.gemm}, "
                f"{self.recipe_repr()}")


# checkpoint layout -> (codes, block scales, global scale) tensor names, and whether the global
# scale is an encode scale (2688 / amax: compressed-tensors) or a decode scale (ModelOpt)
_LAYOUTS = {"compressed-tensors": (("weight_packed", "weight_scale", "weight_global_scale"), True),
            "modelopt": (("weight", "weight_scale", "weight_scale_2"), False)}
# activation scales of the checkpoint; the frozen layers quantize activations dynamically
_INPUT_SCALES = ("input_global_scale", "input_scale")


def checkpoint_format(path: str) -> str:
    """The layout of checkpoint directory ``path``: "compressed-tensors" or "modelopt".

    Raises:
        ValueError: no config.json / hf_quant_config.json saying NVFP4 in one of the two layouts.
    """
    for name in ("config.json", "hf_quant_config.json"):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            continue
        with open(file) as f:
            data = json.load(f)
        qc = data.get("quantization_config", data.get("quantization", {}))
        if qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "nvfp4-pack-quantized":
            return "compressed-tensors"
        if qc.get("quant_algo") == "NVFP4":
            return "modelopt"
    raise ValueError(f"load_frozen: {path} holds no NVFP4 checkpoint config (config.json's "
                     f"quantization_config: compressed-tensors format 'nvfp4-pack-quantized', or "
                     f"ModelOpt quant_algo 'NVFP4')")


def read_checkpoint(path: str) -> Tuple[str, Dict[str, Tuple[torch.Tensor, ...]], Dict[str, torch.Tensor]]:
    """Read an NVFP4 checkpoint directory (every ``*.safetensors`` file in it).

    Returns:
        (layout, {layer fqn: (codes uint8 (N, K/2), scales float8_e4m3fn (N, K/16), decode
        scale float32 ())}, {name: tensor} of everything else, activation scales left out).
        A compressed-tensors global scale G becomes the decode scale ``1 / G`` (fp32 division:
        training's outer scale bit for bit for an export of this package).
    Raises:
        ValueError: see :func:`checkpoint_format`; no safetensors file.
    """
    from safetensors.torch import load_file  # noqa: PLC0415  (optional dependency: [export])
    layout = checkpoint_format(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"load_frozen: no *.safetensors file in {path}")
    tensors = {k: v for file in files for k, v in load_file(file).items()}
    (codes, scales, outer), encode = _LAYOUTS[layout]
    layers = {}
    for key in [k for k in tensors if k.endswith("." + outer)]:
        fqn = key[: -len(outer) - 1]
        g = tensors.pop(key).float().reshape(())
        layers[fqn] = (tensors.pop(f"{fqn}.{codes}"), tensors.pop(f"{fqn}.{scales}"),
                       R.decode_scale(g) if encode else g)
        for name in _INPUT_SCALES:
            tensors.pop(f"{fqn}.{name}", None)
    return layout, layers, tensors


def load_frozen(model: nn.Module, path: str, recipe: Optional[NVFP4Recipe] = None,
                gemm: str = "nvfp4") -> nn.Module:
    """Load the NVFP4 checkpoint directory ``path`` into ``model`` as a frozen NVFP4 base.

    Each linear the checkpoint holds in NVFP4 is replaced by an :class:`NVFP4FrozenLinear` (its
    codes, scales and global scale; no high-precision weight), and each experts module
    ``quantize_`` knows whose per-expert linears it holds in NVFP4 (an export's MoE layers) by a
    frozen experts module (``frozen_experts.load_experts``: Hugging Face's batched experts and
    torchtitan's ``GroupedExperts``); every other tensor of the checkpoint is loaded into the
    model as it is (``load_state_dict(assign=True)``, so a model built on the meta device is
    materialized by the load; its buffers the checkpoint does not hold, such as Hugging Face's
    rotary ``inv_freq``, are set by the model's initialization, :func:`_materialize_buffers`).
    The checkpoint's names are read as ``save_pretrained`` writes the model's
    (:func:`_model_names`: Mixtral's ``block_sparse_moe`` is the model's ``mlp``). The frozen
    modules take the dtype of the module they replace, ``recipe`` (default ``NVFP4Recipe()``) for
    their activation and gradient quantization, and each its own SR streams from its name
    (``layer.layer_seed``, as ``quantize_`` gives the trained module); ``gemm`` as in
    :class:`NVFP4FrozenLinear`. Parameters are not frozen here: PEFT freezes the base model, or
    call ``requires_grad_(False)``.

    Args:
        model: the architecture of the checkpoint in high precision (a Hugging Face model from its
            config, the main job's TinyLM, ...), on any device.
        path: a directory written by :func:`serving.export` or another producer of either layout.
    Returns:
        ``model``.
    Raises:
        ValueError: see :func:`read_checkpoint` and ``frozen_experts.load_experts``; a checkpoint
            layer missing from the model or not an nn.Linear of its shape; checkpoint tensors the
            model lacks or model tensors the checkpoint lacks (named); buffers of a meta-built
            model nothing sets (named).
    """
    _, layers, rest = read_checkpoint(path)
    recipe = NVFP4Recipe() if recipe is None else recipe
    experts = load_experts(model, layers, rest, recipe, gemm)
    names = _model_names(model, experts)
    layers = {names.get(f"{fqn}.weight", f"{fqn}.weight").removesuffix(".weight"): t
              for fqn, t in layers.items()}
    rest = {names.get(k, k): t for k, t in rest.items()}
    modules = dict(model.named_modules())
    for fqn, (qdata, scale, outer) in layers.items():
        old = modules.get(fqn)
        if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != (qdata.shape[0], 2 * qdata.shape[1]):
            raise ValueError(f"load_frozen: checkpoint layer {fqn!r} {tuple(qdata.shape)} packed is not an "
                             f"nn.Linear of that shape in the model (found {type(old).__name__})")
        device = old.weight.device if old.weight.device.type != "meta" else torch.device("cpu")
        bias = rest.pop(f"{fqn}.bias", None)
        new = NVFP4FrozenLinear(qdata.to(device), scale.to(device), outer.to(device),
                                None if bias is None else bias.to(device, old.weight.dtype),
                                recipe, old.weight.dtype, gemm, layer_seed(fqn))
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent), name, new)
    result = model.load_state_dict(rest, strict=False, assign=True)
    frozen = {f"{fqn}.{k}" for fqn in [*layers, *experts] for k in model.get_submodule(fqn).state_dict()}
    missing = [k for k in result.missing_keys if k not in frozen]
    if missing or result.unexpected_keys:
        raise ValueError(f"load_frozen: the checkpoint does not match the model: missing "
                         f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    _materialize_buffers(model)
    return model


def _model_names(model: nn.Module, skip: Set[str]) -> Dict[str, str]:
    """{the name ``save_pretrained`` gives a tensor of ``model.state_dict()``: its name in the
    model} for the tensors outside the modules ``skip`` (the experts read already), found by
    reverting transformers' weight conversion (``checkpoint_names.saved_layout``) on one-element
    markers: a tensor the model holds under another name than its checkpoint (Mixtral's router,
    ``mlp.gate`` in the model and ``block_sparse_moe.gate`` in the checkpoint) is read into it.
    The names a model that transformers does not convert saves are its own."""
    prefixes = tuple(f"{fqn}." for fqn in skip)
    keys = [k for k in model.state_dict() if not k.startswith(prefixes)]
    saved = saved_layout(model, {k: torch.tensor([float(i)]) for i, k in enumerate(keys)})
    return {name: keys[int(t.item())] for name, t in saved.items() if t.numel() == 1}


def _materialize_buffers(model: nn.Module) -> None:
    """Give the buffers a checkpoint does not hold (non-persistent ones, e.g. Hugging Face's rotary
    ``inv_freq``) of a model built on the meta device their values, as ``from_pretrained`` does:
    each one made on the model's device, filled with NaN, and set by the model's own
    initialization of its module (``model._init_weights(module)``, Hugging Face's).

    Raises:
        ValueError: naming the buffers the model has no initialization for (no
            ``_init_weights``, a non-floating buffer, or one the initialization leaves unset).
    """
    device = next((t.device for t in [*model.parameters(), *model.buffers()] if not t.is_meta),
                  torch.device("cpu"))
    init = getattr(model, "_init_weights", None)
    unset = []
    for fqn, module in model.named_modules():
        names = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if not names:
            continue
        prefix = f"{fqn}." if fqn else ""
        if init is None or not all(module._buffers[n].is_floating_point() for n in names):
            unset += [f"{prefix}{n}" for n in names]
            continue
        for n in names:
            module._buffers[n] = torch.full_like(module._buffers[n], torch.nan, device=device)
        init(module)
        unset += [f"{prefix}{n}" for n in names if module._buffers[n].isnan().any()]
    if unset:
        raise ValueError(f"load_frozen: the model was built on the meta device and these buffers "
                         f"are neither in the checkpoint nor set by the model's initialization: "
                         f"{unset[:5]}; build the model on a real device (or initialize them)")


MERGE_REFUSED = ("merging LoRA adapters into an NVFP4 frozen base is not supported: its weight is "
                 "NVFP4 codes, and the merged weight would need quantizing again. Keep the adapters "
                 "beside the base (export writes the base; PEFT's save_pretrained the adapters), or "
                 "merge them into the high-precision model the checkpoint came from")


@functools.lru_cache(maxsize=None)
def _frozen_lora_linear(linear: type) -> type:
    """PEFT's ``lora.Linear`` (``linear``) on an NVFP4FrozenLinear: ``merge`` (``merge_and_unload``)
    raises NotImplementedError with :data:`MERGE_REFUSED`."""
    def merge(self, *args, **kwargs):
        raise NotImplementedError(MERGE_REFUSED)
    return type("NVFP4FrozenLoraLinear", (linear,), {"merge": merge, "__module__": __name__})


def lora_config(**kwargs):
    """A ``peft.LoraConfig(**kwargs)`` that puts PEFT's ``lora.Linear`` on NVFP4FrozenLinear layers
    (PEFT's custom-module dispatch, ``LoraConfig._register_custom_module``); merging the adapters
    into the base raises NotImplementedError saying why. Raises ImportError when peft is not
    installed."""
    from peft import LoraConfig  # noqa: PLC0415  (optional dependency)
    from peft.tuners.lora.layer import Linear  # noqa: PLC0415
    config = LoraConfig(**kwargs)
    config._register_custom_module({NVFP4FrozenLinear: _frozen_lora_linear(Linear)})
    return config
