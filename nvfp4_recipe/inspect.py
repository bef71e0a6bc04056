"""Interactive inspection: which layers a model runs in NVFP4, what NVFP4 does to a tensor, and the
quantized operands a training step actually used."""

import contextlib
import math
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from . import reference as R
from .api import check_module, frozen_layers, linear_layers, nvfp4_counts, skip_reasons
from .conv1d import features
from .formats import BLOCK, E2M1_GRID, unpack_nibbles
from .layer import NVFP4Module, Recording
from .linear import NVFP4Linear
from .moe import NVFP4Experts
from .operand import NVFP4Operand
from .recipe import NVFP4Recipe
from .spec import Block, GemmRole, QuantSpec
from .tensor import NVFP4Tensor

__all__ = ["summary", "tensor_stats", "capture", "QuantStats", "operand_counts", "COUNTS",
           "plot_quant_stats", "STAT_PANELS"]

E2M1_MAX_CODE = len(E2M1_GRID) - 1  # the magnitude code of 6
# A block scale rounded to E4M3 (3 mantissa bits) may sit up to 2**-4 below block_amax / 6, which
# clips the block's largest values by as much; saturation is counted beyond that.
_SATURATION_MARGIN = 1 / 8
_ROLES = {*GemmRole, *(r.value for r in GemmRole)}


def summary(model: nn.Module, recipe: Optional[NVFP4Recipe] = None) -> str:
    """A table of the model's linear layers (nn.Linear, transformers' Conv1D and frozen NVFP4
    linears, ``load_frozen``'s): fqn, shape,
    NVFP4 or the dtype they run in, and why; then the other modules left in high precision (experts
    modules, layer types ``quantize_`` does not convert) with why; then the counts.

    The reasons are those ``quantize_`` found (the ``nvfp4_kept`` it sets on the model) or, with
    ``recipe``, that recipe's filter applied to the model as it is now (``api.skip_reasons``).

    Raises:
        TypeError: ``model`` is not an nn.Module.
    """
    check_module("summary", model)
    reasons = skip_reasons(model, recipe) if recipe is not None else getattr(model, "nvfp4_kept", {})
    linears, frozen = linear_layers(model), frozen_layers(model)
    modules = dict(model.named_modules())
    rows = [("layer", "in x out", "precision", "note")]
    for fqn, m in [(f, m) for f, m in modules.items() if f in linears or f in frozen]:
        shape = " x ".join(map(str, features(m)))
        if fqn in frozen:
            rows.append((fqn, shape, "nvfp4", f"frozen ({m.block.value} scales, gemm={m.gemm}), "
                                              f"{m.extra_repr().split('recipe=')[1]}"))
        elif isinstance(m, NVFP4Linear):
            rows.append((fqn, shape, "nvfp4", m.extra_repr().split("recipe=")[1]))
        else:
            rows.append((fqn, shape, _dtype(m), reasons.get(fqn, "")))
    rows += [(fqn, "", _dtype(modules[fqn]), why) for fqn, why in reasons.items()
             if fqn not in linears and fqn in modules]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(nvfp4_counts(model))
    return "\n".join(lines)


def _dtype(module: nn.Module) -> str:
    p = next(module.parameters(recurse=False), None)
    return "" if p is None else str(p.dtype).replace("torch.", "")


@contextlib.contextmanager
def capture(model: nn.Module) -> Iterator[Dict[str, Dict[str, object]]]:
    """Record the NVFP4 operands each NVFP4 module of ``model`` (NVFP4Linear and the experts
    modules) uses in the steps run inside the context, as :class:`NVFP4Tensor` s (the last
    step's, per module).

    Yields a dict ``{layer fqn: {name: NVFP4Tensor}}`` filled as the steps run: after a forward,
    ``"w"`` (W as fprop's B, (N, K)), ``"x"`` (X as fprop's A, (M, K)) and, when the call records
    autograd (not under no_grad: ``layer.training``) and the token count is a multiple of 16,
    ``"xt"`` (X^T as wgrad's B: RHT along the tokens, (K, M)); after the
    backward, ``"dy"`` (dY as dgrad's A, SR) and ``"dyt"`` (dY^T as wgrad's A). Each is quantized
    again from the step's tensors with the step's specs, RHT signs and SR stream, so it holds the
    bits the GEMMs used (it costs those quantizations again; eager mode only, not under
    torch.compile). Outside the context the layers record nothing. Only the operands of GEMMs
    that run in NVFP4 are recorded: a recipe's ``forward_override`` leaves out "w" and "x", its
    ``backward_override`` "xt", "dy" and "dyt" (``layer.nvfp4_operands``).

    An experts module records ``{projection: {name: [NVFP4Tensor, ...]}}`` with the same names:
    one tensor per expert for ``"w"`` (W_g, (N, K)), one per token group for the others (the
    group's tokens as the grouped GEMMs quantize them: X_g (M_g, K), X_g^T (K, M_g), ...).

    Example::

        with nvfp4_recipe.capture(model) as ops:
            loss_fn(model(x)).backward()
        print(ops["blocks.0.fc1"]["dy"])          # the SR-quantized output gradient
        nvfp4_recipe.tensor_stats(...)
    """
    with _recording(model, lambda hp, q: q) as stores:
        yield stores


