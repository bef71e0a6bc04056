"""NVFP4Linear against a float64 emulation of the recipe, training, checkpoints and torch.compile."""

import copy
import dataclasses
from unittest import mock

import pytest
import torch
from torch import nn

import nvfp4_recipe as nr
from nvfp4_recipe import NVFP4Linear, NVFP4Recipe, dequantize_, quantize_
from nvfp4_recipe import gemms, quantizers
from nvfp4_recipe import reference as R
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.recipe import SR_OFFSETS
from nvfp4_recipe.spec import Block, GemmRole, QuantSpec

from nvfp4_cases import backend_device

RECIPES = {
    "default": NVFP4Recipe(),
    "per_token": NVFP4Recipe(scaling="per_token"),
    "1d_no_rht_no_sr": NVFP4Recipe(weight_2d=False, rht=False, stochastic_rounding=False),
    "amax_est": NVFP4Recipe(amax_estimation=(2.0, 1.0)),
}


def emulate(layer: NVFP4Linear, x: torch.Tensor, dy: torch.Tensor, step: int):
    """The recipe table of docs/recipe.md evaluated with reference quantization and float64 GEMMs."""
    r = layer.recipe
    seed = int(layer.sr_seed) + (step << 32)
    signs = layer.rht_signs
    x2, dy2, w = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), layer.weight.detach()

    def q(t, role, offset=0):
        spec = r.spec(role)
        amax_ = None
        if spec.amax_scale is not None:  # the estimate: amax_scale times the amax before the RHT
            amax_ = spec.amax_scale * R.amax(t, spec.scaling)
        d = R.quantize(t, spec, seed=seed, offset=offset, rht_signs=signs, amax_=amax_)
        return R.dequantize(d).double()

    wq = q(w, GemmRole.W_FPROP)
    wtq = wq.t() if r.weight_2d else q(w.t(), GemmRole.W_FPROP)
    y = q(x2, GemmRole.X_FPROP) @ wq.t() + layer.bias.double()
    dx = q(dy2, GemmRole.DY_DGRAD, SR_OFFSETS[GemmRole.DY_DGRAD]) @ wtq.t()
    dw = (q(dy2.t(), GemmRole.DY_WGRAD, SR_OFFSETS[GemmRole.DY_WGRAD])
          @ q(x2.t(), GemmRole.X_WGRAD).t())
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_backward_match_float64_emulation(name):
    """Operands are identical (same quantization, same SR bits); only the GEMM accumulation differs
    (fp32 vs fp64), so the relative error is at the fp32 level, far below NVFP4's ~1e-1."""
    torch.manual_seed(0)
    layer = NVFP4Linear(64, 48, recipe=RECIPES[name], layer_seed=3)
    x = torch.randn(2, 32, 64, requires_grad=True)
    dy = torch.randn(2, 32, 48)
    y = layer(x)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = emulate(layer, x.detach(), dy, step=0)
    assert rel(y, y_ref) < 1e-6
    assert rel(x.grad, dx_ref) < 1e-6
    assert rel(layer.weight.grad, dw_ref) < 1e-6
    assert torch.allclose(layer.bias.grad, dy.sum((0, 1)))


def test_sr_step_advances_and_changes_gradients():
    torch.manual_seed(0)
    layer = NVFP4Linear(64, 32)
    x, dy = torch.randn(32, 64), torch.randn(32, 32)
    grads = []
    for _ in range(2):
        layer.weight.grad = None
        layer(x).backward(dy)
        grads.append(layer.weight.grad.clone())
    assert int(layer.sr_step) == 2
    assert not torch.equal(grads[0], grads[1])
    with torch.no_grad():
        layer(x)
    assert int(layer.sr_step) == 2


