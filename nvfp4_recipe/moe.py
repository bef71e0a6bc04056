"""Mixture-of-experts layers in NVFP4: grouped fprop, dgrad and wgrad over the experts' token groups.

The layer algorithm of ``gemms.py`` applied to G experts at once (docs/moe.md): the tokens routed
to the experts form one (T, K) matrix sorted by expert, split into groups by ``offs`` (int32
cumulative ends, ``torch._grouped_mm``'s convention); each expert's weight W_g (N, K) is one slice
of a (G, N, K) parameter. Per projection and step:

    fprop  Y_g  = X_g W_g^T     X: 1D RN, one outer scale per group   W_g: 2D (or 1D) RN, per expert
    dgrad  dX_g = dY_g W_g      dY: 1D SR                             W_g^T: the same 2D blocks
    wgrad  dW_g = dY_g^T X_g    dY_g^T: RHT + 1D SR, X_g^T: RHT + 1D  (blocks of 16 tokens)

each a grouped primitive of the backend (``Backend.quantize_groups``, ``quantize_experts``,
``grouped_mm``: the reference per group on CPU, the grouped kernels on GPUs). Every group's
length must be a multiple of 16 (the wgrad blocks run along the tokens); the modules here pad
each expert's tokens with zero rows (:func:`pad_groups`), so any routing works.

Modules: :class:`NVFP4GroupedExperts` (torchtitan's ``GroupedExperts`` layout: SwiGLU experts w1,
w3 (G, hidden, dim), w2 (G, dim, hidden); ``forward(x, num_tokens_per_expert)``) and
:class:`NVFP4HFExperts` (Hugging Face transformers' batched experts: gate_up_proj (G, 2I, H),
down_proj (G, H, I); ``forward(hidden_states, top_k_index, top_k_weights)``). ``quantize_`` swaps
the modules :func:`register_experts` knows, keeping their Parameters.
"""

import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import gemms
from .backends import resolved
from .backends.grouped import check_offsets, expert_slice, group_bounds, group_slice
from .formats import BLOCK
from .forward import forward_gemms
from .layer import NVFP4Module, backend_name, check_sizes, out_dtype, size_problem
from .operand import GroupedOperand
from .quantizers import OperandQuantizer, TensorQuantizer
from .recipe import NVFP4Recipe
from .tensor import NVFP4Tensor

__all__ = ["NVFP4Experts", "NVFP4GroupedExperts", "NVFP4HFExperts", "grouped_linear", "pad_groups",
           "register_experts", "experts_modules", "experts_problem", "router_ids", "GroupedRecorder", "swiglu_experts", "routed_experts"]


# ----------------------------------------------------------------------------------------------
# The layer algorithm
# ----------------------------------------------------------------------------------------------
def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: NVFP4Recipe,
                   signs: torch.Tensor, sr_seed: torch.Tensor, sr_step: torch.Tensor,
                   backend: Optional[str] = None, sr_rank: int = 0) -> torch.Tensor:
    """A grouped linear with NVFP4 fprop, dgrad and wgrad: ``Y[group g] = X_g @ W_g^T``, autograd
    to x and w.

    Args:
        x: (T, K) bfloat16/float16/float32 tokens sorted by expert, K a multiple of 16.
        w: (G, N, K) expert weights, N and K multiples of 16.
        offs: int32 (G,) cumulative group ends on x's device; every group a multiple of 16
            tokens (validated here, one host sync; :func:`pad_groups` pads), ``offs[-1] <= T``.
        recipe: the quantization of each operand (``recipe.spec``); signs: (16,) RHT signs.
        sr_seed, sr_step: 0-d int64 tensors keying the backward's SR stream (the step advances
            in backward, in place).
        backend: default ``recipe.backend``.
        sr_rank: this process's data-parallel rank, folded into the SR key (``layer.sr_key``).
    Returns:
        (T, N) in the autocast dtype if autocast is on, else x's dtype; zeros past ``offs[-1]``.
    Raises:
        TypeError, ValueError: bad offsets (naming the group), shapes or dtypes.
    """
    check_offsets(offs, x.shape[0])
    return forward_gemms(gemms.Grouped(offs), x, w, None, recipe, signs, (sr_seed, sr_step, sr_rank),
                         backend_name(backend or recipe.backend.value, w.device), out_dtype(x))