@contextlib.contextmanager
def _recording(model: nn.Module, keep, accumulate: bool = False
               ) -> Iterator[Dict[str, Dict[str, object]]]:
    """Every NVFP4 module of ``model`` records ``keep(hp, q)`` of its operands
    (:class:`layer.Recording`, in a :class:`_Store`) inside the context; yields ``{fqn: its
    store}``."""
    layers = {fqn: m for fqn, m in model.named_modules() if isinstance(m, NVFP4Module)}
    for layer in layers.values():
        layer.captured = Recording(keep)
        layer.captured.store = _Store(accumulate)
    try:
        yield {fqn: layer.captured.store for fqn, layer in layers.items()}
    finally:
        for layer in layers.values():
            layer.captured = None


class _Store(dict):
    """A module's :class:`layer.Recording` store: ``{name: keep(hp, q)}``, an experts module's
    ``{projection: {name: [one per expert or token group]}}`` (inner stores made by
    ``setdefault``).

    With ``accumulate`` (:class:`QuantStats`) a name recorded again within the context is merged
    with what it holds (:func:`_merged`: counts summed, experts' lists extended), so a step of
    several micro-batches (gradient accumulation) is recorded whole; otherwise (:func:`capture`)
    the last one replaces it.
    """

    def __init__(self, accumulate: bool):
        super().__init__()
        self.accumulate = accumulate

    def __setitem__(self, name: str, value) -> None:
        if self.accumulate and name in self:
            value = _merged(self[name], value)
        super().__setitem__(name, value)

    def update(self, *args, **kwargs) -> None:
        for name, value in dict(*args, **kwargs).items():
            self[name] = value

    def setdefault(self, name: str, default=None):
        if name not in self:
            inner = _Store(self.accumulate) if isinstance(default, dict) else default
            super().__setitem__(name, inner)
        return self[name]


def _merged(old, new):
    """Two recordings of one operand in one :class:`QuantStats` step: lists (an experts
    module's, one entry per expert or token group) concatenated; ``(counts, four_over_six)``
    pairs with their (len(COUNTS),) float64 counts summed on the device (no host sync)."""
    if isinstance(old, list):
        return old + new
    return old[0] + new[0], old[1]


