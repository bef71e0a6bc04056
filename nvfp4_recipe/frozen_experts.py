"""Checkpoints in: an MoE layer's NVFP4 experts as a frozen NVFP4 base.

An export writes an experts module as one NVFP4 linear per expert and projection
(``export_experts``: ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` for Hugging Face's
batched experts, ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` for Mixtral's,
``{fqn}.{e}.w1`` / ``w3`` / ``w2`` for torchtitan's ``GroupedExperts``). :func:`load_experts` stacks
them back into the module's Parameter layout, per Parameter codes (G, N, K/2), E4M3 block scales
and one fp32 decode scale per expert (G,), the layout the grouped primitives take
(``backends.Backend.quantize_experts``), and puts a frozen experts module in the experts module's
place: :class:`NVFP4FrozenHFExperts` or :class:`NVFP4FrozenGroupedExperts`, whose forward is the
trained module's (``moe.routed_experts``, ``moe.swiglu_experts``: the same routing, padding and
grouped GEMMs) with fprop and dgrad on the frozen weights and no wgrad.

What the frozen experts compute with is the export's bits. For Hugging Face's layout these are
training's: gate_up_proj[g] is one W_g, quantized once, whose gate and up rows share its global
scale. torchtitan's w1[g] and w3[g] are quantized apart in training; served as one w13 they share
a global scale, and where their amaxes differed the export quantized both again with the larger
(``export_weights.expert_weights``, which logs the error): there the frozen model computes with
the exported weights, not the trained ones, and its logits are not the trained model's.
"""

from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from . import gemms
from . import reference as R
from .export_experts import ExpertProjection, served_projections
from .forward import forward_gemms
from .frozen_weights import FrozenModule, check_weight, weight_operand
from .gemms import dequantizable_experts
from .layer import backend_name, layer_seed, out_dtype
from .moe import (GroupedRecorder, NVFP4Experts, experts_modules, experts_problem, routed_experts,
                  swiglu_experts)
from .operand import NVFP4Operand
from .recipe import NVFP4Recipe

__all__ = ["NVFP4FrozenExperts", "NVFP4FrozenHFExperts", "NVFP4FrozenGroupedExperts", "load_experts"]

# the tensors of one stacked weight: codes uint8 (G, N, K/2), 1x16 scales float8_e4m3fn (G, N,
# K/16), decode scales float32 (G,)
Stacked = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_FIELDS = ("qdata", "scale", "outer_scale")


