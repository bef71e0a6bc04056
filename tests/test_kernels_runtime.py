"""kernels/runtime.py: the launch cache keys on what Triton specializes on, and a cached launch
computes what a launch through Triton computes (new data, other alignments, another stream); kernel
outputs cost Inductor no fill."""

import copy
import logging
import re
import subprocess
import sys
import threading

import pytest
import torch

from nvfp4_recipe.kernels import runtime
from nvfp4_recipe.kernels.quantize import quantize_1d
from nvfp4_recipe.kernels.runtime import launch_key
from nvfp4_recipe.reference import quantize

from nvfp4_cases import assert_same, spec


@pytest.mark.parametrize("shape", [(), (3,), (2, 5)])
def test_empty_outputs_cost_inductor_no_fill(shape):
    """A 0-d ``torch.empty`` is one element of work to Inductor, which stores a zero into it (on
    the GPU in a launch of its own); ``runtime.empty`` makes it a view of a one-element buffer,
    which Inductor leaves alone, like any other empty output."""
    from torch._inductor.utils import run_and_get_code

    def f(x):
        return x + 1, runtime.empty(shape, torch.float32, x.device)

    torch._dynamo.reset()
    (y, out), code = run_and_get_code(torch.compile(f, fullgraph=True), torch.randn(8))
    assert out.shape == shape and out.dtype == torch.float32 and out.device.type == "cpu"
    kernels = set(re.findall(r"\b(?:cpp|triton)_\w*fused_\w+", "\n".join(code)))
    assert kernels and not [k for k in kernels if "empty" in k], kernels


def test_launch_key_separates_what_triton_specializes_on():
    def key(*args, **kwargs):
        return launch_key(args, kwargs)

    base = torch.zeros(64, dtype=torch.float32)
    assert key(base, 7) == key(torch.ones(64), 7)  # other data, same specialization
    assert key(base) != key(base[1:])  # 16-byte alignment
    assert key(base) != key(base.half())
    assert key(1) != key(2) != key(16) != key(32)  # scalars by value
    assert key(2**31) != key(2**31 - 16)
    assert key(True) != key(1) != key(1.0)  # and by type (equal values hash alike)
    assert key(0.5) != key(2.0)
    assert key(base, BLOCK=16) != key(base, BLOCK=32) != key(base)


def test_launch_cache_is_bounded(monkeypatch):
    """A launch per new scalar value (a from_hp seed changing on every call) must not grow the
    cache without end."""
    launcher = _fake_launcher()
    monkeypatch.setattr(runtime.Launcher, "MAX_KEYS", 8)
    for seed in range(20):
        launcher._first_launch(launch_key((torch.zeros(4), seed), {}), (1,),
                               (torch.zeros(4), seed), {})
        assert len(launcher._cache) <= 8
    launcher.clear()  # sweep_quantize.py: the next launch compiles the autotuner's new config
    assert not launcher._cache


def test_prune_puts_a_modes_lead_config_first(monkeypatch):
    """Without NVFP4_AUTOTUNE=1 the first config that fits K is kept; the amax kernel's per-index maxima
    lead with their own tile (``amax._lead``), the global amax keeps the list's first."""
    import triton

    from nvfp4_recipe.kernels import amax as A
    from nvfp4_recipe.kernels.runtime import prune_wide_tiles

    configs = [triton.Config({"BB": bb, "BC": bc, "P": 4}) for bb, bc in ((2, 16), (2, 8), (8, 4))]
    prune = prune_wide_tiles(lambda c: 16 * c.kwargs["BC"], A._lead)
    monkeypatch.delenv("NVFP4_AUTOTUNE", raising=False)  # the default: no tuning

    def first(k, **modes):
        (config,) = prune(configs, {"K": k}, **{"ROW": A.TENSOR, "COL": A.NONE, "ROW_RHT": False, **modes})
        return config.kwargs["BB"], config.kwargs["BC"]

    assert first(4096) == (2, 16)
    assert first(4096, ROW=A.PER_INDEX) == first(4096, COL=A.PER_INDEX) == (8, 4)
    assert first(4096, ROW=A.PER_INDEX, ROW_RHT=True) == (2, 16)  # row blocks: not measured
    assert first(128) == (2, 8)  # a 256-column tile is pruned for K = 128
    monkeypatch.setenv("NVFP4_AUTOTUNE", "1")
    assert len(prune(configs, {"K": 4096}, ROW=A.PER_INDEX, COL=A.NONE, ROW_RHT=False)) == 3