def _top_codes(codes: torch.Tensor, block: Block) -> torch.Tensor:
    """The largest magnitude code of each block (a 1x16 block, or a 16x16 tile for 2d blocks) of
    codes (rows, K), shaped as the block scales: a block 4/6 mapped to 4 has a top code below 6's."""
    rows = codes.reshape(-1, codes.shape[-1]).shape[0]
    top = codes.reshape(rows, -1, BLOCK).amax(-1)
    return top.reshape(rows // BLOCK, BLOCK, -1).amax(1) if block is Block.D2 else top


def tensor_stats(x: torch.Tensor, spec: Union[NVFP4Recipe, QuantSpec, None] = None,
                 role: Union[GemmRole, str] = GemmRole.X_FPROP, *, seed: int = 0, offset: int = 0,
                 rht_signs: Optional[torch.Tensor] = None,
                 amax: Optional[torch.Tensor] = None) -> Dict[str, object]:
    """What NVFP4 quantization does to ``x``, read from the quantized result itself (the codes,
    block scales and dequantized values of ``reference.quantize`` / ``reference.dequantize``).

    Args:
        x: (..., K) bf16/fp16/fp32 tensor with at least one element, K a multiple of 16.
        spec: an NVFP4Recipe (the quantization of operand ``role`` of its recipe table, e.g.
            "w_fprop", "dy_dgrad", with the recipe's RHT signs), a QuantSpec, or None for 1d
            per-tensor RN.
        seed, offset: the SR stream (SR specs); rht_signs: the RHT signs of a QuantSpec with RHT
            (default: TE's vector); amax: an amax to use instead of the measured one.
    Returns:
        dict with
        ``sqnr_db``: 10 log10(|x|^2 / |x - deq(q(x))|^2), summed in float64 (finite for any finite
            fp32 input; inf only when the quantization is exact; nan when x has a NaN or Inf), in
            the RHT domain when the RHT is on;
        ``non_finite``: the number of NaN and Inf elements of x (they make the outer scale and
            every dequantized value non-finite, spec item 9);
        ``flushed_to_zero``: fraction of the nonzero inputs that dequantize to 0 (small values in a
            block with a large amax, or whole blocks whose E4M3 scale is too small);
        ``saturated``: fraction of the elements clipped by the E2M1 range: quantized to the largest
            code (6) of a nonzero block scale while |x| exceeds the dequantized value by more than
            1/8 (beyond what the E4M3 rounding of the block scale can cause), e.g. under amax
            estimation;
        ``zero_scale_blocks``: fraction of the blocks whose E4M3 block scale is 0;
        ``scale_histogram``: counts of the exponents of the nonzero block scales, {exponent: count};
        ``amax`` and ``outer_scale`` (float or tensor);
        with a 4/6 spec, ``four_over_six``: ``{"error", "e4m3_max", "fast_math"}`` of the spec and
        ``mapped_to_4``: the fraction of the blocks with a nonzero scale whose largest code is 4
        rather than 6 (4/6 chose the map-to-4 scale; exact under RN).
    Raises:
        TypeError, ValueError: as ``reference.quantize``; ValueError for an empty ``x`` or a
            ``role`` that is not a GemmRole nor one's value; TypeError for an ``x`` that is not a
            tensor or a ``spec`` of another type.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tensor_stats takes a torch.Tensor as x, got {type(x).__name__}")
    if role not in _ROLES:
        raise ValueError(f"tensor_stats: unknown role {role!r}; expected a GemmRole or one of "
                         f"{[r.value for r in GemmRole]}")
    if x.numel() == 0:
        raise ValueError("tensor_stats: x has no elements")
    if isinstance(spec, NVFP4Recipe):
        qspec = spec.spec(role)
        rht_signs = spec.signs() if rht_signs is None else rht_signs
    elif isinstance(spec, QuantSpec) or spec is None:
        qspec = spec or QuantSpec()
        rht_signs = NVFP4Recipe().signs() if rht_signs is None else rht_signs
    else:
        raise TypeError(f"tensor_stats takes an NVFP4Recipe, a QuantSpec or None, got {type(spec).__name__}")
    signs = rht_signs if qspec.rht else None
    ref = R.rht(x, signs).float() if signs is not None else x.float()
    data = R.quantize(x, qspec, seed=seed, offset=offset, rht_signs=signs, amax_=amax)
    deq = R.dequantize(data)
    ref64, deq64 = ref.double(), deq.double()
    err = (ref64 - deq64).square().sum().item()
    sig = ref64.square().sum().item()
    non_finite = x.numel() - torch.isfinite(x).sum().item()
    if non_finite:
        sqnr = math.nan
    elif err > 0:
        sqnr = 10 * math.log10(sig / err)
    else:
        sqnr = math.inf
    nonzero = ref != 0
    flushed = ((deq == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)
    # a block whose scale is 0 puts its values on the largest code too, but it is flushed, not clipped
    at_max = ((unpack_nibbles(data.qdata) & 0x7) == E2M1_MAX_CODE) & (deq != 0)
    saturated = (at_max & (ref64.abs() > deq64.abs() * (1 + _SATURATION_MARGIN))).double().mean().item()
    scale = data.scale.float()
    exps, counts = torch.unique(torch.floor(torch.log2(scale[scale > 0])).to(torch.int64),
                                return_counts=True)
    return {
        "sqnr_db": sqnr,
        "non_finite": non_finite,
        "flushed_to_zero": flushed,
        "saturated": saturated,
        "zero_scale_blocks": (scale == 0).double().mean().item(),
        "scale_histogram": dict(zip(exps.tolist(), counts.tolist())),
        "amax": _item(R.amax(ref, qspec.scaling)),
        "outer_scale": _item(data.outer_scale),
        **_four_over_six_stats(data),
    }


def _four_over_six_stats(op: NVFP4Operand) -> Dict[str, object]:
    """``four_over_six`` and ``mapped_to_4`` of :func:`tensor_stats` for a 4/6 operand, else {}."""
    fos = op.spec.four_over_six
    if fos is None:
        return {}
    top = _top_codes(unpack_nibbles(op.qdata) & 0x7, op.block).reshape(op.scale.shape)
    live = op.scale.float() > 0
    mapped = ((top < E2M1_MAX_CODE) & live).sum().item() / max(live.sum().item(), 1)
    return {"four_over_six": {"error": fos.error.value, "e4m3_max": fos.e4m3_max,
                              "fast_math": fos.fast_math}, "mapped_to_4": mapped}


def _item(t: torch.Tensor):
    return t.item() if t.dim() == 0 else t


# The smallest normal E4M3 number: nonzero block scales below it are subnormal (fewer bits).
_E4M3_MIN_NORMAL = 2.0 ** -6
# The counts operand_counts returns, in order.
COUNTS = ("elements", "blocks", "nonzero", "flushed", "saturated", "err", "signal", "zero_blocks",
          "subnormal_blocks", "blocks_to_4")


def _corner(op: NVFP4Operand, rows: int, cols: int) -> NVFP4Operand:
    """The operand's first ``rows`` rows (a multiple of 16 for 2d blocks) and ``cols`` columns (a
    multiple of 16): whole blocks, with its spec."""
    scale_rows = rows // BLOCK if op.block is Block.D2 else rows
    outer = op.outer_scale[:rows] if op.outer_scale.dim() else op.outer_scale
    return NVFP4Operand(op.qdata[:rows, :cols // 2], op.scale[:scale_rows, :cols // BLOCK], outer,
                        op.spec)


def operand_counts(hp: torch.Tensor, q: NVFP4Tensor, max_rows: int = 512,
                   max_cols: int = 1024) -> torch.Tensor:
    """The counts behind :class:`QuantStats`' statistics of one operand, over its first
    ``max_rows`` rows and ``max_cols`` columns (whole blocks of the operand's quantization: its
    amax is the whole tensor's), left on the operand's device (no host sync).

    Args:
        hp: (rows, K) the high-precision operand as its GEMM takes it (before the RHT).
        q: its quantization (rows, K), as ``inspect.capture`` records it.
        max_rows, max_cols: positive multiples of 16: the sample's size, which bounds the cost
            whatever the operand's (X^T and dY^T have every token of the step along K).
    Returns:
        float64 (len(COUNTS),), in the order of :data:`COUNTS`: ``elements``, ``blocks``,
        ``nonzero`` (nonzero inputs, in the RHT domain where the RHT is on), ``flushed`` (nonzero
        inputs that dequantize to 0), ``saturated`` (as in :func:`tensor_stats`), ``err`` and
        ``signal`` (sums of the squared error and of the squared input), ``zero_blocks`` and
        ``subnormal_blocks`` (E4M3 block scales that are 0, or below 2**-6), ``blocks_to_4``
        (nonzero blocks whose largest code is 4 rather than 6: mapped to 4 by 4/6; exact under RN).
    """
    rows, cols = min(max_rows, hp.shape[0]), min(max_cols, hp.shape[1])
    if rows == 0 or cols == 0:  # an empty token group of an experts module
        return torch.zeros(len(COUNTS), dtype=torch.float64, device=hp.device)
    op = _corner(q.operand, rows, cols)
    ref = hp[:rows, :cols]
    ref = (R.rht(ref, q.rht_signs) if q.rht_signs is not None else ref).double()
    deq = R.dequantize(op).double()
    codes = unpack_nibbles(op.qdata) & 0x7
    nonzero = ref != 0
    at_max = (codes == E2M1_MAX_CODE) & (deq != 0)
    top = _top_codes(codes, op.block)
    scale = op.scale.float()
    sums = torch.stack([
        nonzero.sum(), ((deq == 0) & nonzero).sum(),
        (at_max & (ref.abs() > deq.abs() * (1 + _SATURATION_MARGIN))).sum(),
        (ref - deq).square().sum(), ref.square().sum(), (scale == 0).sum(),
        ((scale > 0) & (scale < _E4M3_MIN_NORMAL)).sum(),
        ((top < E2M1_MAX_CODE) & (scale > 0)).sum()]).double()
    sizes = [sums.new_full((1,), n) for n in (ref.numel(), scale.numel())]  # no host copy: capturable
    return torch.cat([*sizes, sums])


def _statistics(counts: torch.Tensor, four_over_six: bool) -> Dict[str, float]:
    """Shares and errors from (summed) :func:`operand_counts`."""
    c = dict(zip(COUNTS, counts.tolist()))
    stats = {"flushed_to_zero": c["flushed"] / max(c["nonzero"], 1),
             "saturated": c["saturated"] / max(c["elements"], 1),
             "relative_mse": c["err"] / c["signal"] if c["signal"] else 0.0,
             "sqnr_db": 10 * math.log10(c["signal"] / c["err"]) if c["err"] else math.inf,
             "zero_scale_blocks": c["zero_blocks"] / max(c["blocks"], 1),
             "subnormal_scale_blocks": c["subnormal_blocks"] / max(c["blocks"], 1)}
    if four_over_six:
        stats["mapped_to_4"] = c["blocks_to_4"] / max(c["blocks"], 1)
    return stats


class QuantStats:
    """Quantization statistics of every NVFP4 operand of a model during training, every ``every``
    steps: per layer (an experts module: per projection, summed over experts and token groups)
    and operand (``"w"``, ``"x"``, ``"xt"``, ``"dy"``, ``"dyt"``: the GEMM operands of
    :func:`capture`), the share of nonzero values flushed to zero, the share saturated, the
    relative MSE and SQNR (dB), the shares of zero and of subnormal E4M3 block scales, and for
    operands quantized with 4/6 the share of blocks mapped to 4. The statistics read the first
    ``max_rows`` rows and ``max_cols`` columns of each operand (its quantization is the whole
    operand's), so that a recorded step costs about the same at any model size.

    A step is everything inside one :meth:`step` context: under gradient accumulation every
    micro-batch's forward and backward. The counts behind the statistics (:data:`COUNTS`: elements,
    flushed values, squared errors and signal, block scales, ...) are summed over the step's
    micro-batches and read when the context exits, so each share or error is that of all of the
    step's elements together (a micro-batch weighs by its elements; W, the same in each, keeps its
    statistics). An eval step (a forward under ``torch.no_grad()`` / ``torch.inference_mode()``)
    records the copies that forward makes: ``"w"`` and ``"x"``, no ``"xt"``.
    A frozen NVFP4 linear (:class:`frozen.NVFP4FrozenLinear`) records the activation copies it
    quantizes, ``"x"`` and ``"dy"`` (no weight: stored codes; no wgrad copies).

    On a recorded step every operand is quantized once more (as :func:`capture` does). Run that
    step eagerly inside :meth:`step`, or, in a loop that replays its step in a CUDA graph, replay
    a second graph that records (:meth:`graphed`; dense models); not under torch.compile.

    Example::

        stats = QuantStats(model, every=100)
        for step, (x, y) in enumerate(batches):
            with stats.step(step):
                loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad()
        stats.history  # [{"step": 0, "layers": {"blocks.0.attn.qkv": {"x": {...}, ...}}}, ...]

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: ``every`` not a positive int, ``max_rows`` or ``max_cols`` not a positive
            multiple of 16.
    """

    def __init__(self, model: nn.Module, every: int = 100, max_rows: int = 512,
                 max_cols: int = 1024):
        check_module("QuantStats", model)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"QuantStats: every must be a positive int, got {every!r}")
        for name, n in (("max_rows", max_rows), ("max_cols", max_cols)):
            if not isinstance(n, int) or n < BLOCK or n % BLOCK:
                raise ValueError(f"QuantStats: {name} must be a positive multiple of {BLOCK}, "
                                 f"got {n!r}")
        self.model, self.every, self.max_rows, self.max_cols = model, every, max_rows, max_cols
        self.history: List[Dict[str, object]] = []

    def due(self, step: int) -> bool:
        """Whether :meth:`step` records step ``step``."""
        return step % self.every == 0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run one training step's forward and backward inside (all its micro-batches under
        gradient accumulation, or an eval forward); on a due step the statistics of everything
        recorded inside, counts summed over micro-batches, are appended to :attr:`history` when
        the context exits."""
        if not self.due(step):
            yield
            return
        with _recording(self.model, self._keep, accumulate=True) as stores:
            yield
        self.history.append({"step": step, "layers": _layer_statistics(*_stacked_counts(stores))})

    def _keep(self, hp: torch.Tensor, q: NVFP4Tensor):
        return operand_counts(hp, q, self.max_rows, self.max_cols), q.four_over_six is not None

    def plot(self, path: str, title: str = "") -> None:
        """Write a PNG of :attr:`history` to ``path``: :func:`plot_quant_stats` of this one
        history (its errors: matplotlib missing, nothing recorded yet)."""
        plot_quant_stats(self, path, title)

    def graphable(self) -> bool:
        """Whether :meth:`graphed` can capture a recorded step of this model: its NVFP4 layers
        are all dense (an experts module reads its token groups' bounds on the host to record
        them group by group)."""
        return not any(isinstance(m, NVFP4Experts) for m in self.model.modules())

    def graphed(self, step_fn: Callable[[], torch.Tensor],
                pool=None) -> Callable[[int], torch.Tensor]:
        """A recorded training step captured in a CUDA graph, for loops that replay their step
        in one: ``step_fn`` (forward, backward, optimizer step; returns the loss) with the
        statistics' work captured beside it, so a recorded step costs the graph step plus the
        recording's kernels instead of an eager step.

        Capture it as ``torch.cuda.graph`` requires: after the step and a recorded step
        (:meth:`step`, which compiles the recording's kernels) ran eagerly on a side stream.

        Args:
            step_fn: the step, as captured for the loop's own graph.
            pool: the memory pool of that graph (``CUDAGraph.pool()``) to share: safe because
                the two graphs never run at once and the loss and the counts this graph writes
                are read right after its replay.
        Returns:
            ``record(step)``: replays the graph, appends the statistics of step ``step`` to
            :attr:`history` (one device-to-host transfer) and returns the loss tensor the graph
            writes.
        Raises:
            ValueError: the model has experts modules (:meth:`graphable`): record their steps
                eagerly with :meth:`step`.
        """
        if not self.graphable():
            raise ValueError("QuantStats.graphed: the model has NVFP4 experts modules, which record "
                             "their token groups from the host; record eagerly with QuantStats.step")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            with _recording(self.model, self._keep, accumulate=True) as stores:
                loss = step_fn()
            entries, counts = _stacked_counts(stores)

        def record(step: int) -> torch.Tensor:
            graph.replay()
            self.history.append({"step": step, "layers": _layer_statistics(entries, counts)})
            return loss
        return record


