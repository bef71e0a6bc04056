"""Read torchtitan 0.2's training logs: a comparison table, and the check of a resumed run.

torchtitan logs one line per step (``--metrics.log_freq 1``, ``components/metrics.py``)::

    step: 12  loss:  5.01234  grad_norm:  0.8123  memory: 31.20GiB(21.94%)  tps: 20,480  tflops: 123.45  mfu: 12.48%

``tps`` is tokens per second per GPU, ``tflops`` the model FLOPs per second per GPU (6 x the
non-embedding parameters + attention, per token), ``mfu`` that against the GPU's bf16 dense peak
(989 TFLOP/s for an H100 / H200), ``memory`` the peak reserved since the last line.

    python examples/torchtitan/report.py summary --warmup 10 bf16-ac_none=A.log nvfp4-ac_none=B.log
    python examples/torchtitan/report.py resume --after 20 --logs REF.log RESUMED.log \\
        --checkpoints REF/checkpoint/step-40 KILLED/checkpoint/step-40

``summary`` prints a Markdown table (and ``--json``): mean tokens/s, TFLOPS and MFU of the steps
after ``--warmup`` (compilation and warm-up excluded), the peak memory over all steps, the loss of
the last step and the mean of the last 10, and for a run named ``RECIPE-SUFFIX`` its step time
against ``bf16-SUFFIX`` (bf16's tokens/s over its own). ``resume`` checks that the resumed run's
lines after step ``--after`` print the same loss and grad norm as the uninterrupted run's, and,
with ``--checkpoints``, that the two final DCP checkpoints hold the same tensors bit for bit;
it exits with status 1 otherwise.
"""

import argparse
import json
import re
import sys
import warnings
from dataclasses import dataclass
from statistics import mean
from typing import Any, Dict, List, Sequence

import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

STEP_LINE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<memory>\S+)GiB\(\S+%\)\s+tps:\s*(?P<tps>[\d,]+)\s+tflops:\s*(?P<tflops>[\d,.]+)\s+"
    r"mfu:\s*(?P<mfu>\S+)%")


@dataclass
class Step:
    """One logged training step; ``loss_text`` / ``grad_norm_text`` as printed."""

    step: int
    loss: float
    grad_norm: float
    memory_gib: float
    tps: float
    tflops: float
    mfu: float
    loss_text: str
    grad_norm_text: str


def parse_log_text(text: str) -> List[Step]:
    """The step lines of a torchtitan log, in order (a step logged twice, as after a restart in the
    same log, appears twice)."""
    return [Step(int(m["step"]), float(m["loss"]), float(m["grad_norm"]), float(m["memory"]),
                 float(m["tps"].replace(",", "")), float(m["tflops"].replace(",", "")),
                 float(m["mfu"]), m["loss"], m["grad_norm"])
            for m in STEP_LINE.finditer(text)]


def parse_log(path: str) -> List[Step]:
    """:func:`parse_log_text` of the file ``path``. Raises ValueError if it logs no step."""
    with open(path, errors="replace") as f:
        steps = parse_log_text(f.read())
    if not steps:
        raise ValueError(f"no torchtitan step lines in {path}")
    return steps


def summarize(steps: Sequence[Step], warmup: int) -> Dict[str, float]:
    """Means over the steps after ``warmup`` (all steps if none is), peak memory over all."""
    timed = [s for s in steps if s.step > warmup] or list(steps)
    return {"steps": steps[-1].step, "tokens_per_s_per_gpu": mean(s.tps for s in timed),
            "tflops_per_gpu": mean(s.tflops for s in timed), "mfu_pct": mean(s.mfu for s in timed),
            "peak_memory_gib": max(s.memory_gib for s in steps), "final_loss": steps[-1].loss,
            "loss_last10": mean(s.loss for s in steps[-10:])}