def pad_groups(counts: torch.Tensor, rows: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Where the rows of G groups go when each group is padded to a multiple of 16 rows, computed
    on the device (no host sync, so the padded size is an upper bound).

    Args:
        counts: (G,) rows per group (any numeric dtype, e.g. torchtitan's float
            ``num_tokens_per_expert``), summing to ``rows``.
        rows: the number of rows, sorted by group.
    Returns:
        (offs, dest, padded_rows): int32 (G,) ends of the padded groups; int64 (rows,) row of
        each input row in the padded tensor; the padded tensor's row count,
        ``ceil(rows / 16) * 16 + 16 G`` (rows past ``offs[-1]`` belong to no group).
    """
    counts = counts.to(torch.int64)
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    ends = torch.cumsum(padded, 0)
    shift = (ends - padded) - (torch.cumsum(counts, 0) - counts)  # padded start - start
    group = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                    output_size=rows)
    dest = torch.arange(rows, device=counts.device) + shift[group]
    return ends.to(torch.int32), dest, (rows + BLOCK - 1) // BLOCK * BLOCK + BLOCK * counts.shape[0]


class GroupedRecorder(NamedTuple):
    """How an experts projection records its operands for ``NVFP4Module._capture``: the token
    groups of X and dY quantized again as the grouped GEMMs quantize them (``Grouped.tokens``),
    W per expert (``quantize_experts``), each as an :class:`NVFP4Tensor` kept by ``keep(hp, q)``
    (``layer.Recording``), in lists of one per token group or expert. Reads the group bounds on
    the host (eager mode only).

    Fields:
        backend: the resolved backend name the GEMMs ran on; keep: ``Recording.keep``;
        offs: int32 (G,) group ends of the call.
    """

    backend: str
    keep: Callable[[torch.Tensor, object], object]
    offs: torch.Tensor

    def weight(self, w: torch.Tensor, q: OperandQuantizer) -> List[object]:
        """Each expert's W_g (N, K) of w (G, N, K) quantized alone under ``q.spec``, kept."""
        wq = resolved(self.backend).quantize_experts(w, q.spec, need_t=False)[0]
        return [self.keep(w[g], NVFP4Tensor.from_operand(expert_slice(wq, g), w.dtype,
                                                         backend=self.backend))
                for g in range(w.shape[0])]

    def tokens(self, t: torch.Tensor, q: TensorQuantizer) -> Tuple[Optional[list], Optional[list]]:
        """(each group's t_g (M_g, K) by ``q.rowwise``, each t_g^T (K, M_g) by ``q.columnwise``),
        kept, or None where ``q`` has no such copy."""
        t = t.contiguous()
        rows, cols, _ = gemms.Grouped(self.offs).tokens(resolved(self.backend), t, q)
        bounds = group_bounds(self.offs)
        return (rows and self._groups(rows, q.rowwise, t, bounds, False),
                cols and self._groups(cols, q.columnwise, t, bounds, True))

    def _groups(self, op: GroupedOperand, q: OperandQuantizer, hp: torch.Tensor, bounds,
                transpose: bool) -> List[object]:
        return [self.keep(hp[s:e].t() if transpose else hp[s:e],
                          NVFP4Tensor.from_operand(group_slice(op, g, s, e), hp.dtype, q.signs,
                                                   self.backend))
                for g, (s, e) in enumerate(bounds)]


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------
class NVFP4Experts(NVFP4Module):
    """The base of the NVFP4 experts modules: the grouped projections, one SR stream each
    (``STREAMS``: the projections' names), made from a high-precision experts module by
    ``from_module`` (:meth:`dequantize` gives it back).

    Buffers and ``sr_rank``: :class:`layer.NVFP4Module` (``sr_seed`` and ``sr_step`` (P,), one
    per projection, seeded with ``crc32(name_p)`` added). Like ``NVFP4Linear``, the projections
    quantize each expert weight once inside :func:`cached_weights` in forwards without autograd,
    and ``inspect.capture`` records their operands (:class:`GroupedRecorder`). Initialization
    (``init_weights``, torchtitan's; ``reset_parameters``) is that of the module converted from,
    run on this module's Parameters.
    """

    STREAMS: Tuple[str, ...] = ()

    def _project(self, p: int, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Projection ``p`` (its SR stream, and the stacked Parameter of that name) of the padded
        token groups x, ends ``offs``."""
        w = getattr(self, self.STREAMS[p])
        backend = backend_name(self.recipe.backend.value, w.device)
        y = forward_gemms(gemms.Grouped(offs), x, w, None, self.recipe, self.rht_signs,
                          self.sr_state(p), backend, out_dtype(x),
                          cache=functools.partial(self.cached_operand, self.STREAMS[p], w, backend))
        if self.captured is not None:
            self._capture(p, x, w, y, GroupedRecorder(backend, self.captured.keep, offs))
        return y

    def init_weights(self, *args, **kwargs) -> None:
        """The converted module's ``init_weights`` (torchtitan's trainer calls it after
        ``to_empty``) on this module's Parameters, in its order and with its random draws.

        Raises:
            ValueError: built directly (no module to delegate to). AttributeError: that module
                has no ``init_weights``.
        """
        self.dequantize().init_weights(*args, **kwargs)

    def reset_parameters(self) -> None:
        """The converted module's ``reset_parameters`` on this module's Parameters, if it has
        one, and :meth:`reset_recipe_buffers`."""
        original = self.dequantize()
        if hasattr(original, "reset_parameters"):
            original.reset_parameters()
        self.reset_recipe_buffers()

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, {self.recipe_repr()}"


def _padded(x: torch.Tensor, counts: torch.Tensor):
    """(x with each group padded to a multiple of 16 zero rows, offs, dest) (:func:`pad_groups`)."""
    offs, dest, rows = pad_groups(counts, x.shape[0])
    return x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x), offs, dest


# projection p of padded token groups x (T, K) with int32 (G,) ends offs -> (T, N)
Project = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu_experts(project: Project, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torchtitan ``GroupedExperts``' forward through ``project`` (p: 0 w1, 1 w3, 2 w2):
    ``w2(silu(w1 x) * w3 x)`` per expert for x (T, dim) sorted by expert, ``num_tokens_per_expert``
    (G,) summing to T; each expert's tokens padded to a multiple of 16 with zero rows inside."""
    xp, offs, dest = _padded(x, num_tokens_per_expert)
    h = F.silu(project(0, xp, offs)) * project(1, xp, offs)
    return project(2, h, offs).index_select(0, dest)


def routed_experts(project: Project, num_experts: int, act_fn: Callable, hidden_states: torch.Tensor,
                   top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Hugging Face batched experts' forward through ``project`` (p: 0 gate_up_proj, 1
    down_proj): hidden_states (T, H), top_k_index (T, k) expert ids, top_k_weights (T, k) ->
    sum_j weight_j * expert_j(x) (T, H) in hidden_states' dtype (the autocast dtype under
    autocast); tokens sorted by expert, each expert's padded to a multiple of 16 inside."""
    tokens, k = top_k_index.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))  # no host sync (bincount)
    xp, offs, dest = _padded(hidden_states[perm // k], counts)
    gate, up = project(0, xp, offs).chunk(2, dim=-1)
    h = project(1, act_fn(gate) * up, offs).index_select(0, dest)
    weighted = h * top_k_weights.reshape(-1)[perm, None].to(h.dtype)
    out = torch.zeros(tokens * k, h.shape[1], dtype=h.dtype, device=h.device)
    out = out.index_copy(0, perm, weighted)
    return out.view(tokens, k, -1).sum(dim=1).to(out_dtype(hidden_states))


class NVFP4GroupedExperts(NVFP4Experts):
    """SwiGLU experts in torchtitan's ``GroupedExperts`` layout, every projection in NVFP4.

    ``forward(x, num_tokens_per_expert)``: x (T, dim) sorted by expert, ``num_tokens_per_expert``
    (G,) (any numeric dtype) summing to T; returns ``w2(silu(w1 x) * w3 x)`` per expert, (T, dim),
    in the autocast dtype if autocast is on, else x's. Each expert's tokens are padded to a
    multiple of 16 with zero rows inside (they cost compute, not results).

    Parameters: w1, w3 (G, hidden_dim, dim) and w2 (G, dim, hidden_dim), dims multiples of 16.
    Projections (SR streams): "w1", "w3", "w2". See :class:`NVFP4Experts` for the buffers.
    """

    STREAMS = ("w1", "w3", "w2")

    def __init__(self, dim: int, hidden_dim: int, num_experts: int,
                 recipe: Optional[NVFP4Recipe] = None, layer_seed: int = 0, device=None,
                 dtype=None):
        super().__init__()
        check_sizes(type(self).__name__, {"dim": dim, "hidden_dim": hidden_dim})
        kw = dict(device=device, dtype=dtype)
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self._init_nvfp4(recipe, layer_seed, device)

    def _adopt(self, experts: nn.Module) -> None:
        """A torchtitan-style ``GroupedExperts``' w1, w2, w3 Parameters (``from_module``)."""
        check_sizes(type(self).__name__, _titan_sizes(experts))
        self.num_experts = experts.w1.shape[0]
        self.w1, self.w2, self.w3 = experts.w1, experts.w2, experts.w3

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.w1.shape[2]:
            raise ValueError(f"NVFP4GroupedExperts expects x (tokens, {self.w1.shape[2]}), got "
                             f"{tuple(x.shape)}")
        return swiglu_experts(self._project, x, num_tokens_per_expert)


class NVFP4HFExperts(NVFP4Experts):
    """Hugging Face transformers' batched experts (``@use_experts_implementation`` modules such as
    ``Qwen3MoeExperts`` or ``MixtralExperts``: gate_up_proj (G, 2I, H) with the gate rows first,
    down_proj (G, H, I), no bias, ``act_fn(gate) * up``), every projection in NVFP4.

    ``forward(hidden_states, top_k_index, top_k_weights)`` as theirs: hidden_states (T, H),
    top_k_index (T, k) expert ids, top_k_weights (T, k); returns sum_j weight_j * expert_j(x),
    (T, H), in hidden_states' dtype (the autocast dtype under autocast). Tokens are sorted by
    expert and each expert's tokens padded to a multiple of 16 inside.

    Made by ``NVFP4HFExperts.from_module(experts, recipe, layer_seed)`` (see
    :func:`hf_experts_problem` for what is supported), sharing the module's Parameters and
    ``act_fn``; :meth:`dequantize` gives it back. Projections (SR streams): "gate_up_proj",
    "down_proj". See :class:`NVFP4Experts`.
    """

    STREAMS = ("gate_up_proj", "down_proj")

    def _adopt(self, experts: nn.Module) -> None:
        """The experts' gate_up_proj and down_proj Parameters and act_fn (``from_module``)."""
        check_sizes(type(self).__name__, _hf_sizes(experts))
        self.num_experts = experts.gate_up_proj.shape[0]
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.act_fn = experts.act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return routed_experts(self._project, self.num_experts, self.act_fn, hidden_states,
                              top_k_index, top_k_weights)


# ----------------------------------------------------------------------------------------------
# Which modules quantize_ swaps
# ----------------------------------------------------------------------------------------------
def _is_param3(m: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Parameter) and getattr(m, n).dim() == 3
               for n in names)


def _titan_sizes(m: nn.Module) -> Dict[str, int]:
    """The GEMM dimensions of a torchtitan-style ``GroupedExperts`` (w1 (G, hidden, dim))."""
    _, hidden, dim = m.w1.shape
    return {"dim": dim, "hidden_dim": hidden}


def _hf_sizes(m: nn.Module) -> Dict[str, int]:
    """The GEMM dimensions of Hugging Face batched experts (gate_up_proj (G, 2I, H))."""
    _, two_i, h = m.gate_up_proj.shape
    return {"hidden_size": h, "intermediate_size": two_i // 2, "2 * intermediate_size": two_i}


def titan_experts_problem(m: nn.Module) -> Optional[str]:
    """Why a torchtitan-style ``GroupedExperts`` cannot run in NVFP4 (None if it can)."""
    g, hidden, dim = m.w1.shape
    if m.w2.shape != (g, dim, hidden) or m.w3.shape != (g, hidden, dim):
        return f"w1/w2/w3 shapes {tuple(m.w1.shape)}, {tuple(m.w2.shape)}, {tuple(m.w3.shape)} " \
               f"are not (G, hidden, dim), (G, dim, hidden), (G, hidden, dim)"
    return size_problem(_titan_sizes(m))


def hf_experts_problem(m: nn.Module) -> Optional[str]:
    """Why a Hugging Face batched experts module cannot run in NVFP4 (None if it can): the layout
    must be transformers' default (gate and up concatenated, not transposed, no bias, a gate, no
    post-expert norm, its default ``_apply_gate``) and not expert-parallel."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a module of this layout without transformers: its own gate is the default
        _default_apply_gate = getattr(type(m), "_apply_gate", None)
    flags = {"is_transposed": False, "has_bias": False, "has_gate": True, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    for flag, want in flags.items():
        if getattr(m, flag, want) != want:
            return f"{flag}={getattr(m, flag)!r} (NVFP4HFExperts takes {flag}={want})"
    if getattr(type(m), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return "a custom _apply_gate"
    return size_problem(_hf_sizes(m))


def _is_titan_experts(m: nn.Module) -> bool:
    return type(m).__name__ == "GroupedExperts" and _is_param3(m, "w1", "w2", "w3")


def _is_hf_experts(m: nn.Module) -> bool:
    return (_is_param3(m, "gate_up_proj", "down_proj") and hasattr(m, "has_gate")
            and hasattr(m, "is_transposed") and hasattr(m, "act_fn"))


# (matches, problem, convert(module, recipe, layer_seed)) of each supported experts layout
_EXPERTS: List[Tuple[Callable, Callable, Callable]] = [
    (_is_titan_experts, titan_experts_problem, NVFP4GroupedExperts.from_module),
    (_is_hf_experts, hf_experts_problem, NVFP4HFExperts.from_module),
]


def register_experts(matches: Callable[[nn.Module], bool],
                     problem: Callable[[nn.Module], Optional[str]],
                     convert: Callable[[nn.Module, NVFP4Recipe, int], nn.Module]) -> None:
    """Teach ``quantize_`` another experts module: ``matches(module)`` recognizes it,
    ``problem(module)`` says why one cannot be converted (None if it can) and
    ``convert(module, recipe, layer_seed)`` returns the NVFP4 module, sharing the Parameters and
    taking the same forward arguments."""
    _EXPERTS.append((matches, problem, convert))


def _entry(m: nn.Module):
    return next((e for e in _EXPERTS if e[0](m)), None)


def experts_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """fqn -> module of every experts module ``quantize_`` knows (converted ones included)."""
    return {fqn: m for fqn, m in model.named_modules()
            if isinstance(m, NVFP4Experts) or _entry(m) is not None}


def experts_problem(m: nn.Module) -> Optional[str]:
    """Why a known experts module (:func:`experts_modules`, not converted) cannot run in NVFP4
    (its layout's ``problem``), None if it can."""
    return _entry(m)[1](m)


def convert_experts(m: nn.Module, recipe: NVFP4Recipe, layer_seed: int) -> nn.Module:
    """The NVFP4 module of a known experts module (see :func:`register_experts`)."""
    return _entry(m)[2](m, recipe, layer_seed)


def router_ids(model: nn.Module) -> Dict[int, str]:
    """id -> fqn of the MoE routers among the model's nn.Linear layers: under the parent of a
    known experts module, the linears with one output per expert (torchtitan's ``router.gate``).
    They stay in high precision (NVIDIA's NVFP4 recipe keeps routing in high precision)."""
    routers = {}
    modules = dict(model.named_modules())
    for fqn, experts in experts_modules(model).items():
        parent = fqn.rpartition(".")[0]
        n_experts = getattr(experts, "num_experts", None) or _num_experts(experts)
        prefix = parent + "." if parent else ""
        for name, m in modules.items():
            if (isinstance(m, nn.Linear) and name.startswith(prefix) and not name.startswith(fqn + ".")
                    and m.out_features == n_experts):
                routers[id(m)] = name
    return routers


def _num_experts(m: nn.Module) -> int:
    return next(p.shape[0] for p in m.parameters() if p.dim() == 3)