def _stacked_counts(stores: Dict[str, Dict[str, object]]):
    """(entries, counts) of the recorded ``(counts, four_over_six)``: ``entries`` lists (layer,
    operand, four_over_six), an experts module's projections as layers ``fqn.projection``;
    ``counts`` (len(entries), len(COUNTS)) stays on the device, an experts projection's list
    summed; None when nothing was recorded."""
    entries, counts = [], []
    for fqn, store in stores.items():
        for name, value in store.items():
            if isinstance(value, dict):  # an experts projection: {operand: [(counts, 4/6), ...]}
                for op, pairs in value.items():
                    entries.append((f"{fqn}.{name}", op, pairs[0][1]))
                    counts.append(torch.stack([c for c, _ in pairs]).sum(0))
            else:
                entries.append((fqn, name, value[1]))
                counts.append(value[0])
    return entries, torch.stack(counts) if counts else None


def _layer_statistics(entries, counts: Optional[torch.Tensor]) -> Dict[str, Dict[str, object]]:
    """``{layer: {operand: statistics}}`` from :func:`_stacked_counts`; the counts come to the
    host in one transfer."""
    out: Dict[str, Dict[str, object]] = {}
    if counts is not None:
        for (layer, operand, fos), c in zip(entries, counts.cpu()):
            out.setdefault(layer, {})[operand] = _statistics(c, fos)
    return out