def check_layer_twice_before_backward(device):
    """One layer run twice in one graph (shared weights, a loop over the layer) and one backward:
    each of its two backwards draws its own SR stream from sr_step as it is then (the later call's
    backward runs first, with step 0) and advances it; the counters are no saved tensors whose
    version check would refuse the first advance."""
    torch.manual_seed(5)
    layer = NVFP4Linear(64, 48, layer_seed=2).to(device)
    x1, x2 = (torch.randn(32, 64, device=device, requires_grad=True) for _ in range(2))
    dy1, dy2 = torch.randn(32, 48, device=device), torch.randn(32, 48, device=device)
    torch.autograd.backward([layer(x1), layer(x2)], [dy1, dy2])
    assert int(layer.sr_step) == 2
    cpu = layer.cpu()
    _, dx2, dw2 = emulate(cpu, x2.detach().cpu(), dy2.cpu(), step=0)
    _, dx1, dw1 = emulate(cpu, x1.detach().cpu(), dy1.cpu(), step=1)
    assert rel(x1.grad.cpu(), dx1) < 1e-6 and rel(x2.grad.cpu(), dx2) < 1e-6
    assert rel(layer.weight.grad.cpu(), dw1 + dw2) < 1e-6


def test_layer_twice_before_one_backward():
    check_layer_twice_before_backward("cpu")


@pytest.mark.cuda
def test_cuda_layer_twice_before_one_backward(device):
    check_layer_twice_before_backward(device)


def check_next_sr_key(draw, device):
    """``draw(seed, step, rank)`` returns sr_key's value of the counters before the call and
    advances the step by one, for random 32-bit seeds and steps up to 2**31 (whose << 32 wraps
    int64 as torch's does)."""
    gen = torch.Generator().manual_seed(11)
    for rank in (0, 3):
        seed = torch.randint(0, 2**32, (), generator=gen, dtype=torch.int64).to(device)
        step = torch.randint(0, 2**31, (), generator=gen, dtype=torch.int64).to(device)
        before = int(step)
        want = int(nr.layer.sr_key(seed, step.clone(), rank))
        assert int(draw(seed, step, rank)) == want
        assert int(step) == before + 1


def test_next_sr_key_kernel_matches_torch_ops(kernel_device):
    """The one-launch key kernel (run by the interpreter on CPU tensors, compiled on a GPU
    machine) against sr_key."""
    from nvfp4_recipe.kernels.philox import next_key
    check_next_sr_key(next_key, kernel_device)
    check_next_sr_key(nr.layer.next_sr_key, "cpu")  # the torch-op path off CUDA


@pytest.mark.cuda
def test_cuda_next_sr_key(device):
    check_next_sr_key(nr.layer.next_sr_key, device)


def test_errors():
    with pytest.raises(ValueError, match="in_features"):
        NVFP4Linear(40, 32)
    layer = NVFP4Linear(32, 32)
    with pytest.raises(ValueError, match="tokens"):
        layer(torch.randn(10, 32, requires_grad=True))
    with pytest.raises(ValueError, match="expects input"):
        layer(torch.randn(16, 48))


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def test_training_loop_reduces_loss():
    torch.manual_seed(0)
    teacher = mlp()
    model = quantize_(mlp(), NVFP4Recipe())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        x = torch.randn(64, 32)
        with torch.no_grad():
            target = teacher(x)
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10


