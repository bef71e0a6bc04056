"""Checkpoints out: an NVFP4-trained model's quantized linears as NVFP4 serving weights.

Two layouts, each a directory of ``model.safetensors`` and ``config.json`` (docs/serving.md):

- ``"compressed-tensors"`` (vLLM, SGLang; format ``nvfp4-pack-quantized``), per layer
  ``weight_packed`` uint8 (N, K/2), ``weight_scale`` float8_e4m3fn (N, K/16),
  ``weight_global_scale`` float32 (1,) and ``input_global_scale`` float32 (1,). The global scales
  are *encode* scales, ``2688 / amax`` (compressed-tensors ``generate_gparam``), and a value is
  ``code * (scale / global_scale)`` (``compressors/nvfp4/base.py``, ``_dequantize``).
- ``"modelopt"`` (TensorRT-LLM, vLLM, SGLang; NVIDIA ModelOpt's Hugging Face export, quant_algo
  NVFP4), per layer ``weight`` uint8 (N, K/2), ``weight_scale`` float8_e4m3fn (N, K/16),
  ``weight_scale_2`` float32 () and ``input_scale`` float32 (): *decode* scales, ``amax / 2688``
  (ModelOpt ``NVFP4QTensor.get_weights_scaling_factor_2``), a value being ``code * scale *
  weight_scale_2``; plus ``hf_quant_config.json``.

Both pack two E2M1 codes a byte, the even element in the low nibble, as this package does. The
exported weight is the one fprop used (``NVFP4Linear.quantized_weight``): a 16x16 tile scale is a
valid scale for each of its 16 rows, so a 2d-trained weight becomes 1x16 scales with the same codes.
The weight's global scale is training's ``S_enc`` (compressed-tensors) or ``S_dec = 1 / S_enc``
(ModelOpt), so ``fl32(1 / weight_global_scale)`` is training's outer scale bit for bit.
"""

import contextlib
import json
import logging
import os
from dataclasses import replace
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from . import reference as R
from .conv1d import NVFP4Conv1D
from .formats import BLOCK
from .layer import NVFP4Module
from .linear import NVFP4Linear
from .operand import NVFP4Operand
from .spec import Block, Scaling
from .version import package_version

__all__ = ["export", "record_amaxes", "FORMATS", "fprop_weight_1x16"]

log = logging.getLogger("nvfp4_recipe")

FORMATS = ("compressed-tensors", "modelopt")
WEIGHTS_FILE = "model.safetensors"
CT_FORMAT = "nvfp4-pack-quantized"
# compressed-tensors' QuantizationArgs of NVFP4 weights and activations (its "NVFP4" preset scheme)
_CT_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": BLOCK,
            "symmetric": True, "scale_dtype": "torch.float8_e4m3fn"}