# The QuantStats statistics plot_quant_stats draws, one panel each (mapped_to_4 only under 4/6).
STAT_PANELS = ("flushed_to_zero", "saturated", "relative_mse", "zero_scale_blocks",
               "subnormal_scale_blocks", "mapped_to_4")
_OPERAND_STYLES = {"w": "-", "x": "--", "xt": ":", "dy": "-.", "dyt": (0, (3, 1, 1, 1, 1, 1))}
History = Sequence[Dict[str, object]]


def plot_quant_stats(stats: Union[QuantStats, History, Mapping[str, History]], path: str,
                     title: str = "") -> None:
    """Write a PNG (1600 x 800 pixels) of QuantStats statistics against the step: one panel per
    statistic of :data:`STAT_PANELS` (``mapped_to_4`` only where 4/6 recorded it), a line style
    per operand ("w", "x", "xt", "dy", "dyt"), each point the mean over the layers of one recorded
    step; a color per history. ``nvfp4-recipe train --quant-stats-every`` draws its
    ``quant_stats.png`` with it. Uses matplotlib's object API (no pyplot: the session's backend is
    left as it is).

    Args:
        stats: a :class:`QuantStats`, its ``history`` (a list of ``{"step", "layers"}``), or
            ``{label: history}`` to compare runs (e.g. recipes; the labels go in the legend).
        path: the PNG file to write (its directory must exist).
        title: the figure's title, above "mean over the layers".
    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
        ValueError: no history holds a recorded step.
        TypeError: ``stats`` is none of those kinds.
    """
    histories = _histories(stats)
    figure_class, line_class, colors = _matplotlib()
    fig = figure_class(figsize=(16, 8))
    for ax, stat in zip(fig.subplots(2, 3).flat, STAT_PANELS):
        for i, history in enumerate(histories.values()):
            for operand, points in _operand_means(history, stat).items():
                ax.plot(*zip(*points), color=colors[i % len(colors)],
                        linestyle=_OPERAND_STYLES.get(operand, "-"))
        ax.set(xlabel="step", ylabel="MSE / mean square" if stat == "relative_mse" else "share",
               title=stat.replace("_", " "))
        ax.grid(alpha=0.3)
    handles = _legend(line_class, histories, colors)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle("\n".join(filter(None, (title, "mean over the layers"))), fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)


