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
exported weight of a layer is the one the model computes with (``export_weights``): fprop's for an
``NVFP4Linear`` (a 16x16 tile scale is a valid scale for each of its 16 rows, so a 2d-trained weight
becomes 1x16 scales with the same codes), the stored one for an ``NVFP4FrozenLinear``. The weight's
global scale is training's ``S_enc`` (with the 4/6 bound where the recipe has one) for
compressed-tensors or ``S_dec = 1 / S_enc`` for ModelOpt, so ``fl32(1 / weight_global_scale)`` is
training's outer scale bit for bit; the members of a fused group (q/k/v, gate/up) share one.

The experts modules of an MoE model (``moe.py``) are written as serving engines load them: one
NVFP4 linear per expert and projection (``export_experts``: names as ``save_pretrained`` writes
them, e.g. ``mlp.experts.{e}.gate_proj``), each with the tensors above, its weight fprop's W_g
(``export_weights.expert_weights``) and each expert's gate and up one global scale; the rest of a
Hugging Face model is named as ``save_pretrained`` writes it too (``checkpoint_names``).

The directory is written atomically: into a temporary sibling directory renamed into place at the
end, so a failure leaves ``path`` as it was.
"""

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from . import reference as R
from .checkpoint_names import saved_layout
from .conv1d import NVFP4Conv1D
from .export_experts import (ExpertProjection, expert_groups, expert_projections,
                             high_precision_experts, record_expert_amaxes)
from .export_weights import ServingWeight, expert_weights, serving_weight, unify_groups
from .formats import BLOCK
from .frozen import NVFP4FrozenLinear
from .fused import fused_groups
from .layer import NVFP4Module
from .linear import NVFP4Linear
from .moe import NVFP4Experts
from .spec import Scaling
from .version import package_version

__all__ = ["export", "record_amaxes", "serving_layers", "check_exportable", "FORMATS",
           "fprop_weight_1x16"]

log = logging.getLogger("nvfp4_recipe")

FORMATS = ("compressed-tensors", "modelopt")
WEIGHTS_FILE = "model.safetensors"
CT_FORMAT = "nvfp4-pack-quantized"
# compressed-tensors' QuantizationArgs of NVFP4 weights and activations (its "NVFP4" preset scheme)
_CT_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": BLOCK,
            "symmetric": True, "scale_dtype": "torch.float8_e4m3fn"}
_SERVED = (NVFP4Linear, NVFP4FrozenLinear)
# the name bench_lora.py imports: (1x16 operand, encode scale) of a layer
fprop_weight_1x16 = serving_weight


def _base_model(model: nn.Module) -> nn.Module:
    """The model a PEFT ``PeftModel`` wraps (its LoRA layers hold the base layers), else ``model``."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(
        model, "get_base_model") else model


def serving_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """fqn -> layer of every ``NVFP4Linear`` and ``NVFP4FrozenLinear`` of ``model``, in module
    order, under the name a server gives it: a PEFT LoRA layer's ``base_layer`` under the LoRA
    layer's name (the adapters are not part of the base checkpoint)."""
    out = {}
    for fqn, m in _base_model(model).named_modules():
        if isinstance(m, _SERVED):
            parent, _, name = fqn.rpartition(".")
            out[parent if name == "base_layer" else fqn] = m
    return out


@contextlib.contextmanager
def record_amaxes(model: nn.Module) -> Iterator[Dict[str, torch.Tensor]]:
    """Record, for each NVFP4 layer of ``model`` (:func:`serving_layers`) and each projection of
    each expert of its experts modules (``export_experts.expert_projections``), the largest
    ``max |x|`` of its input over the forwards run inside the context: the per-tensor amax fprop
    measured to quantize X (for an expert, of the tokens routed to it: the grouped GEMMs quantize
    each expert's tokens with their own outer scale).

    Yields ``{served name: float32 0-d tensor on the layer's device}``, filled as forwards run (no
    host sync for a linear; the experts modules record through ``captured``, as
    ``inspect.capture`` does, which costs about one more fprop of theirs); :func:`export` turns it
    into the activation global scales. Run it around a few batches of the data the model will
    serve (an evaluation pass), not inside ``inspect.capture``. An expert no token reaches records
    nothing.

    Raises:
        ValueError: an experts module whose serving layout is unknown (``expert_projections``).
    """
    amaxes: Dict[str, torch.Tensor] = {}

    def hook(fqn: str):
        def record(module, args):
            amax = args[0].detach().abs().amax().float()
            amaxes[fqn] = torch.maximum(amaxes[fqn], amax) if fqn in amaxes else amax
        return record

    experts = expert_projections(_base_model(model))
    handles = [m.register_forward_pre_hook(hook(fqn)) for fqn, m in serving_layers(model).items()]
    try:
        with record_expert_amaxes(experts, amaxes):
            yield amaxes
    finally:
        for handle in handles:
            handle.remove()


