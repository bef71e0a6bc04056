"""Results of a comparison: the table printed at the end, the JSON file and the loss-curve plot."""

import json
import math
import os
from typing import Dict, List, Optional, Sequence

from .config import BASELINE
from .loop import RunResult

TABLE_HEADER = ("recipe", "steps", "train loss", "val loss (nats)", f"gap to {BASELINE}",
                "tokens/s", "peak memory")


def relative_gap(val: float, baseline: Optional[float]) -> Optional[float]:
    """(val - baseline) / baseline, or None without a finite baseline."""
    if baseline is None or not math.isfinite(baseline) or baseline == 0:
        return None
    return (val - baseline) / baseline


def baseline_val(results: Sequence[RunResult]) -> Optional[float]:
    """The validation loss of the baseline run, if it is among ``results``."""
    return next((r.val_loss for r in results if r.recipe == BASELINE), None)


def _fmt_bytes(n: Optional[int]) -> str:
    return "n/a (CPU)" if n is None else f"{n / 2**30:.2f} GiB"


def _fmt_num(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else "nan"


def format_table(results: Sequence[RunResult]) -> str:
    """A Markdown table, one row per run (gap: relative validation-loss gap to the baseline)."""
    base = baseline_val(results)
    rows = [TABLE_HEADER, tuple("---" for _ in TABLE_HEADER)]
    for r in results:
        gap = relative_gap(r.val_loss, base)
        rows.append((r.recipe + ("" if r.status == "ok" else f" ({r.status})"), str(r.steps),
                     _fmt_num(r.train_loss, ".4f"), _fmt_num(r.val_loss, ".4f"),
                     "n/a" if gap is None or not math.isfinite(gap) else f"{gap * 100:+.2f}%",
                     _fmt_num(r.tokens_per_s, ",.0f"), _fmt_bytes(r.peak_memory_bytes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_HEADER))]
    return "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows)


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
    """Write ``meta`` plus the runs (each with its gap to the baseline) as JSON; NaN becomes null."""
    base = baseline_val(results)
    runs = [dict(r.as_dict(), val_gap_to_baseline=relative_gap(r.val_loss, base)) for r in results]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite(dict(meta, runs=runs)), f, indent=1)
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
    base = {int(s): v for s, v in next((r.val_curve for r in results if r.recipe == BASELINE), [])}
    smoothed = [_smooth(r.train_curve) for r in results]
    for r, train in zip(results, smoothed):
        line, = ax_train.plot(range(1, len(train) + 1), train, label=r.recipe)
        if not r.val_curve:
            continue
        steps, vals = zip(*r.val_curve)
        ax_val.plot(steps, vals, marker="o", color=line.get_color(), label=r.recipe)
        gaps = [(s, 100 * (v - base[s]) / base[s]) for s, v in r.val_curve if s in base and s > 0]
        if gaps:
            ax_gap.plot(*zip(*gaps), marker="o", color=line.get_color(), label=r.recipe)
    ax_train.set_ylim(top=_zoom_top(smoothed, 0.1))
    ax_val.set_ylim(top=_zoom_top([[v for s, v in r.val_curve if s > 0] for r in results], 0.0))
    ax_train.set(xlabel="step", ylabel="nats/byte (EMA 0.05)", title="training loss")
    ax_val.set(xlabel="step", ylabel="nats/byte", title="validation loss, held-out files (step 0 off scale)")
    ax_gap.set(xlabel="step", ylabel="%", title=f"validation loss relative to {BASELINE}")
    ax_gap.axhline(0, color="gray", lw=0.8)
    if not base:
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