def _histories(stats) -> Dict[str, History]:
    """``{label: history}`` of :func:`plot_quant_stats`' argument (one history: label ""), the
    empty histories left out.

    Raises:
        TypeError: not a QuantStats, a list of history entries or a mapping of them.
        ValueError: nothing recorded.
    """
    if isinstance(stats, QuantStats):
        stats = {"": stats.history}
    elif isinstance(stats, (list, tuple)):
        stats = {"": stats}
    if not isinstance(stats, Mapping) or not all(
            isinstance(h, (list, tuple)) and all(isinstance(e, dict) and "layers" in e for e in h)
            for h in stats.values()):
        raise TypeError("plot_quant_stats: stats must be a QuantStats, its history (a list of "
                        "{'step', 'layers'} dicts) or a dict {label: history}, got "
                        f"{type(stats).__name__}")
    recorded = {label: h for label, h in stats.items() if h}
    if not recorded:
        raise ValueError("plot_quant_stats: nothing recorded: no history holds a step (QuantStats "
                         "records only inside QuantStats.step on due steps)")
    return recorded


def _matplotlib():
    """(matplotlib's Figure class, its Line2D class, the default color cycle).

    Raises:
        ImportError: matplotlib is not installed, saying how to install it.
    """
    try:
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as e:
        raise ImportError("plot_quant_stats needs matplotlib, an optional dependency: "
                          "pip install 'nvfp4-recipe[plot]' (or pip install matplotlib)") from e
    return Figure, Line2D, matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]


def _legend(line_class, histories: Mapping[str, History], colors: Sequence[str]) -> list:
    """Legend handles (``line_class``: matplotlib's Line2D): a color per labelled history, a line
    style per operand."""
    handles = [line_class([], [], color=colors[i % len(colors)], label=label)
               for i, label in enumerate(histories) if label]
    return handles + [line_class([], [], color="gray", linestyle=style, label=operand)
                      for operand, style in _OPERAND_STYLES.items()]


def _operand_means(history: History, stat: str) -> Dict[str, List[tuple]]:
    """{operand: [(step, mean over the layers of ``stat``)]} of a QuantStats history."""
    out: Dict[str, List[tuple]] = {}
    for entry in history:
        per_operand: Dict[str, List[float]] = {}
        for operands in entry["layers"].values():
            for operand, stats in operands.items():
                if stat in stats:
                    per_operand.setdefault(operand, []).append(stats[stat])
        for operand, values in per_operand.items():
            out.setdefault(operand, []).append((entry["step"], sum(values) / len(values)))
    return out
