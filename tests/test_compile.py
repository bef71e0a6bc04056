"""torch.compile of quantized models on the CPU: Dynamo traces the layers' algorithm with no graph
break (the backend primitives are registered operators, ``backends/operators.py``), and Inductor
trains them with eager's results: the same quantized operands, so the gradients differ only by the
order of Inductor's fp32 sums around them (a few ulps; the bound below is 1e-5 of the largest).
Models on the Triton backend run on ``kernel_device``: the interpreter on CPU tensors (opaque
operators), or the GPU (their kernels traced into the graph)."""

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

import nvfp4_recipe as nr
from nvfp4_cases import backend_device, interpreter_only
from test_moe import MoELayer, tiny_qwen3_moe

TOL = 1e-5


class TitanMoE(nn.Module):
    """torchtitan's MoE block reduced to what reaches the experts: top-1 routing, tokens sorted by
    expert, counts computed on the device (no host sync), the shared experts added. Two blocks of
    hidden features: the interpreted grouped kernels' time grows with their grid."""

    def __init__(self):
        super().__init__()
        self.moe = MoELayer(hidden_dim=32)

    def forward(self, x):
        n_experts = self.moe.experts.num_experts
        ids, perm = torch.sort(self.moe.router.gate(x).argmax(-1), stable=True)
        counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, ids, torch.ones_like(ids))
        y = self.moe.experts(x[perm], counts)
        return torch.zeros_like(y).index_copy(0, perm, y) + self.moe.shared_experts(x)


# Each model and its input on ``backend_device(backend)`` (the Triton backend's on kernel_device).
def dense(backend, **fields):
    torch.manual_seed(0)
    dev = backend_device(backend)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(dev)
    model = nr.quantize_(model, nr.NVFP4Recipe(backend=backend, **fields))
    return model, torch.randn(48, 32).to(dev)


def titan_moe(backend, **fields):
    torch.manual_seed(0)
    dev = backend_device(backend)
    model = nr.quantize_(TitanMoE().to(dev), nr.NVFP4Recipe(backend=backend, **fields))
    return model, torch.randn(32, 32).to(dev)


def hf_moe(backend):
    dev = backend_device(backend)
    model = nr.quantize_(tiny_qwen3_moe().to(dev), nr.NVFP4Recipe(backend=backend))
    return model, torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(dev)


def loss_of(model, x):
    out = model(x)
    return (out.logits if hasattr(out, "logits") else out).float().square().mean()


def nvfp4_modules(model):
    return [m for m in model.modules() if isinstance(m, nr.layer.NVFP4Module)]


MODELS = {"dense": dense, "titan_moe": titan_moe, "hf_moe": hf_moe}


def one_flipped_code(off: torch.Tensor) -> bool:
    """Whether the gradient elements outside TOL (``off``, a bool mask) are those one flipped code
    can move: Inductor reorders the fp32 sums of the high-precision ops (norms, softmax, the
    router), so a value on an E2M1 or E4M3 rounding boundary may quantize to the neighbouring code,
    which changes one row or one column of one (expert's) weight gradient by a quantization step.
    Vectors (norm weights, biases) get no such allowance."""
    idx = off.nonzero()
    if len(idx) == 0:
        return True
    if off.dim() < 2:
        return False
    one = lambda cols: bool((idx[:, cols] == idx[0, cols]).all())
    lead = list(range(off.dim() - 2))
    return one(lead + [off.dim() - 2]) or one(lead + [off.dim() - 1])


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name", list(MODELS))
def test_no_graph_breaks(name, backend):
    """``torch._dynamo.explain``: one graph, no break, for a dense model, torchtitan-style
    experts and a Hugging Face MoE (the Triton backend on ``kernel_device``); and no warning from
    Dynamo about the package's code (e.g. a traced ``lru_cache``)."""
    model, x = MODELS[name](backend)
    assert nvfp4_modules(model)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(model)(x)
    ours = [str(w.message) for w in caught if "nvfp4_recipe" in str(w.message)]
    assert not ours, ours
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def check_inductor_trains_as_eager(model, x):
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, eager)]
    for _ in range(2):
        losses = []
        for m, opt in zip((compiled, eager), opts):
            opt.zero_grad()
            loss = loss_of(m, x)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.allclose(losses[0], losses[1], rtol=TOL)
        for p, q in zip(model.parameters(), eager.parameters()):
            if q.grad is not None:
                off = (p.grad - q.grad).abs() > TOL * q.grad.abs().max()
                assert one_flipped_code(off), off.nonzero()[:5]
    for a, b in zip(nvfp4_modules(model), nvfp4_modules(eager)):
        assert torch.equal(a.sr_step, b.sr_step) and int(b.sr_step.min()) == 2


