"""Results of a comparison: the table printed at the end, the JSON file and the loss-curve plot."""

import json
import math
import os
from typing import Dict, List, NamedTuple, Optional, Sequence

from ..inspect import plot_quant_stats as inspect_plot
from .config import BASELINE, PAIRED_REFERENCE
from .loop import RunResult

TABLE_HEADER = ("recipe", "steps", "train loss", "val loss (nats)", f"gap to {BASELINE}",
                "tokens/s", "peak memory")


def relative_gap(val: float, baseline: Optional[float]) -> Optional[float]:
    """(val - baseline) / baseline, or None without a finite baseline."""
    if baseline is None or not math.isfinite(baseline) or baseline == 0:
        return None
    return (val - baseline) / baseline


def baseline_val(results: Sequence[RunResult], seed: int) -> Optional[float]:
    """The validation loss of the baseline run of ``seed``, if it is among ``results``."""
    return next((r.val_loss for r in results if r.recipe == BASELINE and r.seed == seed), None)


def _gap(r: RunResult, results: Sequence[RunResult]) -> Optional[float]:
    """``r``'s relative validation-loss gap to the baseline run of its seed."""
    return relative_gap(r.val_loss, baseline_val(results, r.seed))


def _label(r: RunResult, results: Sequence[RunResult]) -> str:
    """The recipe's name, with the seed when the runs have several."""
    return r.recipe if len({x.seed for x in results}) == 1 else f"{r.recipe} (seed {r.seed})"


def _fmt_bytes(n: Optional[int]) -> str:
    return "n/a (CPU)" if n is None else f"{n / 2**30:.2f} GiB"