def test_checkpoint_round_trips_between_nvfp4_and_plain_models():
    torch.manual_seed(0)
    plain = mlp()
    fp4 = quantize_(copy.deepcopy(plain), NVFP4Recipe(seed=7))
    fp4[0](torch.randn(16, 32, requires_grad=True)).sum().backward()  # advance one SR step
    sd = fp4.state_dict()
    assert set(sd) == set(plain.state_dict()) | {f"{i}.{b}" for i in (0, 2, 4)
                                                 for b in ("rht_signs", "sr_seed", "sr_step")}
    # NVFP4 -> NVFP4: weights and SR state restored
    other = quantize_(mlp(), NVFP4Recipe(seed=7))
    other.load_state_dict(sd)
    assert int(other[0].sr_step) == 1 and torch.equal(other[0].weight, fp4[0].weight)
    # NVFP4 -> nn.Linear: the recipe buffers are the only extra keys
    result = plain.load_state_dict(sd, strict=False)
    assert result.missing_keys == [] and all(k.split(".")[1] in ("rht_signs", "sr_seed", "sr_step")
                                             for k in result.unexpected_keys)
    # nn.Linear -> NVFP4 loads strictly
    fresh = quantize_(mlp(), NVFP4Recipe())
    fresh.load_state_dict(mlp().state_dict())
    back = dequantize_(copy.deepcopy(fp4))
    assert type(back[0]) is nn.Linear and torch.equal(back[0].weight, fp4[0].weight)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_backward(backend):
    torch.manual_seed(0)
    model = quantize_(mlp(), NVFP4Recipe())
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(32, 32)
    compiled(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert int(model[0].sr_step) == 1


@pytest.mark.parametrize("name", ["default", "per_token"])
def test_triton_backend_matches_reference(name, kernel_device):
    """The Triton kernels (under the interpreter on CPU; compiled on a GPU machine, both layers on
    the GPU) against the reference backend: the same quantized operands, so only the fp32
    accumulation order of the GEMMs may differ."""
    torch.manual_seed(0)
    ref = NVFP4Linear(64, 32, recipe=RECIPES[name]).to(kernel_device)
    tri = copy.deepcopy(ref)
    tri.recipe = dataclasses.replace(RECIPES[name], backend="triton")
    x = torch.randn(2, 16, 64).to(kernel_device)
    dy = torch.randn(2, 16, 32).to(kernel_device)
    out = []
    for layer in (ref, tri):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        out.append((y.detach(), xi.grad, layer.weight.grad))
    for a, b in zip(*out):
        assert rel(b, a.double()) < 1e-6


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(RECIPES))
def test_gpu_triton_layer_matches_reference_backend(name, device):
    """On the GPU the Triton backend writes X, dY and dY^T as inner values for their GEMMs: the
    same operands as the reference backend's quantize-then-dequantize, so the outputs and
    gradients differ by the fp32 accumulation order only (K up to 1024 here: ~1e-6 relative)."""
    torch.manual_seed(0)
    ref = NVFP4Linear(1024, 768, recipe=RECIPES[name], device=device)
    tri = copy.deepcopy(ref)
    ref.recipe = dataclasses.replace(RECIPES[name], backend="reference")
    tri.recipe = dataclasses.replace(RECIPES[name], backend="triton")
    x = torch.randn(4, 256, 1024, device=device)  # fp32 outputs: no bf16 rounding of the difference
    dy = torch.randn(4, 256, 768, device=device)
    out = []
    for layer in (ref, tri):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        out.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*out):
        assert rel(b, a.double()) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_eager_calls_equal_the_registered_operators(backend):
    """In eager mode a backend primitive runs its Python directly (an operator's dispatch costs
    host time); the registered operators that torch.compile calls instead
    (``backends/operators.py``) must return the same bits, through the layer's whole algorithm."""
    torch.manual_seed(0)
    r = NVFP4Recipe(backend=backend)
    dev = backend_device(backend)
    be = get_backend(backend, dev)
    x, w, dy = (t.to(dev) for t in (torch.randn(32, 64), torch.randn(48, 64), torch.randn(32, 48)))
    seed, signs = torch.tensor(7 + (3 << 32), device=dev), r.signs().to(dev)

    def fprop(usage):
        q = quantizers.build(r, signs, usage)
        return gemms.fprop(gemms.Dense(), be, x, w, None, q, torch.float32)

    def run(compiling: bool):
        with mock.patch.object(torch.compiler, "is_compiling", lambda: compiling):
            y, wt, xt, _ = fprop(quantizers.Usage(True, True))
            y_eval, no_wt, no_xt, _ = fprop(quantizers.FPROP_ONLY)
            assert no_wt is None and no_xt is None and torch.equal(y_eval, y)
            q = quantizers.build(r, signs, quantizers.Usage(True, True), None, dy.shape, seed)
            grads = gemms.grads(gemms.Dense(), be, dy, wt, xt, q, torch.float32, torch.float32)
        return [y, y_eval, *wt[:3], *xt[:3], *grads], (wt.block, xt.block)

    (direct, blocks), (via_ops, op_blocks) = run(False), run(True)
    assert blocks == op_blocks == (Block.D2, Block.D1)
    assert len(direct) == len(via_ops) == 10
    for a, b in zip(direct, via_ops):
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)