@pytest.mark.parametrize("name", list(MODELS))
def test_inductor_trains_as_eager(name):
    """Two training steps (AdamW) compiled with Inductor and in eager mode from the same state:
    equal losses and gradients up to the fp32 sum order (and the row or column of a weight
    gradient a code flipped by it moves, :func:`one_flipped_code`), the SR streams advanced
    alike."""
    check_inductor_trains_as_eager(*MODELS[name]("reference"))


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_inductor_trains_as_eager(name, device):
    """On a GPU (the Triton backend: its quantize kernels traced into Inductor's graph, the
    grouped GEMM an opaque operator), with no graph break, training as in eager mode."""
    model, x = MODELS[name]("auto")
    model, x = model.to(device), x.to(device)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    check_inductor_trains_as_eager(model, x)


@pytest.mark.parametrize("fields", [
    dict(four_over_six="all", four_over_six_error="mse", four_over_six_fast_math=True),
    dict(scaling="per_token", amax_estimation=(2.0, 1.0)),
    dict(backward_override="dequantized"), dict(forward_override="high_precision")],
    ids=["4over6", "per_token", "bwd_dequantized", "fwd_high_precision"])
@pytest.mark.parametrize("name", ["dense", "titan_moe"])
def test_every_recipe_field_crosses_the_compile_boundary(name, fields):
    """Compiled (aot_eager: the traced graph, no Inductor sums) forward and backward equal eager's
    bit for bit under recipes whose fields reach the kernels through the operators' specs."""
    check_traced_as_eager(*MODELS[name]("triton", **fields), contextlib.nullcontext)


@pytest.mark.parametrize("name, fields", [
    ("dense", {}), ("dense", dict(backward_override="dequantized")),
    ("dense", dict(forward_override="high_precision")),
    ("titan_moe", dict(forward_override="high_precision"))],
    ids=["dense", "dense-bwd_dequantized", "dense-fwd_high_precision", "titan_moe-fwd_high_precision"])
def test_compiled_under_autocast_as_eager(name, fields):
    """Under bf16 autocast the traced layers switch nothing (the graph must stay cacheable) and
    still compute as eager, which switches autocast off around its GEMMs: the same outputs and
    gradients bit for bit, high-precision GEMMs included."""
    device_type = backend_device("triton").type
    check_traced_as_eager(*MODELS[name]("triton", **fields),
                          lambda: torch.autocast(device_type, torch.bfloat16))


def check_traced_as_eager(model, x, context):
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for m in (compiled, eager):
        with context():
            loss_of(m, x).backward()
    with context():
        assert torch.equal(compiled(x), eager(x))
    for p, q in zip(model.parameters(), eager.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


@interpreter_only("test_compile_cuda.py::test_a_second_compile_loads_from_the_autograd_cache is "
                  "this test on the GPU")
def test_a_second_compile_loads_from_the_autograd_cache(tmp_path, monkeypatch):
    """With torch's opt-in for custom autograd Functions
    (``TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=1``), compiling the model again (a new
    process, here after ``torch._dynamo.reset``) loads AOTAutograd's result from its cache rather
    than tracing the layers again: their graphs hold nothing the cache refuses, such as an
    autocast switch, also under autocast."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert_second_compile_hits_the_cache(*dense("triton"))


def assert_second_compile_hits_the_cache(model, x):
    """Compile ``model`` twice (``torch._dynamo.reset`` between) under bf16 autocast with torch's
    opt-in for autograd Functions in AOTAutograd's cache; the second compile must load from it."""
    counters = torch._dynamo.utils.counters
    with torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=True):
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            with torch.autocast(x.device.type, torch.bfloat16):
                loss_of(torch.compile(model, fullgraph=True), x).backward()
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])
