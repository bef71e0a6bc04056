"""backward_override and forward_override: the GEMMs a recipe takes out of NVFP4, for dense
layers and experts alike. "high_precision" backward: dX = dY W and dW = dY^T X from the
unquantized tensors; "dequantized": from the forward's NVFP4 X and W; forward_override: fprop
X W^T unquantized while the backward stays NVFP4, bit for bit the default recipe's. The Triton
backend runs on ``kernel_device`` (the interpreter on CPU tensors, or the GPU)."""

import pytest
import torch

import nvfp4_recipe as nr
from nvfp4_recipe import moe
from nvfp4_recipe import reference as R
from nvfp4_recipe.spec import GemmRole

from nvfp4_cases import assert_fp32_products, backend_device

BACKENDS = ["reference", "triton"]


def _layer(backend, **fields):
    torch.manual_seed(0)
    recipe = nr.NVFP4Recipe(backend=backend, **fields)
    return nr.NVFP4Linear(64, 48, recipe=recipe).to(backend_device(backend))


def _run(layer, x, dy):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _inputs(seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 64, generator=g).to(device), torch.randn(32, 48, generator=g).to(device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_high_precision_backward_uses_the_unquantized_x_and_w(backend):
    x, dy = _inputs(device=backend_device(backend))
    y, dx, dw, db = _run(_layer(backend, backward_override="high_precision"), x, dy)
    layer = _layer(backend)
    assert torch.equal(y, _run(layer, x, dy)[0])  # fprop stays NVFP4
    assert torch.equal(dx, dy @ layer.weight.detach())
    assert torch.equal(dw, dy.t() @ x)
    assert torch.equal(db, dy.sum(0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantized_backward_uses_the_forwards_nvfp4_operands(backend):
    x, dy = _inputs(2, backend_device(backend))
    layer = _layer(backend, backward_override="dequantized")
    with nr.capture(layer) as ops:
        _, dx, dw, _ = _run(layer, x, dy)
    xq, wq = ops[""]["x"].dequantize(torch.float32), ops[""]["w"].dequantize(torch.float32)
    assert not torch.equal(xq, x) and not torch.equal(wq, layer.weight.detach())
    assert torch.equal(dx, dy @ wq)
    assert torch.equal(dw, dy.t() @ xq)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_override_runs_fprop_unquantized_and_keeps_the_nvfp4_backward(backend):
    x, dy = _inputs(3, backend_device(backend))
    layer = _layer(backend, forward_override="high_precision")
    y, dx, dw, _ = _run(layer, x, dy)
    assert torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias).detach())
    _, dx_ref, dw_ref, _ = _run(_layer(backend), x, dy)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref)


def test_under_autocast_the_backward_runs_in_dys_precision_and_returns_the_inputs_dtypes():
    x, dy = _inputs(4)
    layer = _layer("reference", backward_override="high_precision")
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = layer(x)
    y.backward(dy.to(torch.bfloat16))
    w = layer.weight.detach()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(x.grad, (dy.bfloat16() @ w.bfloat16()).float())
    assert torch.equal(layer.weight.grad, (dy.bfloat16().t() @ x.detach().bfloat16()).float())