def _layer_tensors(fmt: str, weight: ServingWeight, input_amax: Optional[torch.Tensor]
                   ) -> Dict[str, torch.Tensor]:
    """The NVFP4 tensors of one layer in layout ``fmt`` (names relative to the layer)."""
    op = weight.op
    if fmt == "compressed-tensors":
        out = {"weight_packed": op.qdata, "weight_scale": op.scale,
               "weight_global_scale": weight.s_enc.reshape(1)}
        if input_amax is not None:
            out["input_global_scale"] = R.encode_scale(input_amax).reshape(1)
        return out
    return {"weight": op.qdata, "weight_scale": op.scale, "weight_scale_2": op.outer_scale.reshape(()),
            "input_scale": R.decode_scale(R.encode_scale(input_amax))}


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


def _amax_value(fqn: str, value: Union[float, int, torch.Tensor]) -> torch.Tensor:
    """``input_amax[fqn]`` as a float32 0-d CPU tensor.

    Raises:
        ValueError: not a number or a one-element tensor, or not finite and > 0 (named).
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        amax = value.detach().reshape(()).float().cpu()
    elif isinstance(value, (float, int)) and not isinstance(value, bool):
        amax = torch.tensor(float(value), dtype=torch.float32)
    else:
        raise ValueError(f"export: input_amax[{fqn!r}] must be a float or a one-element float "
                         f"tensor, got {value!r}")
    if not (math.isfinite(amax.item()) and amax.item() > 0):
        raise ValueError(f"export: input_amax[{fqn!r}] is {amax.item()}: an activation amax must "
                         f"be finite and > 0 (it becomes the global scale 2688 / amax)")
    return amax


def _with_unrouted_experts(experts: Dict[str, ExpertProjection], input_amax) -> dict:
    """``input_amax`` with an entry for each expert projection that has none (no token was routed
    to the expert while the amaxes were recorded): the largest amax recorded for that Parameter of
    its module, logged. A Parameter no expert recorded stays without entries.

    Raises:
        ValueError: a bad recorded value (:func:`_amax_value`).
    """
    out = dict(input_amax)
    siblings: Dict[Tuple[str, str], List[str]] = {}
    for name, p in experts.items():
        siblings.setdefault((p.fqn, p.param), []).append(name)
    for (fqn, param), names in siblings.items():
        missing = [n for n in names if n not in input_amax]
        recorded = [_amax_value(n, input_amax[n]) for n in names if n in input_amax]
        if missing and recorded:
            out.update(dict.fromkeys(missing, torch.stack(recorded).amax()))
            log.warning("export: %d experts of %s had no token routed to them while input_amax was "
                        "recorded; their %s input scale is from the largest amax of the others",
                        len({experts[n].expert for n in missing}), fqn, param)
    return out


def _input_amaxes(names: List[str], experts: Dict[str, ExpertProjection], input_amax, groups
                  ) -> Optional[Dict[str, torch.Tensor]]:
    """The validated input amaxes of the served linears ``names`` (``experts`` among them: an
    unrouted expert gets :func:`_with_unrouted_experts`'), each fused group's members given the
    group's largest (they read one input; servers keep one input scale per fused GEMM), or None.

    Raises:
        ValueError: a layer without an entry, or a bad value (:func:`_amax_value`).
    """
    if input_amax is None:
        return None
    input_amax = _with_unrouted_experts(experts, input_amax)
    missing = [fqn for fqn in names if fqn not in input_amax]
    if missing:
        raise ValueError(f"export: input_amax has no entry for {len(missing)} NVFP4 layers, e.g. "
                         f"{missing[0]!r}: record_amaxes records a layer only when it runs")
    amaxes = {fqn: _amax_value(fqn, input_amax[fqn]) for fqn in names}
    for fqns in groups:
        shared = torch.stack([amaxes[f] for f in fqns]).amax()
        amaxes.update(dict.fromkeys(fqns, shared))
    return amaxes


def _check_materialized(model: nn.Module) -> None:
    """Raises ValueError naming the first parameter or buffer on the meta device or holding
    non-finite values (uninitialized memory, e.g. after ``to_empty`` without an init)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise ValueError(f"export: {name} is on the meta device: materialize the model "
                             f"(to_empty() and initialize it, or load its weights) first")
        if t.is_floating_point() and not torch.isfinite(t.detach().float()).all():
            raise ValueError(f"export: {name} holds non-finite values (NaN/Inf: uninitialized "
                             f"memory, or a diverged run); nothing was written")


def _tied(model: nn.Module, layers: Dict[str, nn.Module]) -> List[str]:
    """The NVFP4Linear layers whose weight Parameter another module shares (an lm_head tied to
    the input embedding): a server ties them to the high-precision tensor."""
    owners: Dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [fqn for fqn, m in layers.items() if isinstance(m, NVFP4Linear) and owners[id(m.weight)] > 1]


def _experts_modules(experts: Dict[str, ExpertProjection]) -> Dict[str, NVFP4Experts]:
    """fqn -> experts module of the projections ``experts``."""
    return {p.fqn: p.module for p in experts.values()}


def _check_layers(layers: Dict[str, nn.Module], experts: Dict[str, ExpertProjection],
                  allow_per_token: bool) -> None:
    """Raises ValueError for no layer, an NVFP4Conv1D, or a per-token recipe without
    ``allow_per_token`` (see :func:`export`)."""
    if not layers and not experts:
        raise ValueError("export: the model has no NVFP4 layer (NVFP4Linear, NVFP4FrozenLinear or "
                         "NVFP4 experts) to write in NVFP4 (quantize_ a model with an NVFP4Recipe "
                         "that leaves a linear in NVFP4, or load_frozen a checkpoint)")
    for fqn, layer in {**layers, **_experts_modules(experts)}.items():
        if isinstance(layer, NVFP4Conv1D):
            raise ValueError(f"export: {fqn} is an NVFP4Conv1D (GPT-2's Conv1D, weight stored (in, "
                             f"out)); the serving layouts hold nn.Linear weights (out, in)")
        if layer.recipe.scaling is Scaling.PER_TOKEN and not allow_per_token:
            raise ValueError(
                f"export: {fqn} was trained with per-token activation scales (NVFP4Recipe.scaling="
                f"'per_token'); the serving layouts have one per-tensor activation global scale. "
                f"Pass allow_per_token=True to export it from the largest amax seen (the server then "
                f"quantizes activations per tensor, unlike training)")


def check_exportable(model: nn.Module, allow_per_token: bool = False) -> None:
    """Whether :func:`export` would write ``model``'s layers (a model on the meta device may be
    asked: its weights are not read).

    Raises:
        ValueError: no NVFP4 layer; an NVFP4Conv1D; a per-token recipe without
            ``allow_per_token``; an experts module whose serving layout is unknown.
    """
    _check_layers(serving_layers(model), expert_projections(_base_model(model)), allow_per_token)


def _check_args(model: nn.Module, path: str, fmt: str, input_amax, allow_per_token: bool) -> None:
    """Raises TypeError/ValueError naming the problem (see :func:`export`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"export takes an nn.Module as model, got {type(model).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"export: unknown format {fmt!r}; expected one of {FORMATS}")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ValueError(f"export: {path} exists and is not an empty directory")
    if input_amax is None and fmt == "modelopt":
        raise ValueError("export: the modelopt layout needs static input scales: record them with "
                         "`with record_amaxes(model) as amaxes:` around a few forwards and pass "
                         "input_amax=amaxes")
    check_exportable(model, allow_per_token)
    _check_materialized(model)


def _high_precision_state(model: nn.Module, layers: Dict[str, nn.Module],
                          experts: Dict[str, NVFP4Experts]) -> Dict[str, torch.Tensor]:
    """The model's state dict without the exported layers and experts modules (their NVFP4
    tensors and bias are written instead; a PEFT LoRA layer's adapters are dropped with a warning)
    and without the other NVFP4 modules' recipe buffers."""
    drop, exported = set(), {id(m) for m in layers.values()}
    for fqn, m in model.named_modules():
        if isinstance(m, NVFP4Module) and id(m) not in exported:
            drop.update(f"{fqn}.{name}" for name, _ in m.named_buffers(recurse=False))
    adapters = [fqn for fqn, m in layers.items() if model.get_submodule(fqn) is not m]
    if adapters:
        log.warning("export: the LoRA adapters of %s are not merged into the NVFP4 base; the export "
                    "holds the base only (save the adapters with PEFT's save_pretrained and serve "
                    "them with the engine's LoRA support)", ", ".join(adapters))
    prefixes = tuple(f"{fqn}." for fqn in [*layers, *experts])
    return {k: v for k, v in model.state_dict().items()
            if k not in drop and not k.startswith(prefixes)}


def _hf_config(model: nn.Module) -> dict:
    """config.json of a Hugging Face model as ``save_pretrained`` writes it (``architectures``
    and ``dtype`` filled in), else {}."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        return {}
    out = config.to_dict()
    out["architectures"] = [type(model).__name__]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def _state(model: nn.Module, fmt: str, layers: Dict[str, nn.Module],
           experts: Dict[str, ExpertProjection], input_amax, groups) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: the high-precision state and each layer's NVFP4 tensors
    (and bias), named as ``save_pretrained`` writes them, and each expert projection's; the fused
    groups sharing their global scales."""
    expert_sets = expert_groups(experts)
    amaxes = _input_amaxes([*layers, *experts], experts, input_amax, [*groups, *expert_sets])
    weights = unify_groups({fqn: serving_weight(m) for fqn, m in layers.items()}, layers, groups)
    weights.update(expert_weights(experts, expert_sets))

    def nvfp4(name: str) -> Dict[str, torch.Tensor]:
        amax = None if amaxes is None else amaxes[name]
        return {f"{name}.{k}": v for k, v in _layer_tensors(fmt, weights[name], amax).items()}

    tensors = _high_precision_state(model, layers, _experts_modules(experts))
    for fqn, layer in layers.items():
        tensors.update(nvfp4(fqn))
        if layer.bias is not None:
            tensors[f"{fqn}.bias"] = layer.bias
    tensors = saved_layout(model, tensors)
    for name in experts:  # named as saved already
        tensors.update(nvfp4(name))
    return tensors


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


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)


