"""torch.compile and CUDA graphs of NVFP4 training on a GPU (the Triton backend)."""

import copy
import re

import pytest
import torch
from torch import nn

from nvfp4_recipe import NVFP4Recipe, quantize_
from test_compile import assert_second_compile_hits_the_cache

pytestmark = pytest.mark.cuda


def mlp(device, d=256, scaling="per_tensor"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)).to(device)
    return quantize_(model, NVFP4Recipe(scaling=scaling))


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def step_both(compiled, model, ref, x):
    """One fwd+bwd of the compiled model (whose parameters are ``model``'s) and of the eager copy
    ``ref`` on x, under bf16 autocast, from zero gradients."""
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.bfloat16):
        compiled(x).float().square().mean().backward()
        ref(x).float().square().mean().backward()


@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_step_matches_eager(device, backend, scaling):
    """aot_eager runs the traced graph with eager kernels: bit-identical gradients. Inductor also
    fuses and reorders the fp32 work around NVFP4Linear (loss, GELU backward, bias-gradient sums),
    so the quantizers see inputs that differ in the last bits, which can flip single rounding
    decisions (an RN tie, an SR threshold) that then propagate to the earlier layer: compare the
    gradients in norm, bounded by 2e-3 (measured on the H200: 1.8e-4 at most), while another SR
    step alone moves these gradients by 1.3-17%. Per-token scaling launches the amax kernel with
    another first config (``amax._lead``), picked by the prune Inductor calls too."""
    model = mlp(device, scaling=scaling)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(512, 256, device=device, dtype=torch.bfloat16)
    for _ in range(2):  # the second step checks that the SR step advanced in the compiled backward
        step_both(compiled, model, ref, x)
        for a, b in zip(grads(model), grads(ref)):
            if backend == "aot_eager":
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            else:
                assert float((a - b).norm() / b.norm()) < 2e-3
    assert int(model[0].sr_step) == int(ref[0].sr_step) == 2


def test_cuda_graph_replay_advances_sr(device):
    model = mlp(device)
    x = torch.randn(512, 256, device=device)

    def step():
        model(x).square().mean().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: autotuning and allocations happen outside the capture
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(model)  # its SR step equals the graph's first replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seen = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        ref.zero_grad(set_to_none=True)
        ref(x).square().mean().backward()
        for a, b in zip(grads(model), grads(ref)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        seen.append(grads(model)[0])
    assert not torch.equal(seen[0], seen[1])  # a new SR stream on every replay
    assert int(model[0].sr_step) == int(ref[0].sr_step) == 5


def test_reduce_overhead_advances_sr_every_step(device):
    """torch.compile's "reduce-overhead" mode (CUDA graphs under Inductor): each replayed step
    uses the next SR stream, as eager does. Inductor's fused fp32 work around the layers may flip
    single rounding decisions (see test_compiled_step_matches_eager), hence the same 2e-3 bound
    against the eager model; two steps on the same input must still differ (a new SR stream)."""
    model = mlp(device)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(512, 256, device=device, dtype=torch.bfloat16)
    seen = []
    for _ in range(4):  # warm-up, recording, then replays of the captured graph
        step_both(compiled, model, ref, x)
        for a, b in zip(grads(model), grads(ref)):
            assert float((a - b).norm() / b.norm()) < 2e-3
        seen.append(grads(model)[0])
    assert not torch.equal(seen[-2], seen[-1])
    assert int(model[0].sr_step) == int(ref[0].sr_step) == 4


def test_inductor_launches_the_layers_triton_kernels_itself(device):
    """With the Triton backend the layer's operators are triton_ops: torch.compile traces their
    bodies, so Inductor's generated code launches the quantize kernels and the TMA GEMM (used at
    this size) itself, forward and backward, and calls none of this package's operators; the
    kernels' empty outputs (the 0-d per-tensor outer scales among them) cost no fill kernel
    (``runtime.empty``); the gradients agree with eager mode to the bound of
    test_compiled_step_matches_eager."""
    from torch._inductor.utils import run_and_get_code
    model = mlp(device, d=1024)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16)
    _, code = run_and_get_code(step_both, compiled, model, ref, x)
    code = "\n".join(code)
    assert "nvfp4_recipe." not in code
    for kernel in ("_quantize_1d_kernel", "_quantize_2d_kernel", "_amax_kernel", "_gemm_kernel"):
        assert kernel in code, kernel
    fills = [name for name in _inductor_kernels(code) if "empty" in name]
    assert not fills, fills
    for a, b in zip(grads(model), grads(ref)):
        assert float((a - b).norm() / b.norm()) < 2e-3