def nvfp4_linears(model: nn.Module) -> Dict[str, NVFP4Linear]:
    """fqn -> NVFP4Linear of every quantized linear of ``model``, in module order."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, NVFP4Linear)}


@contextlib.contextmanager
def record_amaxes(model: nn.Module) -> Iterator[Dict[str, torch.Tensor]]:
    """Record, for each NVFP4Linear of ``model``, the largest ``max |x|`` of its input over the
    forwards run inside the context: the per-tensor amax fprop measured to quantize X.

    Yields ``{layer fqn: float32 0-d tensor on the layer's device}``, filled as forwards run (no
    host sync); :func:`export` turns it into the activation global scales. Run it around a few
    batches of the data the model will serve (an evaluation pass).
    """
    amaxes: Dict[str, torch.Tensor] = {}

    def hook(fqn: str):
        def record(module, args):
            amax = args[0].detach().abs().amax().float()
            amaxes[fqn] = torch.maximum(amaxes[fqn], amax) if fqn in amaxes else amax
        return record

    handles = [m.register_forward_pre_hook(hook(fqn)) for fqn, m in nvfp4_linears(model).items()]
    try:
        yield amaxes
    finally:
        for handle in handles:
            handle.remove()


def fprop_weight_1x16(layer: NVFP4Linear) -> Tuple[NVFP4Operand, torch.Tensor]:
    """The weight fprop used, with 1x16 block scales, and its encode scale.

    Returns:
        (operand, s_enc): codes uint8 (N, K/2), float8_e4m3fn scales (N, K/16) (a 16x16 tile's
        scale repeated on its 16 rows), outer (decode) scale float32 (), its spec W's with 1d
        blocks (the same codes and scales, laid out 1x16); and the float32 ()
        encode scale ``S_enc = min(2688 / amax(W), FLT_MAX)`` with ``1 / S_enc`` = the outer scale.
    """
    with torch.no_grad():
        op = layer.quantized_weight().operand
        s_enc = R.encode_scale(R.amax(layer.fprop_weight(), Scaling.PER_TENSOR))
    scale = op.scale
    if op.block is Block.D2:  # float8 has no repeat_interleave: repeat its bits
        scale = scale.view(torch.uint8).repeat_interleave(BLOCK, dim=0).view(torch.float8_e4m3fn)
    return NVFP4Operand(op.qdata, scale, op.outer_scale, replace(op.spec, block=Block.D1)), s_enc


def _layer_tensors(fmt: str, layer: NVFP4Linear, input_amax: Optional[torch.Tensor]
                   ) -> Dict[str, torch.Tensor]:
    """The NVFP4 tensors of one layer in layout ``fmt`` (names relative to the layer)."""
    op, s_enc = fprop_weight_1x16(layer)
    if fmt == "compressed-tensors":
        out = {"weight_packed": op.qdata, "weight_scale": op.scale,
               "weight_global_scale": s_enc.reshape(1)}
        if input_amax is not None:
            out["input_global_scale"] = R.encode_scale(input_amax).reshape(1)
        return out
    out = {"weight": op.qdata, "weight_scale": op.scale, "weight_scale_2": op.outer_scale}
    out["input_scale"] = R.decode_scale(R.encode_scale(input_amax))
    return out


def _ct_config(ignore, static_inputs: bool) -> dict:
    """config.json's ``quantization_config`` of a compressed-tensors export (its QuantizationConfig)."""
    activations = dict(_CT_ARGS, dynamic="local" if static_inputs else True,
                       observer="static_minmax" if static_inputs else None)
    group = {"targets": ["Linear"], "weights": dict(_CT_ARGS, dynamic=False, observer="minmax"),
             "input_activations": activations, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": CT_FORMAT,
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ignore, "kv_cache_scheme": None}


def _modelopt_config(ignore) -> Tuple[dict, dict]:
    """(hf_quant_config.json, config.json's ``quantization_config``) of a ModelOpt export."""
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": BLOCK,
             "exclude_modules": ignore}
    producer = {"name": "nvfp4-recipe", "version": package_version()}
    return ({"producer": producer, "quantization": quant},
            {"quant_method": "modelopt", **quant, "producer": producer})