def table(runs: Dict[str, Dict[str, float]]) -> str:
    """Markdown table of :func:`summarize` rows, with the step time against ``bf16-SUFFIX``."""
    lines = ["| run | steps | tokens/s/GPU | TFLOPS/GPU | MFU % | peak GiB | loss (last) | loss (last 10) | step vs bf16 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in runs.items():
        base = runs.get("bf16-" + name.partition("-")[2]) if "-" in name else None
        ratio = f"{base['tokens_per_s_per_gpu'] / r['tokens_per_s_per_gpu']:.2f}x" if base else "-"
        lines.append(f"| {name} | {r['steps']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.1f} | "
                     f"{r['mfu_pct']:.1f} | {r['peak_memory_gib']:.1f} | {r['final_loss']:.4f} | "
                     f"{r['loss_last10']:.4f} | {ratio} |")
    return "\n".join(lines)


def resumed_mismatches(reference: Sequence[Step], resumed: Sequence[Step], after: int) -> List[str]:
    """Where the resumed run's steps after ``after`` print another loss or grad norm than the
    reference's (or are missing); empty if all equal."""
    want = {s.step: s for s in reference if s.step > after}
    got = {s.step: s for s in resumed if s.step > after}
    if not want:
        return [f"the reference run logged no step after {after}"]
    problems = [f"step {n}: missing from the resumed run" for n in sorted(set(want) - set(got))]
    for n in sorted(set(want) & set(got)):
        a, b = want[n], got[n]
        if (a.loss_text, a.grad_norm_text) != (b.loss_text, b.grad_norm_text):
            problems.append(f"step {n}: loss {a.loss_text} / {b.loss_text}, "
                            f"grad_norm {a.grad_norm_text} / {b.grad_norm_text}")
    return problems


def _flatten(state: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """A nested state dict as {"a.b.c": leaf}."""
    flat = {}
    for k, v in state.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[prefix + k] = v
    return flat


def _same_bits(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor):
        return a == b
    return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def checkpoint_mismatches(reference: str, resumed: str) -> List[str]:
    """Keys whose values differ (tensors: in any bit, NaNs and signed zeros included) or exist in
    one only, between two DCP checkpoint folders, read in this process without a process group
    (``_load_state_dict_from_keys``: every key); empty if all are equal."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        a, b = (_flatten(_load_state_dict_from_keys(checkpoint_id=c)) for c in (reference, resumed))
    problems = [f"{k}: only in one checkpoint" for k in sorted(set(a) ^ set(b))]
    return problems + [f"{k}: differs" for k in sorted(set(a) & set(b)) if not _same_bits(a[k], b[k])]


def _summary(args) -> int:
    runs = {}
    for spec in args.runs:
        name, _, path = spec.partition("=")
        runs[name] = summarize(parse_log(path), args.warmup)
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)
    return 0


def _resume(args) -> int:
    reference, resumed = (parse_log(p) for p in args.logs)
    problems = resumed_mismatches(reference, resumed, args.after)
    if args.checkpoints:
        problems += checkpoint_mismatches(*args.checkpoints)
    checked = [s.step for s in resumed if s.step > args.after]
    if problems:
        print("resume check FAILED:\n  " + "\n  ".join(problems[:20]))
        return 1
    print(f"resume check passed: steps {checked[0]}-{checked[-1]} print the same loss and grad norm"
          + (" and the final checkpoints are equal bit for bit" if args.checkpoints else ""))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="the comparison table of runs NAME=LOG")
    s.add_argument("runs", nargs="+", metavar="NAME=LOG")
    s.add_argument("--warmup", type=int, default=10, help="steps left out of the means")
    s.add_argument("--json", help="also write the rows here")
    s.set_defaults(func=_summary)
    r = sub.add_parser("resume", help="the resumed run's steps against the uninterrupted run's")
    r.add_argument("--logs", nargs=2, required=True, metavar=("REFERENCE", "RESUMED"))
    r.add_argument("--after", type=int, required=True, help="the step the checkpoint was saved at")
    r.add_argument("--checkpoints", nargs=2, metavar=("REFERENCE", "RESUMED"),
                   help="the two runs' final DCP checkpoint folders")
    r.set_defaults(func=_resume)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