def test_four_over_six_launches_lead_with_their_tile(monkeypatch):
    """A quantize launch with 4/6 on any copy takes the (2, 4) tile with 4 warps first
    (``four_over_six.lead_tile``); without 4/6 the list's first."""
    import triton

    from nvfp4_recipe.kernels.four_over_six import four_over_six_constexprs, lead_tile
    from nvfp4_recipe.kernels.runtime import prune_wide_tiles
    from nvfp4_recipe.spec import FourOverSix

    configs = [triton.Config({"BB": bb, "BC": bc}, num_warps=nw)
               for bb, bc, nw in ((2, 8, 4), (2, 4, 8), (2, 4, 4), (4, 8, 4))]
    prune = prune_wide_tiles(lambda c: 16 * c.kwargs["BC"], lead_tile("ROW_", "COL_"))
    monkeypatch.delenv("NVFP4_AUTOTUNE", raising=False)

    def first(row=None, col=None):
        (c,) = prune(configs, {"K": 4096}, **four_over_six_constexprs(row, "ROW_"),
                     **four_over_six_constexprs(col, "COL_"))
        return c.kwargs["BB"], c.kwargs["BC"], c.num_warps

    assert first() == (2, 8, 4)
    mse, fast = FourOverSix("mse", 256), FourOverSix("mae", 448, fast_math=True)
    assert first(col=mse) == first(row=fast, col=fast) == (2, 4, 4)


class _FakeKernel:
    """A kernel whose launch returns an object shaped like a compiled kernel (no GPU needed) and
    counts the launches."""

    launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            return type("Compiled", (), {"run": None})()
        return launch


def _fake_launcher() -> "runtime.Launcher":
    """A Launcher of a :class:`_FakeKernel` with parameters (x_ptr, seed), its first launch and
    cache logic usable without a GPU."""
    launcher = runtime.Launcher.__new__(runtime.Launcher)
    launcher._cache, launcher._names = {}, ["x_ptr", "seed"]
    launcher.kernel, launcher.needs_scratch = _FakeKernel(), False
    return launcher


@pytest.mark.cuda
def test_cached_launches_match_the_reference():
    """The first launch per key goes through Triton, the next ones through the cache: each call
    here (fresh data, an offset view with other alignment, a side stream) must still give the
    reference's bits."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    sp = spec(scaling="per_token", rounding="sr")
    side = torch.cuda.Stream()
    for step in range(4):
        buf = torch.randn(256 * 272 + 8, device="cuda", generator=gen)
        x = (buf[8:] if step % 2 else buf[:-8]).view(256, 272)
        with torch.cuda.stream(side if step == 3 else torch.cuda.current_stream()):
            got = quantize_1d(x, row=sp, seed=step, row_offset=16 * step)[0]
        torch.cuda.synchronize()
        assert_same(got, quantize(x, sp, seed=step, offset=16 * step))


def _in_fresh_thread(fn):
    """fn() in a new thread (which starts with Triton's default allocator), its result."""
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn()))
    t.start()
    t.join()
    return out["result"]