def _write_atomically(path: str, files: Dict[str, dict], tensors: Dict[str, torch.Tensor]) -> None:
    """Write the json ``files`` ({name: data}) and the safetensors file into a temporary sibling
    directory of ``path`` and rename it to ``path`` (replacing an empty directory) at the end; on
    any failure the temporary directory is removed and ``path`` is as it was."""
    from safetensors.torch import save_file  # noqa: PLC0415  (optional dependency: [export])
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.", suffix=".tmp",
                           dir=parent)
    try:
        for name, data in files.items():
            _write_json(os.path.join(tmp, name), data)
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export(model: nn.Module, path: str, format: str = "compressed-tensors", *,
           input_amax: Optional[Dict[str, Union[float, torch.Tensor]]] = None,
           config: Optional[dict] = None, allow_per_token: bool = False) -> str:
    """Write ``model`` as an NVFP4 checkpoint directory for serving (module docstring, docs/serving.md).

    Every NVFP4Linear becomes the NVFP4 weight fprop used (codes and E4M3 scales bit for bit) and
    every NVFP4FrozenLinear its stored weight, in layout ``format``; the members of a fused group
    (q/k/v, gate/up) share one global scale (``export_weights.unify_groups``: quantized again,
    with a warning giving the error, where training did not share it). Every NVFP4 experts
    module becomes one NVFP4 linear per expert and projection (``export_experts``), each expert's
    W_g as fprop quantizes it, its gate and up sharing one global scale (torchtitan's w1/w3,
    quantized apart in training, quantized again with the larger amax where they differ, with a
    warning giving the error). A PEFT model is exported as its base (LoRA adapters left out, with
    a warning). Everything else (embeddings, norms, biases, linears and experts kept in high
    precision, listed in the config's ignore / exclude_modules: the linears, and the per-expert
    linears of Hugging Face experts) is written as it is in the state dict, a Hugging Face
    model's tensors under the names ``save_pretrained`` gives them (``checkpoint_names``). An
    NVFP4 lm_head tied to the input embedding is exported in high precision (the embedding's
    tensor, which a server ties it to) with a warning.

    Activation global scales, from ``input_amax`` (:func:`record_amaxes`: the largest per-tensor
    amax of each layer's input seen): ``2688 / amax`` (compressed-tensors ``input_global_scale``,
    activations ``dynamic: "local"``) or ``amax / 2688`` (ModelOpt ``input_scale``), the scale that
    training's per-tensor quantizer derives from that amax. Without ``input_amax``, a
    compressed-tensors export declares the activations ``dynamic: true``, which only
    compressed-tensors itself (transformers) runs, without a global scale (docs/serving.md says
    what that loses); vLLM's and SGLang's W4A4 kernels need ``input_amax``, as ModelOpt does.
    Each expert projection gets its expert's amax; an expert no recorded token reached gets the
    largest of its module's others, with a warning.

    Args:
        model: a model with NVFP4Linear or NVFP4 experts modules (``quantize_``) or
            NVFP4FrozenLinear (``load_frozen``) layers, materialized, any device.
        path: a directory that does not exist or is empty; written atomically.
        format: "compressed-tensors" or "modelopt".
        input_amax: {served name: amax} for every NVFP4 layer and expert projection (a float or
            a one-element float tensor, finite and > 0), or None (see above).
        config: the model's configuration for config.json (default: a Hugging Face model's
            config as ``save_pretrained`` writes it, ``architectures`` and ``dtype`` included;
            else nothing); ``quantization_config`` is added to it.
        allow_per_token: export layers trained with per-token activation scales, giving them the
            per-tensor input scale of the largest amax seen (servers then quantize activations
            per tensor, which training did not).
    Returns:
        ``path``.
    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: an unknown format; ``path`` is a file or a non-empty directory; no NVFP4
            layer in the model; an NVFP4Conv1D; a per-token recipe without ``allow_per_token``;
            an experts module whose serving layout is unknown; a parameter or buffer on the meta
            device or not finite; a layer (or every expert of a module) missing from
            ``input_amax`` or an amax that is not finite and > 0 (or no ``input_amax`` for
            ModelOpt). Nothing is written then.
        ImportError: safetensors is not installed (``pip install 'nvfp4-recipe[export]'``).
    """
    _check_args(model, path, format, input_amax, allow_per_token)
    base = _base_model(model)
    layers = serving_layers(model)
    experts = expert_projections(base)
    for fqn in _tied(base, layers):
        log.warning("export: %s is tied to another module's weight (tie_word_embeddings): it is "
                    "exported in high precision, as the server ties it, not as trained in NVFP4", fqn)
        del layers[fqn]
    if not layers and not experts:
        raise ValueError("export: the model's only NVFP4 layers are tied to high-precision "
                         "weights; nothing would be exported in NVFP4")
    exported = {id(m) for m in layers.values()}
    groups = fused_groups(base, lambda m: m is not None and id(_served(m)) in exported)
    if input_amax is None and format == "compressed-tensors":
        log.warning("export: no input_amax: the activations are declared dynamic, which vLLM's and "
                    "SGLang's NVFP4 W4A4 kernels do not run (they read input_global_scale); pass "
                    "input_amax from record_amaxes for them (docs/serving.md)")
    tensors = _unique_storage(_state(base, format, layers, experts, input_amax, groups))
    ignore = [fqn for fqn, m in base.named_modules()
              if isinstance(m, nn.Linear) and fqn not in layers and not _inside(fqn, layers)]
    ignore += high_precision_experts(base)  # else vLLM reads the served experts as NVFP4
    config = dict(_hf_config(base) if config is None else config)
    files = {}
    if format == "compressed-tensors":
        config["quantization_config"] = _ct_config(ignore, input_amax is not None)
    else:
        files["hf_quant_config.json"], config["quantization_config"] = _modelopt_config(ignore)
    files["config.json"] = config
    _write_atomically(path, files, tensors)
    return path


def _served(module: nn.Module) -> nn.Module:
    """The NVFP4 layer a module is served as: a PEFT LoRA layer's ``base_layer``, else itself."""
    return getattr(module, "base_layer", module)


def _inside(fqn: str, layers: Dict[str, nn.Module]) -> bool:
    """Whether ``fqn`` is inside an exported layer (a PEFT LoRA layer's base or adapters)."""
    return any(fqn.startswith(f"{layer}.") for layer in layers)
