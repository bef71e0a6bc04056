"""The NVFP4 weights an export writes: per layer the codes, 1x16 block scales and encode scale the
model computes with, and one global scale per fused projection group.

A layer's exported weight (:class:`ServingWeight`) is

- an ``NVFP4Linear``'s: the weight fprop quantizes (``quantized_weight``: its recipe's W spec, 4/6
  included, and its fused group's shared amax), and the encode scale of the amax it was quantized
  with, ``S_enc = min(6 * bound / amax, FLT_MAX)`` with the E4M3 bound of its spec (448, or the 4/6
  bound 256 or 448), so that ``fl32(1 / S_enc)`` is the outer scale training used, bit for bit;
- an ``NVFP4FrozenLinear``'s: its stored codes and scales as loaded, and an encode scale whose fp32
  reciprocal is its stored outer (decode) scale (:func:`encode_scale_of`).

Serving engines dequantize each fused group (q/k/v, gate/up) with one global scale (vLLM takes the
group's max). Where a group's members have different ones (``shared_weight_amax`` off, a model
trained before it, a checkpoint from elsewhere), :func:`unify_groups` quantizes the group again
with its largest amax and logs, per group, the relative weight error that introduces.

An MoE expert's projection (``export_experts.ExpertProjection``) is exported as fprop quantizes it
(:func:`expert_weights`): each expert's W_g alone, per tensor, under its module's W spec
(``gemms.Grouped.weights``). Hugging Face's gate_up_proj[g] is one such W_g, so its gate and up rows
share one global scale as trained; torchtitan's w1[g] and w3[g] are quantized apart in training,
and where their amaxes differ both are quantized again with the larger (the error logged per module).
"""

import logging
from dataclasses import replace
from typing import Dict, List, NamedTuple, Sequence, Tuple

import torch
from torch import nn

from . import reference as R
from .export_experts import ExpertProjection
from .formats import BLOCK, E4M3_MAX
from .frozen import NVFP4FrozenLinear
from .operand import NVFP4Operand
from .spec import Block, GemmRole, QuantSpec, Scaling

__all__ = ["ServingWeight", "serving_weight", "encode_scale_of", "unify_groups", "expert_weights"]

log = logging.getLogger("nvfp4_recipe")


class ServingWeight(NamedTuple):
    """One layer's exported NVFP4 weight.

    Fields:
        op: codes uint8 (N, K/2), float8_e4m3fn 1x16 scales (N, K/16), outer (decode) scale
            float32 (); its spec has 1d blocks.
        s_enc: float32 () encode scale with ``fl32(1 / s_enc) == op.outer_scale``.
    """

    op: NVFP4Operand
    s_enc: torch.Tensor


def _bound(spec: QuantSpec) -> int:
    """The E4M3 bound of ``spec``'s outer scale: the 4/6 bound, else 448."""
    return E4M3_MAX if spec.four_over_six is None else spec.four_over_six.e4m3_max


def _rows_1x16(op: NVFP4Operand) -> NVFP4Operand:
    """``op`` (N, K) with 1x16 scales: a 16x16 tile's scale repeated on its 16 rows (exact)."""
    if op.block is not Block.D2:
        return op
    scale = op.scale.view(torch.uint8).repeat_interleave(BLOCK, dim=0).view(torch.float8_e4m3fn)
    return NVFP4Operand(op.qdata, scale, op.outer_scale, replace(op.spec, block=Block.D1))


def encode_scale_of(s_dec: torch.Tensor) -> torch.Tensor:
    """An fp32 encode scale G with ``fl32(1 / G) == s_dec`` (a global scale compressed-tensors
    divides by): ``1 / s_dec`` or one of its two fp32 neighbours either side; ``1 / s_dec``
    where none is (a decode scale no fp32 reciprocal gives; the reader is then within an ulp)."""
    g = R.decode_scale(s_dec.float())
    candidates = [g]
    for direction in (torch.inf, 0.0):
        step = g
        for _ in range(2):
            step = torch.nextafter(step, torch.full_like(step, direction))
            candidates.append(step)
    return next((c for c in candidates if torch.equal(R.decode_scale(c), s_dec)), g)


def serving_weight(layer: nn.Module) -> ServingWeight:
    """The exported weight of an ``NVFP4Linear`` (fprop's) or ``NVFP4FrozenLinear`` (as loaded)."""
    with torch.no_grad():
        if isinstance(layer, NVFP4FrozenLinear):
            return ServingWeight(_rows_1x16(layer.operand), encode_scale_of(layer.outer_scale))
        op = layer.quantized_weight().operand
        amax = layer.shared_weight_amax()
        if amax is None:
            amax = R.amax(layer.fprop_weight(), Scaling.PER_TENSOR)
        return ServingWeight(_rows_1x16(op), R.encode_scale(amax, _bound(op.spec)))


def _source(layer: nn.Module) -> Tuple[torch.Tensor, QuantSpec]:
    """(the high-precision weight (N, K) a group is quantized again from, its W spec): the master
    weight of an NVFP4Linear, the dequantized codes (fp32, exact) of a frozen layer."""
    if isinstance(layer, NVFP4FrozenLinear):
        return R.dequantize(layer.operand), layer.spec
    return layer.fprop_weight().detach(), layer.recipe.spec(GemmRole.W_FPROP)