def _record_fprop_calls(monkeypatch):
    """Records (tokens, W^T made, X^T made) of every ``gemms.fprop`` call of NVFP4Linear."""
    from nvfp4_recipe import gemms
    calls, fprop = [], gemms.fprop

    def spy(layout, be, x, w, bias, q, *args):
        calls.append((x.shape[0], q.w.columnwise is not None, q.x.columnwise is not None))
        return fprop(layout, be, x, w, bias, q, *args)

    monkeypatch.setattr(gemms, "fprop", spy)
    return calls


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_inference_runs_fprop_only_for_any_token_count(monkeypatch, mode):
    """Without a gradient to compute the layer quantizes neither X^T nor W^T, takes any token
    count, and computes the fprop of the recipe: Q(X) @ Q(W)^T + b."""
    torch.manual_seed(0)
    layer = NVFP4Linear(64, 48)
    x = torch.randn(3, 7, 64)  # 21 tokens
    w, b = layer.weight.detach(), layer.bias.detach()
    expect = R.scaled_mm(R.quantize(x.reshape(21, 64)), R.quantize(w, QuantSpec(Block.D2)),
                         bias=b).reshape(3, 7, 48)
    calls = _record_fprop_calls(monkeypatch)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
    if mode == "frozen":
        layer.requires_grad_(False)
    with context() if context else torch.enable_grad():
        y = layer(x)
        y1 = layer(x[0, :1])  # one token, as in generation
    assert torch.equal(y, expect) and not y.requires_grad
    assert y1.shape == (1, 48)
    assert calls == [(21, False, False), (1, False, False)]
    assert int(layer.sr_step) == 0


def test_training_still_needs_whole_blocks_of_tokens():
    layer = NVFP4Linear(32, 32)
    with pytest.raises(ValueError, match="multiple of 16, got 10.*pad_to_multiple_of=16.*torch.no_grad"):
        layer(torch.randn(10, 32, requires_grad=True))