def test_import_leaves_tritons_allocator_alone():
    """Importing the package (and every kernel module) replaces no Triton state and sets no
    allocator: a fresh interpreter, so that no earlier import hides it."""
    script = """
import threading
from triton.runtime import _allocation
var, default = _allocation._allocator, _allocation._allocator.get()
import nvfp4_recipe
import nvfp4_recipe.backends.triton
from nvfp4_recipe.kernels import (amax, dequantize, expert_weights, gemm, grouped_amax,
                                  grouped_gemm, grouped_quantize, groups, quantize)
seen = []
t = threading.Thread(target=lambda: seen.append(_allocation._allocator.get()))
t.start(); t.join()
assert _allocation._allocator is var
assert _allocation._allocator.get() is default is _allocation._NULL_ALLOCATOR is seen[0]
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_scratch_kernel_launch_sets_the_allocator_in_its_own_thread_only(kernel_device):
    """A GEMM launch (it needs global scratch for its TMA descriptors) makes the package's
    allocator Triton's in the launching thread, a fresh one as autograd's backward thread is;
    another thread keeps Triton's default. Under the interpreter the launch goes through
    ``kernel[grid]``, so this checks the kernel's pre-run hook, the path of a first launch and of
    a launch torch.compile recorded (on a GPU, a cached launch sets it directly)."""
    from triton.runtime import _allocation

    from nvfp4_recipe.kernels import gemm
    from nvfp4_recipe.kernels.runtime import _scratch

    gen = torch.Generator().manual_seed(5)
    a16, b16 = (torch.randn(32, 64, generator=gen).half().to(kernel_device) for _ in range(2))
    one = torch.ones((), device=kernel_device)

    def launch():
        out = gemm.triton_mm(a16, one, b16, one, None, torch.float32)
        return out, _allocation._allocator.get()

    out, allocator = _in_fresh_thread(launch)
    assert allocator is _scratch
    torch.testing.assert_close(out, a16.float() @ b16.float().t())
    assert _in_fresh_thread(_allocation._allocator.get) is _allocation._NULL_ALLOCATOR
    if torch.cuda.is_available():
        buf = _scratch(384, 128, None)
        assert buf.numel() == 384 and buf.is_cuda and buf.data_ptr() % 128 == 0


@pytest.mark.parametrize("version,known", [
    ("3.6.0", True), ("3.6.1", True), ("3.7.1", True), ("3.7.0+git1a2b3c", True),
    ("3.5.1", False), ("3.8.0", False), ("4.0.0", False), ("30.6.0", False), ("dev", False)])
def test_run_abi_known_versions(version, known):
    assert runtime.run_abi_known(version) is known


@pytest.fixture
def triton_version(monkeypatch):
    """Sets ``triton.__version__`` for :func:`runtime.direct_launch`, which decides once."""
    import triton

    def set_version(version):
        monkeypatch.setattr(triton, "__version__", version)
        runtime.direct_launch.cache_clear()

    yield set_version
    runtime.direct_launch.cache_clear()


def test_unknown_triton_version_launches_every_time_through_triton(triton_version, caplog):
    """Under a Triton whose private run ABI the launcher does not know, no binary is cached, so
    every launch takes ``kernel[grid]``; said once in the debug log."""
    triton_version("9.1.0")
    launcher = _fake_launcher()
    x = torch.zeros(4)
    with caplog.at_level(logging.DEBUG, logger=runtime.__name__):
        for _ in range(3):
            hit = launcher._cache.get(launch_key((x, 1), {}))
            launcher._launch_cached(launch_key((x, 1), {}), hit, (1,), (x, 1), {})
    assert launcher.kernel.launches == 3 and not launcher._cache
    assert launcher.compiled(x, 1) is None
    assert sum("9.1.0" in r.getMessage() for r in caplog.records) == 1


def test_known_triton_version_caches_the_first_launch(triton_version):
    triton_version("3.7.1")
    launcher = _fake_launcher()
    x = torch.zeros(4)
    compiled = launcher._first_launch(launch_key((x, 1), {}), (1,), (x, 1), {})
    assert launcher.kernel.launches == 1 and launcher.compiled(x, 1) is compiled
    assert launcher.compiled(x, 2) is None


@pytest.mark.multigpu
def test_cuda_kernels_run_on_the_tensors_gpu_not_the_current_one():
    """A layer on cuda:1 while cuda:0 is current (a model split over GPUs in one process, as
    Hugging Face's device_map does): every kernel launches on cuda:1, first launch and cached
    ones, and gives the bits it gives with cuda:1 current."""
    from torch import nn

    from nvfp4_recipe import NVFP4Linear, NVFP4Recipe

    torch.manual_seed(3)
    base = nn.Linear(256, 128)
    x = torch.randn(64, 256)  # the layer's fp32 weight's dtype (nn.Linear's rule outside autocast)
    dy = torch.randn(64, 128)

    def run(current: int):
        layer = NVFP4Linear.from_module(copy.deepcopy(base).to("cuda:1"), NVFP4Recipe())
        xi = x.to("cuda:1").requires_grad_()
        with torch.cuda.device(current):
            outs = []
            for _ in range(2):  # the second step takes the cached binaries
                y = layer(xi)
                y.backward(dy.to("cuda:1"))
                outs += [y.detach().cpu(), xi.grad.cpu(), layer.weight.grad.cpu()]
                xi.grad = layer.weight.grad = None
            torch.cuda.synchronize(1)
        return outs

    for got, want in zip(run(0), run(1)):
        assert torch.equal(got, want)
