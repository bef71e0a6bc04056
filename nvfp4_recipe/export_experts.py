"""The MoE experts of an export: each expert's projections as the per-expert linears serving
engines load, their names, and the amaxes of their inputs.

vLLM (``FusedMoE``: ``w13`` = [gate; up] and ``w2`` = down of each expert, stacked on load), SGLang
and TensorRT-LLM load an MoE layer's experts from one linear per expert and projection, in the
model's checkpoint layout, each with the tensors of a dense NVFP4 linear (``serving.py``). An experts
module of G experts becomes 3 G such linears (:class:`ExpertProjection`), named

- for :class:`moe.NVFP4HFExperts` (Hugging Face's ``gate_up_proj`` (G, 2I, H), gate rows first, and
  ``down_proj`` (G, H, I)) in a transformers model: as ``save_pretrained`` writes the two
  Parameters (``checkpoint_names.saved_layout``), e.g. ``mlp.experts.{e}.gate_proj`` / ``up_proj``
  / ``down_proj`` (Qwen-MoE, DeepSeek, OLMoE) or ``block_sparse_moe.experts.{e}.w1`` / ``w3`` /
  ``w2`` (Mixtral); elsewhere ``{fqn}.{e}.gate_proj`` / ``up_proj`` / ``down_proj``;
- for :class:`moe.NVFP4GroupedExperts` (torchtitan's ``w1``, ``w3`` (G, hidden, dim), ``w2`` (G,
  dim, hidden)): ``{fqn}.{e}.w1`` / ``w3`` / ``w2``, torchtitan's names, as its dense layers are
  exported under torchtitan's names.

Serving engines fuse each expert's gate and up into one GEMM with one weight global scale (vLLM
takes w1's and warns when w3's differs; TensorRT-LLM asserts they are equal) and one input scale:
:func:`expert_groups` gives, per expert, the projections that share them.
"""

import contextlib
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .checkpoint_names import saved_layout
from .layer import Recording
from .moe import NVFP4Experts, experts_modules

__all__ = ["ExpertProjection", "expert_projections", "served_projections", "expert_groups",
           "high_precision_experts", "record_expert_amaxes"]