def _fmt_num(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else "nan"


def _markdown(rows) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    rows = [rows[0], tuple("---" for _ in rows[0]), *rows[1:]]
    return "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows)


def format_table(results: Sequence[RunResult]) -> str:
    """A Markdown table, one row per run (gap: relative validation-loss gap to the baseline run of
    the same seed)."""
    rows = [TABLE_HEADER]
    for r in results:
        gap = _gap(r, results)
        rows.append((_label(r, results) + ("" if r.status == "ok" else f" ({r.status})"), str(r.steps),
                     _fmt_num(r.train_loss, ".4f"), _fmt_num(r.val_loss, ".4f"),
                     "n/a" if gap is None or not math.isfinite(gap) else f"{gap * 100:+.2f}%",
                     _fmt_num(r.tokens_per_s, ",.0f"), _fmt_bytes(r.peak_memory_bytes)))
    return _markdown(rows)


def _mean_std(values: Sequence[float], scale: float, spec: str, unit: str = "") -> str:
    """"mean +- sample standard deviation[ unit]" of the finite ``values`` (times ``scale``), or
    "n/a" (no unit) without one."""
    v = [x * scale for x in values if x is not None and math.isfinite(x)]
    if not v:
        return "n/a"
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else float("nan")
    return f"{format(mean, spec)} +- {_fmt_num(std, spec.lstrip('+'))}{unit}"


def format_seed_table(results: Sequence[RunResult]) -> str:
    """A Markdown table, one row per recipe over its finished runs (one per seed): the mean and
    sample standard deviation of the validation loss and of the gap to the same seed's baseline."""
    rows = [("recipe", "runs", "val loss (nats)", f"gap to {BASELINE}")]
    for recipe in dict.fromkeys(r.recipe for r in results):
        runs = [r for r in results if r.recipe == recipe and r.status == "ok"]
        rows.append((recipe, str(len(runs)), _mean_std([r.val_loss for r in runs], 1, ".4f"),
                     _mean_std([_gap(r, results) for r in runs], 100, "+.2f", " %")))
    return _markdown(rows)


# Student's t 0.975 quantiles for 1-30 degrees of freedom (any statistics table).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Student's t 0.975 quantile (two-sided 95%) for ``df`` >= 1 degrees of freedom: the table up
    to 30, beyond it the Cornish-Fisher expansion around the normal quantile to 1/df^3 (Abramowitz
    and Stegun 26.7.5; within 1e-4 of the exact quantile there)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


class Interval(NamedTuple):
    """The mean of ``n`` values and the half-width of its 95% t-interval (NaN for n < 2)."""

    n: int
    mean: float
    half_width: float


def interval(values: Sequence[float]) -> Interval:
    """:class:`Interval` of the finite ``values`` (mean +- t975(n-1) * s / sqrt(n))."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return Interval(0, float("nan"), float("nan"))
    mean = sum(v) / len(v)
    if len(v) < 2:
        return Interval(1, mean, float("nan"))
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1))
    return Interval(len(v), mean, t975(len(v) - 1) * std / math.sqrt(len(v)))


def paired_differences(results: Sequence[RunResult], reference: str = PAIRED_REFERENCE,
                       ) -> Dict[str, Dict[int, float]]:
    """Per recipe other than the baseline and ``reference``: ``{seed: gap - reference's gap}`` in
    percentage points, over the seeds where the recipe, ``reference`` and the baseline all
    finished. Runs of one seed share the initialization, the data order and the file split, so
    the difference leaves out what the seed does to every recipe alike (a paired comparison)."""
    ok = {(r.recipe, r.seed): r for r in results if r.status == "ok"}
    out: Dict[str, Dict[int, float]] = {}
    for recipe in dict.fromkeys(r.recipe for r in results):
        if recipe in (BASELINE, reference):
            continue
        diffs = {}
        for (name, seed), r in ok.items():
            ref = ok.get((reference, seed))
            gap, ref_gap = _gap(r, results), ref and _gap(ref, results)
            if name == recipe and gap is not None and ref_gap is not None:
                diffs[seed] = 100 * (gap - ref_gap)
        if diffs:
            out[recipe] = diffs
    return out


def format_paired_table(results: Sequence[RunResult], reference: str = PAIRED_REFERENCE) -> str:
    """A Markdown table, one row per recipe of :func:`paired_differences`: the seeds, and the mean
    difference of its gap to the baseline from ``reference``'s, with its 95% t-interval."""
    rows = [("recipe", "seeds", f"gap - {reference}'s gap (mean, 95% CI)")]
    for recipe, diffs in paired_differences(results, reference).items():
        iv = interval(list(diffs.values()))
        ci = "" if not math.isfinite(iv.half_width) else f" +- {iv.half_width:.2f}"
        rows.append((recipe, str(iv.n), f"{iv.mean:+.2f}{ci} pp"))
    return _markdown(rows)


def _paired_json(results: Sequence[RunResult]) -> Dict[str, dict]:
    return {recipe: dict(interval(list(d.values()))._asdict(), per_seed=d)
            for recipe, d in paired_differences(results).items()}


def _finite(obj):
    """``obj`` with non-finite floats replaced by None (JSON has no NaN/Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: str, meta: Dict, results: Sequence[RunResult]) -> None:
    """Write ``meta`` plus the runs (each with its gap to the baseline) and, per recipe, the paired
    difference of its gap from ``PAIRED_REFERENCE``'s (:func:`paired_differences`: ``n``, ``mean``
    and ``half_width`` of the 95% interval in percentage points, ``per_seed``) as JSON; NaN
    becomes null."""
    runs = [dict(r.as_dict(), val_gap_to_baseline=_gap(r, results)) for r in results]
    paired = {f"paired_to_{PAIRED_REFERENCE}": _paired_json(results)}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite(dict(meta, **paired, runs=runs)), f, indent=1)
    os.replace(tmp, path)  # an interrupt never leaves a truncated file


def _smooth(values: List[float], alpha: float = 0.05) -> List[float]:
    """Bias-corrected exponential moving average (like TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = (1 - alpha) * avg + alpha * v
        out.append(avg / (1 - (1 - alpha) ** (i + 1)))
    return out


def _zoom_top(curves: Sequence[Sequence[float]], skip: float) -> Optional[float]:
    """An upper y-limit that shows the later part of the curves: their max after the first
    ``skip`` fraction of the points, plus 5% of the range; None without such points."""
    tails = [v for c in curves for v in c[int(len(c) * skip):] if math.isfinite(v)]
    finite = [v for c in curves for v in c if math.isfinite(v)]
    if not tails:
        return None
    return max(tails) + 0.05 * (max(tails) - min(finite))


def plot_curves(path: str, results: Sequence[RunResult], title: str) -> None:
    """PNG with three panels against the step: the smoothed training loss, the validation loss and
    the validation loss relative to the baseline run (when it is among ``results``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val, ax_gap) = plt.subplots(1, 3, figsize=(16, 4.5))
    bases = {r.seed: {int(s): v for s, v in r.val_curve} for r in results if r.recipe == BASELINE}
    smoothed = [_smooth(r.train_curve) for r in results]
    for r, train in zip(results, smoothed):
        label, base = _label(r, results), bases.get(r.seed, {})
        line, = ax_train.plot(range(1, len(train) + 1), train, label=label)
        if not r.val_curve:
            continue
        steps, vals = zip(*r.val_curve)
        ax_val.plot(steps, vals, marker="o", color=line.get_color(), label=label)
        gaps = [(s, 100 * (v - base[s]) / base[s]) for s, v in r.val_curve if s in base and s > 0]
        if gaps:
            ax_gap.plot(*zip(*gaps), marker="o", color=line.get_color(), label=label)
    ax_train.set_ylim(top=_zoom_top(smoothed, 0.1))
    ax_val.set_ylim(top=_zoom_top([[v for s, v in r.val_curve if s > 0] for r in results], 0.0))
    ax_train.set(xlabel="step", ylabel="nats/byte (EMA 0.05)", title="training loss")
    ax_val.set(xlabel="step", ylabel="nats/byte", title="validation loss, held-out files (step 0 off scale)")
    ax_gap.set(xlabel="step", ylabel="%", title=f"validation loss relative to {BASELINE}")
    ax_gap.axhline(0, color="gray", lw=0.8)
    if not bases:
        ax_gap.text(0.5, 0.5, f"no {BASELINE} run in --recipes", transform=ax_gap.transAxes,
                    ha="center", va="center")
    for ax in (ax_train, ax_val, ax_gap):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_gaps(path: str, results: Sequence[RunResult], title: str) -> bool:
    """PNG of two panels, one row per recipe: its validation-loss gap to the baseline (each seed a
    dot, the mean with its 95% t-interval) and the paired difference of that gap from
    ``PAIRED_REFERENCE``'s (:func:`paired_differences`). Returns False (and writes nothing) with
    fewer than two seeds of a recipe besides the baseline."""
    gaps: Dict[str, List[float]] = {}
    for r in results:
        gap = _gap(r, results)
        if r.recipe != BASELINE and r.status == "ok" and gap is not None:
            gaps.setdefault(r.recipe, []).append(100 * gap)
    if not any(len(v) > 1 for v in gaps.values()):
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paired = paired_differences(results)
    fig, axes = plt.subplots(1, 2, figsize=(13, 1.2 + 0.45 * len(gaps)), sharey=True)
    for ax, data, xlabel in ((axes[0], gaps, f"gap to {BASELINE} (%)"),
                             (axes[1], {k: list(v.values()) for k, v in paired.items()},
                              f"gap - {PAIRED_REFERENCE}'s gap, same seed (percentage points)")):
        for row, recipe in enumerate(gaps):
            values = data.get(recipe, [])
            if not values:
                continue
            iv = interval(values)
            ax.plot(values, [row] * len(values), "o", color="gray", alpha=0.5, ms=4)
            ax.errorbar([iv.mean], [row], xerr=[[iv.half_width if iv.n > 1 else 0]], fmt="D",
                        color="C0", capsize=4)
        ax.axvline(0, color="gray", lw=0.8)
        ax.set(xlabel=xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_yticks(range(len(gaps)), list(gaps))
    axes[0].invert_yaxis()
    fig.suptitle(f"{title}\nmean and 95% t-interval over seeds (dots: seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_quant_stats(path: str, results: Sequence[RunResult], title: str) -> bool:
    """PNG of the quantization statistics (``--quant-stats-every``) of each recipe's first seed
    against the step (:func:`nvfp4_recipe.inspect.plot_quant_stats`: one panel per statistic, a
    color per recipe and a line style per operand, the mean over the layers). Returns False (and
    writes nothing) when no run recorded any."""
    first = min((r.seed for r in results), default=0)
    recorded = {r.recipe: r.quant_stats for r in results if r.quant_stats and r.seed == first}
    if not recorded:
        return False
    inspect_plot(recorded, path, f"{title}\nseed {first}")
    return True