class NVFP4FrozenExperts(FrozenModule, NVFP4Experts):
    """The base of the frozen experts modules: each projection p of ``STREAMS`` (the names of the
    experts module's stacked Parameters) held as NVFP4 data only, no high-precision copy.

    Buffers per projection p: ``{p}_qdata`` uint8 (G, N, K/2) E2M1 codes, even element in the low
    nibble; ``{p}_scale`` float8_e4m3fn, (G, N, K/16) 1x16 block scales or (G, N/16, K/16) tile
    scales when every expert's rows agree within each tile (2d-trained weights); ``{p}_outer_scale``
    float32 (G,) decode scales; plus the recipe buffers of :class:`layer.NVFP4Module` (one SR stream
    per projection, as the trained module's). ``num_experts``; ``dtype``, the dtype of
    :meth:`dequantize`'s Parameters.

    ``gemm``: "nvfp4" runs each projection as the trained module's grouped GEMMs do, fprop (X
    quantized as ``recipe.spec(X_FPROP)``, one outer scale per expert's tokens) and dgrad (dY as
    ``DY_DGRAD``, SR from the projection's stream; W_g^T the exact transpose of tile-scaled
    weights, else W_g requantized along N): given the same codes, the trained module's forward
    bit for bit, and its dgrad too for tile-scaled weights under the same SR stream; "bf16"
    multiplies by the weights dequantized for the call, in the input's dtype (autocast's).

    Raises:
        ValueError: an unknown ``gemm``, shapes that disagree or are not multiples of 16, a
            projection missing; a recipe with ``forward_override`` or ``backward_override``.
        TypeError: codes not uint8 or scales not float8_e4m3fn.
    """

    def __init__(self, weights: Dict[str, Stacked], recipe: Optional[NVFP4Recipe] = None,
                 dtype: torch.dtype = torch.bfloat16, gemm: str = "nvfp4", layer_seed: int = 0):
        super().__init__()
        self._check_weights(weights, gemm)
        if recipe is not None:
            self.check_recipe(recipe)
        self.num_experts = weights[self.STREAMS[0]][0].shape[0]
        self.dtype, self.gemm, self.specs = dtype, gemm, {}
        for p in self.STREAMS:
            qdata, scale, outer = weights[p]
            w = weight_operand(qdata, scale, outer.float())
            self.specs[p] = w.spec
            for field in _FIELDS:
                self.register_buffer(f"{p}_{field}", getattr(w, field))
        self._init_nvfp4(recipe, layer_seed, weights[self.STREAMS[0]][0].device)

    def frozen_buffers(self) -> Tuple[str, ...]:
        return tuple(f"{p}_{field}" for p in self.STREAMS for field in _FIELDS)

    def _check_weights(self, weights: Dict[str, Stacked], gemm: str) -> None:
        """Raises ValueError/TypeError for a missing projection or shapes that disagree."""
        name = type(self).__name__
        missing = [p for p in self.STREAMS if p not in weights]
        if missing:
            raise ValueError(f"{name}: no weights for {missing} (it takes {list(self.STREAMS)})")
        shapes = {p: check_weight(f"{name} {p}", weights[p][0], weights[p][1], gemm)
                  for p in self.STREAMS}
        want = self.shapes(shapes[self.STREAMS[0]])
        if shapes != want or any(weights[p][2].shape != (want[p][0],) for p in self.STREAMS):
            raise ValueError(f"{name}: weights {shapes} with decode scales "
                             f"{ {p: tuple(weights[p][2].shape) for p in self.STREAMS} } are not "
                             f"{want} with (G,) decode scales")

    def shapes(self, first: Tuple[int, int, int]) -> Dict[str, Tuple[int, int, int]]:
        """{projection: its (G, N, K)} of an experts module whose first projection is ``first``."""
        raise NotImplementedError

    def operand(self, p: str) -> NVFP4Operand:
        """Projection ``p``'s stacked weights (G, N, K) as an fprop operand, outer scales (G,)."""
        return NVFP4Operand(*(getattr(self, f"{p}_{field}") for field in _FIELDS), self.specs[p])

    def dequantized(self, p: str) -> torch.Tensor:
        """Projection ``p``'s weights (G, N, K) dequantized, float32 (exact)."""
        return R.dequantize(dequantizable_experts(self.operand(p)))

    def _project(self, p: int, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Projection ``p`` (its SR stream) of the padded token groups x (T, K), ends ``offs``."""
        w = self.operand(self.STREAMS[p])
        backend = backend_name(self.recipe.backend.value, w.device)
        y = forward_gemms(gemms.Grouped(offs, given=w), x, None, None, self.gemm_recipe(),
                          self.rht_signs, self.sr_state(p), backend, out_dtype(x))
        if self.captured is not None and self.gemm == "nvfp4":
            # the weights are not recorded: their stored codes have no high-precision original
            self._capture(p, x, None, y, GroupedRecorder(backend, self.captured.keep, offs))
        return y

    @classmethod
    def replacing(cls, module: nn.Module, weights: Dict[str, Stacked], recipe: NVFP4Recipe,
                  gemm: str, layer_seed: int) -> "NVFP4FrozenExperts":
        """The frozen experts module that takes the place of the high-precision experts module
        ``module`` (its layout's): its weights ``weights``, the dtype of ``module``'s Parameters,
        whatever else its forward uses (:meth:`_module_args`), its train mode. ``module`` is kept,
        its Parameters moved to the meta device (no memory), for :meth:`dequantize`."""
        dtype = next(module.parameters()).dtype
        new = cls(weights, recipe, dtype, gemm, layer_seed, **cls._module_args(module))
        object.__setattr__(new, "_original", module.to("meta"))
        new.train(module.training)
        return new

    @staticmethod
    def _module_args(module: nn.Module) -> dict:
        """The constructor arguments besides the weights taken from the module replaced."""
        return {}

    def dequantize(self) -> nn.Module:
        """The experts module this one replaced (:meth:`replacing`), of its class, in this
        module's train mode, holding each projection's weights dequantized (exact in float32)
        and cast to ``dtype`` as Parameters that do not require grad (they were frozen), on this
        module's device.

        Raises:
            ValueError: the module was built directly, not in place of one.
        """
        if self._original is None:
            raise ValueError(f"this {type(self).__name__} was built directly; there is no "
                             f"high-precision experts module to return")
        for p in self.STREAMS:
            w = nn.Parameter(self.dequantized(p).to(self.dtype), requires_grad=False)
            setattr(self._original, p, w)
        self._original.train(self.training)
        return self._original

    def init_weights(self, *args, **kwargs) -> None:
        """Nothing to initialize: the weights are the checkpoint's (torchtitan's trainer calls
        ``init_weights`` after ``to_empty``); the recipe buffers are reset."""
        self.reset_recipe_buffers()

    def reset_parameters(self) -> None:
        """No Parameters to reset: :meth:`reset_recipe_buffers` only."""
        self.reset_recipe_buffers()

    def extra_repr(self) -> str:
        blocks = "/".join(self.specs[p].block.value for p in self.STREAMS)
        return f"experts={self.num_experts}, {blocks} scales, gemm={self.gemm}, {self.recipe_repr()}"


class NVFP4FrozenHFExperts(NVFP4FrozenExperts):
    """Hugging Face's batched experts (``moe.NVFP4HFExperts``' layout: gate_up_proj (G, 2I, H),
    gate rows first, down_proj (G, H, I), ``act_fn(gate) * up``) frozen in NVFP4.

    ``forward(hidden_states, top_k_index, top_k_weights)`` as ``NVFP4HFExperts``': hidden_states
    (T, H), top_k_index (T, k), top_k_weights (T, k) -> (T, H). Projections (SR streams):
    "gate_up_proj", "down_proj". See :class:`NVFP4FrozenExperts`.
    """

    STREAMS = ("gate_up_proj", "down_proj")

    def __init__(self, weights: Dict[str, Stacked], recipe: Optional[NVFP4Recipe] = None,
                 dtype: torch.dtype = torch.bfloat16, gemm: str = "nvfp4", layer_seed: int = 0, *,
                 act_fn=nn.functional.silu):
        super().__init__(weights, recipe, dtype, gemm, layer_seed)
        self.act_fn = act_fn

    def shapes(self, first):
        g, two_i, h = first
        return {"gate_up_proj": first, "down_proj": (g, h, two_i // 2)}

    @staticmethod
    def _module_args(module: nn.Module) -> dict:
        return {"act_fn": module.act_fn}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return routed_experts(self._project, self.num_experts, self.act_fn, hidden_states,
                              top_k_index, top_k_weights)


class NVFP4FrozenGroupedExperts(NVFP4FrozenExperts):
    """torchtitan's ``GroupedExperts`` (``moe.NVFP4GroupedExperts``' layout: SwiGLU experts w1, w3
    (G, hidden, dim), w2 (G, dim, hidden)) frozen in NVFP4.

    ``forward(x, num_tokens_per_expert)`` as ``NVFP4GroupedExperts``': x (T, dim) sorted by
    expert, (G,) token counts -> (T, dim). Projections (SR streams): "w1", "w3", "w2". See
    :class:`NVFP4FrozenExperts`.
    """

    STREAMS = ("w1", "w3", "w2")

    def shapes(self, first):
        g, hidden, dim = first
        return {"w1": first, "w3": first, "w2": (g, dim, hidden)}

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        dim = self.w1_qdata.shape[2] * 2
        if x.dim() != 2 or x.shape[1] != dim:
            raise ValueError(f"{type(self).__name__} expects x (tokens, {dim}), got {tuple(x.shape)}")
        return swiglu_experts(self._project, x, num_tokens_per_expert)


_FROZEN = (NVFP4FrozenHFExperts, NVFP4FrozenGroupedExperts)


def _by_expert(projections: Dict[str, ExpertProjection]) -> Dict[str, List[List[str]]]:
    """{stacked Parameter: [the served names of expert g's rows, in row order] for each expert g}."""
    out: Dict[str, Dict[int, list]] = {}
    for name, p in projections.items():
        out.setdefault(p.param, {}).setdefault(p.expert, []).append((p.rows.start, name))
    return {param: [[name for _, name in sorted(experts[e])] for e in sorted(experts)]
            for param, experts in out.items()}


def _check_part(name: str, p: ExpertProjection, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Raises ValueError when a served linear is not the rows ``p`` of its expert's weight."""
    _, _, k = getattr(p.module, p.param).shape
    rows = p.rows.stop - p.rows.start
    if codes.shape != (rows, k // 2) or scale.shape != (rows, k // 16):
        raise ValueError(f"load_frozen: checkpoint layer {name!r} has codes {tuple(codes.shape)} and "
                         f"scales {tuple(scale.shape)}; rows {p.rows.start}:{p.rows.stop} of expert "
                         f"{p.expert} of {p.fqn}.{p.param} {tuple(getattr(p.module, p.param).shape)} "
                         f"take ({rows}, {k // 2}) and ({rows}, {k // 16})")


def _stacked(projections: Dict[str, ExpertProjection], layers: Dict[str, Stacked],
             device: torch.device) -> Dict[str, Stacked]:
    """{stacked Parameter: its codes, 1x16 scales and decode scales, stacked per expert} from the
    served linears of ``projections`` in ``layers``, on ``device``.

    Raises:
        ValueError: a served linear of another shape; one expert's rows of one Parameter (gate
            and up) with different global scales (a grouped GEMM takes one per expert).
    """
    out = {}
    for param, experts in _by_expert(projections).items():
        codes, scales, outers = [], [], []
        for names in experts:
            for name in names:
                _check_part(name, projections[name], *layers[name][:2])
            outer = [layers[name][2] for name in names]
            if any(not torch.equal(o, outer[0]) for o in outer):
                raise ValueError(f"load_frozen: {', '.join(names)} have different global scales "
                                 f"({', '.join(str(o.item()) for o in outer)}); the experts' grouped "
                                 f"GEMM takes one per expert and Parameter")
            codes.append(torch.cat([layers[name][0] for name in names]))
            scales.append(torch.cat([layers[name][1] for name in names]))
            outers.append(outer[0])
        out[param] = tuple(torch.stack(t).to(device) for t in (codes, scales, outers))
    return out


def _frozen_class(projections: Dict[str, ExpertProjection]) -> type:
    """The frozen experts class of the layout whose stacked Parameters ``projections`` name."""
    params = {p.param for p in projections.values()}
    return next(cls for cls in _FROZEN if set(cls.STREAMS) == params)


def load_experts(model: nn.Module, layers: Dict[str, Stacked], rest: Dict[str, torch.Tensor],
                 recipe: NVFP4Recipe, gemm: str) -> Set[str]:
    """Read the experts of a checkpoint (``frozen.read_checkpoint``'s ``layers`` and ``rest``) into
    ``model``: each high-precision experts module ``quantize_`` knows (``moe.experts_modules``)
    whose per-expert linears (``export_experts.served_projections``) the checkpoint holds in NVFP4
    is replaced by a frozen one (:meth:`NVFP4FrozenExperts.replacing`, its SR streams from
    ``layer_seed(fqn)``), those linears taken out of ``layers``; one whose per-expert linears it
    holds in high precision (``{name}.weight``, experts kept so) gets them stacked into ``rest``
    under its Parameters' names.

    Returns:
        The fqns of the experts modules read (their state is complete).
    Raises:
        ValueError: a module of which the checkpoint holds some projections in NVFP4 and not
            others (named), or that cannot run in NVFP4 (``moe.experts_problem``); see
            :func:`_stacked`.
    """
    read = set()
    for fqn, module in experts_modules(model).items():
        if isinstance(module, NVFP4Experts):
            continue
        projections = served_projections(model, fqn, module)
        held = [name for name in projections if name in layers]
        if held:
            missing = [name for name in projections if name not in layers]
            problem = experts_problem(module)
            if missing or problem:
                raise ValueError(f"load_frozen: the checkpoint holds {len(held)} of the "
                                 f"{len(projections)} NVFP4 projections of the experts of {fqn}"
                                 + (f" (missing {missing[:3]})" if missing else f": {problem}"))
            device = next(module.parameters()).device
            device = torch.device("cpu") if device.type == "meta" else device
            weights = _stacked(projections, {name: layers.pop(name) for name in projections}, device)
            new = _frozen_class(projections).replacing(module, weights, recipe, gemm, layer_seed(fqn))
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, new)
            read.add(fqn)
        elif projections and all(f"{name}.weight" in rest for name in projections):
            for param, experts in _by_expert(projections).items():
                rest[f"{fqn}.{param}"] = torch.stack(
                    [torch.cat([rest.pop(f"{name}.weight") for name in names]) for names in experts])
            read.add(fqn)
    return read