def _inductor_kernels(code: str) -> dict:
    """{name: source} of the Triton kernels Inductor generated, from its output code."""
    return dict(re.findall(r"async_compile\.triton\('(\w+)', '''(.*?)'''", code, re.DOTALL))


def test_inductor_stores_the_layers_input_once(device):
    """The input of an NVFP4Linear is a reshape of a fused elementwise result (RMSNorm, GELU),
    read by the amax pass and the quantize pair. Inductor must store that result once, as before
    a bf16 matmul: it gave every kernel argument reading such a reshape a copy of its own (the
    GELU kernel wrote 5, the RMSNorm kernel 6 outputs) until the layer's operators passed their
    input as an ``as_strided`` view (backends/operators._stored)."""
    from torch._inductor.utils import run_and_get_code

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.RMSNorm(d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))

    torch.manual_seed(0)
    model = quantize_(Block(256).to(device), NVFP4Recipe())
    x = torch.randn(4, 128, 256, device=device, requires_grad=True)
    step = lambda: torch.compile(model)(x).square().mean().backward()
    _, code = run_and_get_code(step)
    kernels = _inductor_kernels("\n".join(code))
    forward = {name: src for name, src in kernels.items()
               if ("gelu" in name or "rms_norm" in name) and "backward" not in name}
    assert any("gelu" in name for name in forward) and any("rms_norm" in name for name in forward)
    for name, src in forward.items():
        # GELU: its result; RMSNorm: its result and the saved 1/rms
        assert src.count("tl.store(") == (1 if "gelu" in name else 2), (name, src)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_compiled_layer_on_a_view_with_a_storage_offset(device):
    """The layer's operators take x and dY as ``as_strided`` views of their storage while tracing
    (backends/operators._stored): an input that starts inside its storage (a slice along the batch) and its
    gradient give the eager bits under aot_eager and the eager result within the bound of
    test_compiled_step_matches_eager under Inductor."""
    torch.manual_seed(3)
    layer = quantize_(nn.Sequential(nn.Linear(256, 512)).to(device), NVFP4Recipe())
    ref = copy.deepcopy(layer)
    big = torch.randn(5, 128, 256, device=device)
    for backend in ("aot_eager", "inductor"):
        outs = []
        for model in (torch.compile(layer, backend=backend), ref):
            x = big[1:].detach().requires_grad_()  # storage offset 128 * 256
            y = model(x)
            y.square().mean().backward()
            outs.append((y.detach(), x.grad))
        (y, gx), (y_ref, gx_ref) = outs
        if backend == "aot_eager":
            assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
        else:
            assert float((y - y_ref).norm() / y_ref.norm()) < 2e-3
            assert float((gx - gx_ref).norm() / gx_ref.norm()) < 2e-3


def test_a_second_compile_loads_from_the_autograd_cache(device, tmp_path, monkeypatch):
    """As on the CPU (test_compile.py), with the Triton kernels traced into the graphs: with torch's
    opt-in for autograd Functions, a second compile of the model loads AOTAutograd's result from
    the cache instead of tracing the layers (and analysing their kernels) again."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert_second_compile_hits_the_cache(mlp(device),
                                         torch.randn(64, 256, device=device, dtype=torch.bfloat16))