def _check_args(model: nn.Module, path: str, fmt: str, input_amax, allow_per_token: bool
                ) -> Dict[str, NVFP4Linear]:
    """The layers to export. Raises ValueError/TypeError naming the problem (see :func:`export`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"export takes an nn.Module as model, got {type(model).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"export: unknown format {fmt!r}; expected one of {FORMATS}")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ValueError(f"export: {path} exists and is not an empty directory")
    layers = nvfp4_linears(model)
    if not layers:
        raise ValueError("export: the model has no NVFP4Linear layer; quantize_(model, NVFP4Recipe()) "
                         "and train it first")
    for fqn, layer in layers.items():
        if isinstance(layer, NVFP4Conv1D):
            raise ValueError(f"export: {fqn} is an NVFP4Conv1D (GPT-2's Conv1D, weight stored (in, "
                             f"out)); the serving layouts hold nn.Linear weights (out, in)")
        if layer.recipe.scaling is Scaling.PER_TOKEN and not allow_per_token:
            raise ValueError(
                f"export: {fqn} was trained with per-token activation scales (NVFP4Recipe.scaling="
                f"'per_token'); the serving layouts have one per-tensor activation global scale. "
                f"Pass allow_per_token=True to export it from the largest amax seen (the server then "
                f"quantizes activations per tensor, unlike training)")
    if input_amax is None and fmt == "modelopt":
        raise ValueError("export: the modelopt layout needs static input scales: record them with "
                         "`with record_amaxes(model) as amaxes:` around a few forwards and pass "
                         "input_amax=amaxes")
    missing = [fqn for fqn in layers if input_amax is not None and fqn not in input_amax]
    if missing:
        raise ValueError(f"export: input_amax has no entry for {len(missing)} NVFP4 layers, e.g. "
                         f"{missing[0]!r}: record_amaxes records a layer only when it runs")
    return layers


def _unique_storage(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Contiguous CPU tensors, a tensor sharing storage with an earlier one (tied weights) copied:
    safetensors refuses shared storage."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _high_precision_state(model: nn.Module, layers: Dict[str, NVFP4Linear]) -> Dict[str, torch.Tensor]:
    """The model's state dict without the NVFP4 weights and the NVFP4 modules' recipe buffers."""
    drop = {f"{fqn}.weight" for fqn in layers}
    for fqn, m in model.named_modules():
        if isinstance(m, NVFP4Module):
            drop.update(f"{fqn}.{name}" for name, _ in m.named_buffers(recurse=False))
            if fqn not in layers:
                log.warning("export: %s (%s) is exported in high precision: the serving layouts of "
                            "NVFP4 experts are not written yet", fqn, type(m).__name__)
    return {k: v for k, v in model.state_dict().items() if k not in drop}


def export(model: nn.Module, path: str, format: str = "compressed-tensors", *,
           input_amax: Optional[Dict[str, torch.Tensor]] = None, config: Optional[dict] = None,
           allow_per_token: bool = False) -> str:
    """Write ``model`` as an NVFP4 checkpoint directory for serving (module docstring, docs/serving.md).

    Every NVFP4Linear becomes the NVFP4 weight fprop used (codes and E4M3 scales bit for bit) in
    layout ``format``; everything else (embeddings, norms, biases, linears kept in high precision,
    listed in the config's ignore / exclude_modules) is written as it is in the state dict.

    Activation global scales, from ``input_amax`` (:func:`record_amaxes`: the largest per-tensor
    amax of each layer's input seen): ``2688 / amax`` (compressed-tensors ``input_global_scale``,
    activations ``dynamic: "local"``) or ``amax / 2688`` (ModelOpt ``input_scale``), the scale that
    training's per-tensor quantizer derives from that amax. Without ``input_amax``, a
    compressed-tensors export declares the activations ``dynamic: true`` (global scale per tensor
    at run time, as in training); ModelOpt's layout has no dynamic form and needs ``input_amax``.

    Args:
        model: a model with NVFP4Linear layers (``quantize_``), any device.
        path: a directory that does not exist or is empty.
        format: "compressed-tensors" or "modelopt".
        input_amax: {layer fqn: float32 amax} for every NVFP4Linear, or None (see above).
        config: the model's configuration for config.json (default: ``model.config.to_dict()``
            for a Hugging Face model, else nothing); ``quantization_config`` is added to it.
        allow_per_token: export layers trained with per-token activation scales, giving them the
            per-tensor input scale of the largest amax seen (servers then quantize activations
            per tensor, which training did not).
    Returns:
        ``path``.
    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: an unknown format; ``path`` is a file or a non-empty directory; no
            NVFP4Linear in the model; an NVFP4Conv1D; a per-token recipe without
            ``allow_per_token``; a layer missing from ``input_amax`` (or no ``input_amax`` for
            ModelOpt).
        ImportError: safetensors is not installed (``pip install 'nvfp4-recipe[export]'``).
    """
    from safetensors.torch import save_file  # noqa: PLC0415  (optional dependency: [export])
    layers = _check_args(model, path, format, input_amax, allow_per_token)
    tensors = _high_precision_state(model, layers)
    for fqn, layer in layers.items():
        amax = None if input_amax is None else input_amax[fqn]
        tensors.update({f"{fqn}.{k}": v for k, v in _layer_tensors(format, layer, amax).items()})
    ignore = [fqn for fqn, m in model.named_modules()
              if isinstance(m, nn.Linear) and fqn not in layers]
    if config is None:
        config = model.config.to_dict() if hasattr(getattr(model, "config", None), "to_dict") else {}
    config = dict(config)
    os.makedirs(path, exist_ok=True)
    if format == "compressed-tensors":
        config["quantization_config"] = _ct_config(ignore, input_amax is not None)
    else:
        hf_quant, config["quantization_config"] = _modelopt_config(ignore)
        _write_json(os.path.join(path, "hf_quant_config.json"), hf_quant)
    _write_json(os.path.join(path, "config.json"), config)
    save_file(_unique_storage(tensors), os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