def _requantized(layers: Sequence[nn.Module]) -> Tuple[ServingWeight, ...]:
    """The layers' weights quantized again with one amax, the largest of theirs."""
    sources = [_source(layer) for layer in layers]
    amax = torch.stack([R.amax(w, Scaling.PER_TENSOR) for w, _ in sources]).amax()
    return tuple(ServingWeight(_rows_1x16(R.quantize(w, spec, amax_=amax)),
                               R.encode_scale(amax, _bound(spec))) for w, spec in sources)


def _relative_error(new: NVFP4Operand, old: NVFP4Operand) -> float:
    """||deq(new) - deq(old)|| / ||deq(old)|| (fp64 norms)."""
    old_w = R.dequantize(old).double()
    return float((R.dequantize(new).double() - old_w).norm() / old_w.norm().clamp_min(1e-300))


def unify_groups(weights: Dict[str, ServingWeight], layers: Dict[str, nn.Module],
                 groups: Sequence[Tuple[str, ...]]) -> Dict[str, ServingWeight]:
    """``weights`` with every fused group (fqn tuples) sharing one global scale: a group whose
    encode scales differ is quantized again with its largest amax (:func:`_requantized`), and a
    WARNING line per such group gives each member's relative weight error against the weight the
    model computes with. Groups that agree already are kept bit for bit."""
    out = dict(weights)
    with torch.no_grad():
        for fqns in groups:
            scales = torch.stack([weights[f].s_enc.reshape(()) for f in fqns])
            if torch.equal(scales, scales[:1].expand_as(scales)):
                continue
            new = _requantized([layers[f] for f in fqns])
            errors = [_relative_error(w.op, weights[f].op) for f, w in zip(fqns, new)]
            out.update(zip(fqns, new))
            log.warning("export: fused group %s had %d different weight global scales; quantized "
                        "again with the group's largest amax (relative weight error: %s). Train "
                        "with NVFP4Recipe(shared_weight_amax=True) to export the trained weights "
                        "bit for bit", "/".join(fqns), len(set(scales.tolist())),
                        ", ".join(f"{f.rpartition('.')[2]} {e:.2e}" for f, e in zip(fqns, errors)))
    return out


def _rows(op: NVFP4Operand, rows: slice) -> NVFP4Operand:
    """Rows ``rows`` of a 1x16-scaled operand (N, K): its codes and scales, one outer scale."""
    return NVFP4Operand(op.qdata[rows], op.scale[rows], op.outer_scale, op.spec)


def _expert_group(projections: Sequence[ExpertProjection]
                  ) -> Tuple[List[ServingWeight], Dict[str, float]]:
    """The served weights of one expert's projections sharing one global scale, each stacked
    Parameter's W_g quantized once with the largest amax of the group's W_g's, and {Parameter:
    relative weight error against W_g quantized with its own amax, as trained} for the W_g's
    whose amax was not the largest."""
    first = projections[0]
    spec = first.module.recipe.spec(GemmRole.W_FPROP)
    ws = {p.param: getattr(p.module, p.param)[p.expert].detach() for p in projections}
    amaxes = {param: R.amax(w, Scaling.PER_TENSOR) for param, w in ws.items()}
    amax = torch.stack(list(amaxes.values())).amax()
    ops = {param: _rows_1x16(R.quantize(w, spec, amax_=amax)) for param, w in ws.items()}
    errors = {param: _relative_error(ops[param], _rows_1x16(R.quantize(w, spec)))
              for param, w in ws.items() if not torch.equal(amaxes[param], amax)}
    s_enc = R.encode_scale(amax, _bound(spec))
    return [ServingWeight(_rows(ops[p.param], p.rows), s_enc) for p in projections], errors


def expert_weights(projections: Dict[str, ExpertProjection], groups: Sequence[Tuple[str, ...]]
                   ) -> Dict[str, ServingWeight]:
    """served name -> exported weight of every expert projection: each group of ``groups``
    (``export_experts.expert_groups``) quantized with one amax, the largest of its stacked
    Parameters' W_g's (module docstring); codes and 1x16 scales equal
    ``reference.quantize(W_g, W spec, amax_=that amax)``, fprop's bits where the group has one
    W_g. One WARNING per experts module where some expert's fused W_g's had different amaxes,
    giving the count and each Parameter's largest relative weight error against the weights the
    model computes with."""
    out: Dict[str, ServingWeight] = {}
    worst: Dict[str, Dict[str, float]] = {}  # module fqn -> {Parameter: largest error}
    requantized: Dict[str, int] = {}  # module fqn -> experts quantized again
    with torch.no_grad():
        for names in groups:
            members = [projections[n] for n in names]
            weights, errors = _expert_group(members)
            out.update(zip(names, weights))
            if errors:
                fqn = members[0].fqn
                requantized[fqn] = requantized.get(fqn, 0) + 1
                largest = worst.setdefault(fqn, {})
                for param, error in errors.items():
                    largest[param] = max(largest.get(param, 0.0), error)
    for fqn, count in requantized.items():
        log.warning("export: %s: %d experts had different weight global scales for their fused "
                    "projections (served with one); quantized again with each expert's larger amax "
                    "(largest relative weight error: %s)", fqn, count,
                    ", ".join(f"{p} {e:.2e}" for p, e in worst[fqn].items()))
    return out
