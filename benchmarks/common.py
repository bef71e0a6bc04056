"""Shared benchmark helpers: median timing, the device-to-device copy baseline, tables and JSON.

Method (docs/performance.md): time with ``triton.testing.do_bench`` (median, after
warm-up), count the bytes a kernel must move (each input read once, each output written once) and
report GB/s against a device-to-device copy measured in the same run.
"""

import json
import platform
from typing import Callable, Dict, List, Sequence

import torch
import triton


def median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds (``triton.testing.do_bench``; warmup/rep in ms)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def gbps(nbytes: float, ms: float) -> float:
    """Achieved bandwidth in GB/s (1e9 bytes per second) for ``nbytes`` moved in ``ms``."""
    return nbytes / ms / 1e6


def copy_gbps(nbytes: int = 2 << 30, device: str = "cuda") -> float:
    """Bandwidth of a device-to-device copy of ``nbytes`` (bytes read plus bytes written), GB/s.

    2 GiB by default: far larger than the L2 cache, like the tensors benchmarked against it.
    """
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return gbps(2 * nbytes, ms)


def environment() -> Dict[str, str]:
    """Versions and device of the run, for the JSON."""
    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def markdown_table(rows: List[Dict[str, object]], columns: Sequence[str]) -> str:
    """A markdown table of ``rows`` (dicts) with the given columns, floats to 3 significant digits."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