def test_an_overridden_backward_takes_any_token_count():
    """The 16-token rule comes from NVFP4 wgrad's blocks along the tokens."""
    layer = _layer("reference", backward_override="high_precision")
    x = torch.randn(5, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad.shape == (5, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        _layer("reference")(x).sum().backward()


def _grouped(backend, **fields):
    torch.manual_seed(0)
    dev = backend_device(backend)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(80, 32, generator=g).to(dev).requires_grad_()
    w = torch.randn(3, 48, 32, generator=g).to(dev).requires_grad_()
    # an empty group, 16 rows past the end
    offs = torch.tensor([16, 16, 64], dtype=torch.int32, device=dev)
    recipe = nr.NVFP4Recipe(backend=backend, **fields)
    seed, step = torch.tensor(7, device=dev), torch.tensor(0, device=dev)
    y = moe.grouped_linear(x, w, offs, recipe, recipe.signs().to(dev), seed, step)
    dy = torch.randn(y.shape, generator=g).to(dev)
    y.backward(dy)
    return x, w, offs, y.detach(), dy


def _per_group(offs, fn):
    bounds = [0] + offs.tolist()
    return [fn(g, s, e) for g, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_high_precision_backward(backend):
    x, w, offs, y, dy = _grouped(backend, backward_override="high_precision")
    W = w.detach()
    assert_fp32_products(x.grad, _per_group(offs, lambda g, s, e: (dy[s:e], W[g])))
    assert_fp32_products(w.grad.flatten(0, 1),
                         _per_group(offs, lambda g, s, e: (dy[s:e].t(), x.detach()[s:e])))
    assert torch.equal(y, _grouped(backend)[3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_dequantized_backward(backend):
    x, w, offs, _, dy = _grouped(backend, backward_override="dequantized")
    recipe = nr.NVFP4Recipe(backend="reference")
    wq = [R.dequantize(R.quantize(w.detach()[g], recipe.spec(GemmRole.W_FPROP))) for g in range(3)]
    xq = _per_group(offs, lambda g, s, e: R.dequantize(R.quantize(x.detach()[s:e], recipe.spec(
        GemmRole.X_FPROP))) if e > s else dy.new_zeros(0, 32))
    assert_fp32_products(x.grad, _per_group(offs, lambda g, s, e: (dy[s:e], wq[g])))
    assert_fp32_products(w.grad.flatten(0, 1), _per_group(offs, lambda g, s, e: (dy[s:e].t(), xq[g])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_forward_override(backend):
    x, w, offs, y, dy = _grouped(backend, forward_override="high_precision")
    W, X = w.detach(), x.detach()
    assert_fp32_products(y, _per_group(offs, lambda g, s, e: (X[s:e], W[g].t())))
    x_ref, w_ref, *_ = _grouped(backend)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(w.grad, w_ref.grad)


def test_bad_overrides_name_the_field():
    with pytest.raises(ValueError, match="backward_override: must be one of"):
        nr.NVFP4Recipe(backward_override="bf16")
    with pytest.raises(ValueError, match="forward_override: must be None or 'high_precision'"):
        nr.NVFP4Recipe(forward_override="dequantized")
    with pytest.raises(ValueError, match="backward_override: 'dequantized' needs the forward"):
        nr.NVFP4Recipe(forward_override="high_precision", backward_override="dequantized")


def test_grouped_high_precision_gemms_in_bf16_use_grouped_mm_and_agree_with_per_group_matmuls():
    from nvfp4_recipe import high_precision as HP
    g = torch.Generator().manual_seed(6)
    x, dy = torch.randn(80, 32, generator=g), torch.randn(80, 48, generator=g)
    w = torch.randn(3, 48, 32, generator=g)
    offs = torch.tensor([16, 16, 64], dtype=torch.int32)
    bf = lambda t: t.bfloat16()
    for fn, args in ((HP.fprop, (bf(x), bf(w), None, offs)), (HP.dgrad, (bf(dy), bf(w), offs)),
                     (HP.wgrad, (bf(dy), bf(x), offs))):
        got = fn(*args)
        want = fn(*[a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                    for a in args])  # fp32: one matmul per group
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert not HP.fprop(bf(x), bf(w), None, offs)[64:].any()  # rows past the last group


@pytest.mark.parametrize("fields,names", [
    ({}, {"w", "x", "xt", "dy", "dyt"}),
    (dict(backward_override="high_precision"), {"w", "x"}),
    (dict(backward_override="dequantized"), {"w", "x"}),
    (dict(forward_override="high_precision"), {"xt", "dy", "dyt"})])
def test_capture_records_the_operands_that_stay_in_nvfp4(fields, names):
    """capture (and QuantStats) record the operands of the NVFP4 GEMMs only, dense and experts."""
    x, dy = _inputs(7)
    layer = _layer("reference", **fields)
    with nr.capture(layer) as ops:
        _run(layer, x, dy)
    assert set(ops[""]) == names
    experts = moe.NVFP4GroupedExperts(32, 48, 3, nr.NVFP4Recipe(backend="reference", **fields))
    torch.nn.init.normal_(experts.w1), torch.nn.init.normal_(experts.w2), torch.nn.init.normal_(experts.w3)
    with nr.capture(experts) as ops:
        experts(torch.randn(48, 32), torch.tensor([16, 0, 32])).sum().backward()
    assert all(set(p) == names for p in ops[""].values()) and len(ops[""]) == 3