# the experts layouts, Hugging Face's and torchtitan's (of NVFP4HFExperts, NVFP4GroupedExperts and
# the modules they convert): {stacked Parameter: the projections its rows hold, in row order (their
# default served names)}, and the Parameters whose projections an engine fuses per expert
_LAYOUTS = (({"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}, ("gate_up_proj",)),
            ({"w1": ("w1",), "w3": ("w3",), "w2": ("w2",)}, ("w1", "w3")))


class ExpertProjection(NamedTuple):
    """One expert's projection as a served linear: the rows ``rows`` of expert ``expert``'s slice
    of the stacked Parameter ``param`` (G, N, K) of the experts module ``module`` (at ``fqn``)."""

    fqn: str
    module: nn.Module
    param: str
    expert: int
    rows: slice


def _layout(module: nn.Module):
    """The entry of :data:`_LAYOUTS` whose stacked Parameters ``module`` has, or None."""
    return next((layout for layout in _LAYOUTS if all(
        isinstance(getattr(module, p, None), torch.Tensor) for p in layout[0])), None)


def _saved_names(model: nn.Module, fqn: str, param: str, parts: Tuple[str, ...], n: int, *,
                 strict: bool) -> Optional[Dict[Tuple[int, int], str]]:
    """{(expert, part): served name} of the rows of Parameter ``fqn.param`` (n experts, ``parts``
    row blocks) as ``save_pretrained`` writes it, or None where it keeps the Parameter as it is.
    Found by reverting a marker tensor (n, parts, 1) whose elements number the row blocks.

    Raises:
        ValueError: transformers writes the Parameter otherwise (renamed, or not as one linear per
            row block), with ``strict``; else None then.
    """
    key = f"{fqn}.{param}"
    marker = torch.arange(n * len(parts), dtype=torch.float32).reshape(n, len(parts), 1)
    saved = saved_layout(model, {key: marker})
    names = {divmod(int(t.item()), len(parts)): name.removesuffix(".weight")
             for name, t in saved.items() if t.numel() == 1 and name.endswith(".weight")}
    if len(names) == len(saved) == marker.numel():
        return names
    if strict and list(saved) != [key]:
        raise ValueError(f"export: transformers saves {key} as {sorted(saved)[:4]}, not as one "
                         f"linear per expert and projection; the serving layout of these experts "
                         f"is unknown")
    return None


def _projections(model: nn.Module, fqn: str, module: nn.Module, layout, *, strict: bool
                 ) -> Iterator[Tuple[Optional[str], str, ExpertProjection]]:
    """(its name as ``save_pretrained`` writes it, or None where it keeps the Parameter as it is;
    ``{fqn}.{e}.{projection}``; the projection) of each projection of experts module ``fqn`` of
    ``layout``, expert by expert per Parameter; ``strict`` as in :func:`_saved_names`."""
    for param, parts in layout[0].items():
        n, rows, _ = getattr(module, param).shape
        size = rows // len(parts)
        saved = _saved_names(model, fqn, param, parts, n, strict=strict)
        for e in range(n):
            for i, part in enumerate(parts):
                yield (None if saved is None else saved[e, i], f"{fqn}.{e}.{part}",
                       ExpertProjection(fqn, module, param, e, slice(i * size, (i + 1) * size)))


def expert_projections(model: nn.Module) -> Dict[str, ExpertProjection]:
    """served name -> :class:`ExpertProjection` of every projection of every NVFP4 experts module
    of ``model`` (module docstring), in module order. Reads no weight (a model on the meta device
    may be asked).

    Raises:
        ValueError: an experts module of another type, or whose saved layout is not per-expert
            linears (named).
    """
    out = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, NVFP4Experts):
            continue
        layout = _layout(module)
        if layout is None:
            raise ValueError(f"export: {fqn} is a {type(module).__name__}, an experts module whose "
                             f"serving layout export does not know (it writes Hugging Face's "
                             f"gate_up_proj / down_proj and torchtitan's w1 / w3 / w2 experts)")
        for saved, default, projection in _projections(model, fqn, module, layout, strict=True):
            out[saved or default] = projection
    return out


def served_projections(model: nn.Module, fqn: str, module: nn.Module) -> Dict[str, ExpertProjection]:
    """served name -> :class:`ExpertProjection` of each projection of the experts module ``fqn``
    of ``model``, NVFP4 or the high-precision module of a layout it converts (what
    ``frozen_experts`` reads back), named as :func:`expert_projections` names them; {} for a
    module of another layout. A module transformers saves otherwise (stacked) gets the names
    ``{fqn}.{e}.{projection}``. Reads no weight."""
    layout = _layout(module)
    if layout is None:
        return {}
    return {saved or default: p
            for saved, default, p in _projections(model, fqn, module, layout, strict=False)}


def high_precision_experts(model: nn.Module) -> List[str]:
    """The per-expert linears of the experts modules ``quantize_`` knows but left in high
    precision, as ``save_pretrained`` writes them (named as by :func:`expert_projections`): what
    a config's ignore list names so that a server does not read them as NVFP4. Nothing for a
    module whose Parameters are saved stacked (torchtitan's, GraniteMoE's)."""
    names = []
    for fqn, module in experts_modules(model).items():
        layout = None if isinstance(module, NVFP4Experts) else _layout(module)
        if layout is not None:
            projections = _projections(model, fqn, module, layout, strict=False)
            names += [saved for saved, *_ in projections if saved]
    return names


def expert_groups(projections: Dict[str, ExpertProjection]) -> List[Tuple[str, ...]]:
    """The served names of ``projections`` that share one weight global scale and one input
    scale: per experts module and expert, its fused projections (gate and up) together and every
    other projection alone; each name in one group, in the projections' order."""
    groups: Dict[tuple, List[str]] = {}
    for name, p in projections.items():
        fused = p.param in _layout(p.module)[1]
        groups.setdefault((p.fqn, p.expert, "fused" if fused else p.param), []).append(name)
    return [tuple(names) for names in groups.values()]


def _group_amax(hp: torch.Tensor, quantized) -> Optional[torch.Tensor]:
    """``Recording.keep`` of :func:`record_expert_amaxes`: the fp32 max |x| of one operand
    (None for a token group without tokens)."""
    return hp.detach().abs().amax().float() if hp.numel() else None


@contextlib.contextmanager
def record_expert_amaxes(projections: Dict[str, ExpertProjection],
                         amaxes: Dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside the context, every forward of the experts modules of ``projections`` records into
    ``amaxes`` {served name: the largest max |x| of that projection's input (the expert's tokens,
    as its grouped GEMM quantizes them: one outer scale per expert) so far} (fp32 0-d tensors on
    the module's device). An expert that receives no token records nothing.

    The modules record through ``captured`` (a :class:`layer.Recording` of each projection's
    token groups, the protocol of ``inspect.capture``, which they cannot be inside at the same
    time): it quantizes the operands again, which costs about one fprop more per forward.
    """
    by_module: Dict[int, Tuple[NVFP4Experts, Dict[Tuple[str, int], List[str]]]] = {}
    for name, p in projections.items():
        table = by_module.setdefault(id(p.module), (p.module, {}))[1]
        table.setdefault((p.param, p.expert), []).append(name)

    def read(module, args, output):
        table = by_module[id(module)][1]
        for (param, e), names in table.items():
            # a projection's SR stream, under whose name it records, is named after its Parameter
            groups = module.captured.store.get(param, {}).get("x")
            amax = None if groups is None else groups[e]
            if amax is not None:
                for name in names:
                    amaxes[name] = torch.maximum(amaxes[name], amax) if name in amaxes else amax
        module.captured.store.clear()

    previous = {key: module.captured for key, (module, _) in by_module.items()}
    handles = []
    try:
        for module, _ in by_module.values():
            module.captured = Recording(_group_amax)
            handles.append(module.register_forward_hook(read))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for key, (module, _) in by_module.items():
            module.captured = previous[key]
