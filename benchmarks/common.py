"""Shared benchmark helpers: median timing, the device-to-device copy baseline, tables and JSON.

Method (docs/performance.md): time with ``triton.testing.do_bench`` (median, after
warm-up, the L2 cache flushed by a read before each call: :func:`median_ms`), count the bytes a
kernel must move (each input read once, each output written once) and report GB/s against a
device-to-device copy measured in the same run.
"""

import contextlib
import json
import platform
from typing import Callable, Dict, List, Sequence

import torch
import triton


@contextlib.contextmanager
def l2_flushed_by_read():
    """Within this context ``triton.testing.do_bench`` flushes the L2 cache before each timed call
    by reading its 256 MiB buffer (three times) instead of zeroing it.

    Zeroing leaves the L2 full of dirty lines, which the timed kernel then writes back to DRAM
    while it reads: a read-only 128 MiB amax pass took 45.4 us after the zeroing flush and 36.8 us
    after a reading one on an H200, the copy baseline 1.00x. A kernel is then charged for
    its own memory traffic only; its input still comes from DRAM either way. The flush also
    gives the host its head start: do_bench queues the timed call while the flush runs, so a
    flush shorter than the call's host time would time the host's launches too. Three reads
    (about 180 us) outlast the host time of the calls benchmarked here; one read (60 us) did not.
    """
    driver = triton.runtime.driver.active
    driver.clear_cache = lambda cache: [cache.max() for _ in range(3)]
    try:
        yield
    finally:
        del driver.clear_cache  # the class's zeroing flush again


def median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds (``triton.testing.do_bench``; warmup/rep in ms),
    the L2 cache flushed by a read before each call (:func:`l2_flushed_by_read`)."""
    with l2_flushed_by_read():
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