@pytest.mark.parametrize("inplace_op", ["relu", "iadd", "dropout"])
def test_inplace_ops_on_the_output_match_out_of_place(inplace_op):
    """The layer's output is not a view made inside its autograd Function, so in-place ops on it
    work as on nn.Linear's, with the gradients of the out-of-place ops."""
    torch.manual_seed(0)
    ops_ = {"relu": (lambda h, x: nn.functional.relu(h, inplace=True), lambda h, x: nn.functional.relu(h)),
            "iadd": (lambda h, x: h.add_(x), lambda h, x: h + x),
            "dropout": (lambda h, x: nn.functional.dropout(h, 0.5, True, inplace=True),
                        lambda h, x: nn.functional.dropout(h, 0.5, True))}[inplace_op]
    layer = NVFP4Linear(64, 64)
    x0, dy = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    results = []
    for op in ops_:
        fc = copy.deepcopy(layer)
        x = x0.clone().requires_grad_()
        torch.manual_seed(1)  # the same dropout mask
        out = op(fc(x), x)
        out.backward(dy)
        results.append((out.detach(), x.grad, fc.weight.grad, fc.bias.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[0][0].ne(0).any() and results[0][2].ne(0).any()


def test_empty_input_gives_an_empty_output_and_zero_weight_gradient():
    layer = NVFP4Linear(32, 48)
    x = torch.randn(0, 5, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 5, 48)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(layer.weight.grad, torch.zeros(48, 32))
    with torch.no_grad():
        assert layer(torch.randn(0, 32)).shape == (0, 48)
    with pytest.raises(ValueError, match="positive multiple of 16"):
        NVFP4Linear(0, 16)


def _sr_rht_mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _train_steps(model, steps=3):
    """A few AdamW steps on fixed random data; returns the losses and the final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 32, generator=g)
        loss = (model(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def test_meta_device_init_matches_a_model_built_on_the_cpu():
    """Build on the meta device, quantize_, to_empty, reset_parameters (the large-model / FSDP2
    flow): the recipe buffers and then training equal those of a model built on the CPU."""
    recipe = NVFP4Recipe(seed=3)
    torch.manual_seed(0)
    cpu = quantize_(_sr_rht_mlp(), recipe)
    with torch.device("meta"):
        meta = _sr_rht_mlp()
    quantize_(meta, recipe)
    meta.to_empty(device="cpu")
    for name in ("rht_signs", "sr_seed", "sr_step"):  # set by to_empty alone
        for i in (0, 2):
            assert torch.equal(getattr(meta[i], name), getattr(cpu[i], name)), name
    torch.manual_seed(0)
    for m in meta.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    for p, q in zip(meta.parameters(), cpu.parameters()):
        assert torch.equal(p, q)
    losses_meta, params_meta = _train_steps(meta)
    losses_cpu, params_cpu = _train_steps(cpu)
    assert torch.equal(losses_meta, losses_cpu)
    for p, q in zip(params_meta, params_cpu):
        assert torch.equal(p, q)
    assert int(meta[0].sr_step) == 3


def test_recipe_buffers_reset_and_survive_moves_and_loads():
    torch.manual_seed(0)
    layer = NVFP4Linear(32, 32, recipe=NVFP4Recipe(seed=9), layer_seed=4)
    fresh = {k: v.clone() for k, v in layer.state_dict().items() if k in ("rht_signs", "sr_seed", "sr_step")}
    assert int(fresh["sr_seed"]) == 13
    layer(torch.randn(16, 32, requires_grad=True)).sum().backward()
    sd = copy.deepcopy(layer.state_dict())
    assert int(sd["sr_step"]) == 1
    layer.to("cpu", torch.float32)  # a move between real devices keeps the state
    assert int(layer.sr_step) == 1
    layer.reset_parameters()
    for k, v in fresh.items():
        assert torch.equal(getattr(layer, k), v)
    with torch.device("meta"):
        other = NVFP4Linear(32, 32, recipe=NVFP4Recipe(seed=9), layer_seed=4)
    other.to_empty(device="cpu")
    other.load_state_dict(sd)  # a checkpoint overrides the recipe's values
    assert int(other.sr_step) == 1 and torch.equal(other.weight, sd["weight"])


def test_layer_hands_out_the_operands_it_used():
    """``quantized_weight()`` is W as fprop quantizes it, and ``capture`` records X, X^T, dY and
    dY^T of the last step as NVFP4Tensors holding the very bits the GEMMs used: the layer's output
    and gradients are reproduced from them alone."""
    torch.manual_seed(0)
    model = quantize_(nn.Sequential(nn.Linear(64, 48)), NVFP4Recipe())
    layer = model[0]
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 48)
    with nr.capture(model) as ops:
        y = model(x)
        y.backward(dy)
    got = ops["0"]
    assert set(got) == {"w", "x", "xt", "dy", "dyt"} and layer.captured is None
    w = layer.quantized_weight()
    assert isinstance(w, nr.NVFP4Tensor) and w.block == "2d" and torch.equal(w.qdata, got["w"].qdata)
    assert torch.allclose(y, torch.nn.functional.linear(got["x"], got["w"], layer.bias), rtol=1e-6, atol=1e-6)
    assert got["dy"].rounding == "sr" and got["xt"].rht_signs is not None
    dx = got["dy"].dequantize(torch.float64) @ got["w"].dequantize(torch.float64)
    dw = got["dyt"].dequantize(torch.float64) @ got["xt"].dequantize(torch.float64).t()
    assert rel(x.grad, dx) < 1e-6 and rel(layer.weight.grad, dw) < 1e-6


def _spy_weight_quantizations(monkeypatch, layer: NVFP4Linear) -> list:
    """A list that grows by one on every quantization of ``layer``'s fprop weight."""
    from nvfp4_recipe.backends import get_backend
    be = get_backend(layer.recipe.backend, layer.weight.device)
    calls, real = [], be.prepare_weight
    monkeypatch.setattr(type(be), "prepare_weight",
                        lambda self, w, *a, **k: (calls.append(1), real(w, *a, **k))[1])
    return calls


def check_cached_weights(monkeypatch, backend: str, device: str, dtype=torch.float32):
    """Inside cached_weights() forwards without autograd quantize W once per weight version: an
    in-place update (an optimizer step) or another weight tensor is seen and quantized again. The
    outputs equal uncached forwards bit for bit; the cache is dropped when the context exits, and
    training forwards inside it do not use it."""
    torch.manual_seed(0)
    layer = NVFP4Linear(64, 48, recipe=NVFP4Recipe(backend=backend), device=device, dtype=dtype)
    x = torch.randn(5, 64, device=device, dtype=dtype)
    with torch.no_grad():
        uncached = layer(x)
    calls = _spy_weight_quantizations(monkeypatch, layer)
    with nr.cached_weights():
        with torch.no_grad():
            assert torch.equal(layer(x), uncached) and torch.equal(layer(x), uncached)
        assert len(calls) == 1
        layer(torch.randn(16, 64, device=device, dtype=dtype)).sum().backward()  # training
        assert len(calls) == 2
        torch.optim.SGD(layer.parameters(), lr=0.1).step()  # an in-place update of the weight
        with torch.no_grad():
            updated = layer(x)
        assert len(calls) == 3 and not torch.equal(updated, uncached)
        layer.weight = nn.Parameter(layer.weight.detach().clone())  # another tensor
        with torch.no_grad():
            assert torch.equal(layer(x), updated)
        assert len(calls) == 4
    assert layer._weight_cache == {}
    with torch.no_grad():
        assert torch.equal(layer(x), updated)
    assert len(calls) == 5  # outside the context: quantized on every call


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cached_weights_quantize_once_and_give_the_same_outputs(monkeypatch, backend):
    check_cached_weights(monkeypatch, backend, backend_device(backend))


@pytest.mark.cuda
def test_cuda_cached_weights(monkeypatch, device):
    """On the GPU the cache holds W's fp16 inner values (what the fprop GEMM reads)."""
    check_cached_weights(monkeypatch, "triton", device, torch.bfloat16)


def test_cached_weights_are_per_context_and_not_under_compile(monkeypatch):
    """Nested contexts: a weight cached in the outer one serves the inner one and stays; a weight
    first cached in the inner one is dropped at its exit. torch.compile traces the uncached
    forward (its graph quantizes W itself) and gives the eager result."""
    torch.manual_seed(1)
    outer, inner = NVFP4Linear(32, 32), NVFP4Linear(32, 32)
    x = torch.randn(16, 32)
    calls = _spy_weight_quantizations(monkeypatch, outer)  # the backend's calls, both layers
    with torch.no_grad(), nr.cached_weights():
        want = outer(x)
        with nr.cached_weights():
            outer(x), inner(x)
        assert len(calls) == 2
        assert outer._weight_cache and not inner._weight_cache
        got = torch.compile(inner, backend="aot_eager", fullgraph=True)(x)
        assert not inner._weight_cache  # a compiled forward does not cache
        assert torch.equal(got, inner(x)) and torch.equal(outer(x), want)
    assert outer._weight_cache == inner._weight_cache == {}


def test_input_and_bias_dtypes_follow_nn_linear():
    """Outside autocast nn.Linear refuses an input or a bias of another dtype than the weight's,
    and so does NVFP4Linear, with nn.Linear's words; under autocast it takes them and returns
    the autocast dtype (the fp32 result, rounded)."""
    torch.manual_seed(0)
    layer = NVFP4Linear(32, 48)
    x = torch.randn(16, 32)
    for bad in (x.bfloat16(), x.double()):
        with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
            nn.Linear(32, 48)(bad)
        with pytest.raises(RuntimeError, match=f"mat1 and mat2 must have the same dtype, but got "
                                               f"{bad.dtype} and torch.float32"):
            layer(bad)
    with torch.autocast("cpu", torch.bfloat16):
        y = layer(x)
        assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert y.dtype == torch.bfloat16 and torch.equal(y, layer(x).bfloat16())
    layer.bias = nn.Parameter(torch.randn(48, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="the bias and the weight must have the same dtype, but "
                                           "got torch.float64 and torch.float32"):
        layer(x)


class Conv1D(nn.Module):
    """transformers' Conv1D as transformers defines it (GPT-2's projections: y = x @ W + b, W of
    shape (nx, nf)), without importing transformers."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx ** 0.5)
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("weight_2d", [True, False])
def test_conv1d_trains_as_nvfp4linear_on_its_transposed_weight(backend, weight_2d):
    """quantize_ makes a Conv1D an NVFP4Conv1D on the same (in, out) Parameter; its forward and
    backward, two steps (the SR stream advances), equal those of an NVFP4Linear holding W^T bit
    for bit: the transposed view quantizes as the contiguous W^T on both backends (the Triton
    backend on ``kernel_device``)."""
    recipe = NVFP4Recipe(backend=backend, weight_2d=weight_2d)
    dev = backend_device(backend)
    conv = Conv1D(48, 32).to(dev)
    layer = quantize_(nn.Sequential(conv), recipe)[0]
    assert type(layer) is nr.NVFP4Conv1D and layer.weight is conv.weight
    assert layer.weight.shape == (32, 48) and (layer.in_features, layer.out_features) == (32, 48)
    twin = NVFP4Linear(32, 48, recipe=recipe, layer_seed=layer.layer_seed, device=dev)
    with torch.no_grad():
        twin.weight.copy_(conv.weight.t())
        twin.bias.copy_(conv.bias)
    for _ in range(2):
        x, dy = torch.randn(2, 16, 32).to(dev), torch.randn(2, 16, 48).to(dev)
        got = []
        for m in (layer, twin):
            m.zero_grad()
            xi = x.clone().requires_grad_()
            y = m(xi)
            y.backward(dy)
            got.append((y, xi.grad, m.weight.grad, m.bias.grad))
        (y, dx, dw, db), (y2, dx2, dw2, db2) = got
        assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(db, db2)
        assert dw.shape == (32, 48) and torch.equal(dw, dw2.t())
        assert rel(y, conv(x).double()) < 0.2  # NVFP4's error, not another layout's
    assert torch.equal(layer.quantized_weight().qdata, twin.quantized_weight().qdata)


def test_conv1d_keeps_its_checkpoint_layout_caches_its_weight_and_comes_back(monkeypatch):
    """The state dict keeps the Conv1D's keys and (in, out) shapes (plus the recipe buffers);
    cached_weights quantizes the weight once per version; summary counts the layer; dequantize_
    gives back the Conv1D with the same Parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(64, 32))
    conv, weight = model[0], model[0].weight
    x = torch.randn(5, 32)
    quantize_(model)
    state = model.state_dict()
    assert state["0.weight"].shape == (32, 64)
    plain = nn.Sequential(Conv1D(64, 32))
    assert set(plain.load_state_dict(state, strict=False).unexpected_keys) == \
        {"0.rht_signs", "0.sr_seed", "0.sr_step"}
    assert torch.equal(plain[0].weight, weight)
    assert "1 of 1 linear layers in NVFP4" in nr.summary(model)
    assert "32 x 64" in nr.summary(model).splitlines()[2]
    with torch.no_grad():
        uncached = model(x)
    calls = _spy_weight_quantizations(monkeypatch, model[0])
    with torch.no_grad(), nr.cached_weights():
        assert torch.equal(model(x), uncached) and torch.equal(model(x), uncached)
    assert len(calls) == 1
    back = dequantize_(model)[0]
    assert back is conv and back.weight is weight and type(back) is Conv1D
