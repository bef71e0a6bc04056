"""NVFP4Tensor: construction, the op table, repr, serialization and torch.compile."""

import io

import pytest
import torch

from nvfp4_recipe import NVFP4Tensor
from nvfp4_recipe import reference as R
from nvfp4_recipe.operand import NVFP4Operand
from nvfp4_recipe.spec import QuantSpec


def test_from_hp_fields_match_the_reference():
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    t = NVFP4Tensor.from_hp(x, scaling="per_token", rounding="sr", seed=5, offset=7)
    d = R.quantize(x, QuantSpec(scaling="per_token", rounding="sr"), seed=5, offset=7)
    assert t.shape == x.shape and t.dtype == torch.bfloat16
    assert t.qdata.dtype == torch.uint8 and t.qdata.shape == (2, 32, 32)
    assert t.scale.dtype == torch.float8_e4m3fn and t.scale.shape == (2, 32, 4)
    assert t.outer_scale.shape == (2, 32)
    assert torch.equal(t.qdata, d.qdata) and torch.equal(t.outer_scale, d.outer_scale)
    assert torch.equal(t.dequantize(torch.float32), R.dequantize(d))


def test_rht_tensor_keeps_its_signs():
    x = torch.randn(16, 64)
    t = NVFP4Tensor.from_hp(x, rht=True)
    assert t.rht_signs is not None
    assert torch.equal(t.dequantize(torch.float32), R.dequantize(R.quantize(x, QuantSpec(rht=True), rht_signs=t.rht_signs)))


def test_mm_addmm_linear_matmul_bmm():
    x, w, b = torch.randn(48, 64), torch.randn(32, 64), torch.randn(32)
    xq, wq = NVFP4Tensor.from_hp(x), NVFP4Tensor.from_hp(w, block="2d")
    expect = R.scaled_mm(xq.operand, wq.operand)
    assert torch.equal(torch.mm(xq, wq.t()), expect)
    assert torch.equal(torch.addmm(b, xq, wq.t()), expect + b)
    assert torch.equal(torch.nn.functional.linear(xq, wq, b), expect + b)
    x3 = NVFP4Tensor.from_hp(x.reshape(3, 16, 64))
    assert torch.equal(torch.matmul(x3, wq.t()), expect.reshape(3, 16, 32))
    a, c = NVFP4Tensor.from_hp(torch.randn(2, 16, 64)), NVFP4Tensor.from_hp(torch.randn(2, 32, 64))
    out = torch.bmm(a, c.transpose(1, 2))
    for i in range(2):
        ai = NVFP4Operand(a.qdata[i], a.scale[i], a.outer_scale)
        ci = NVFP4Operand(c.qdata[i], c.scale[i], c.outer_scale)
        assert torch.equal(out[i], R.scaled_mm(ai, ci))


def test_mm_errors():
    xq = NVFP4Tensor.from_hp(torch.randn(16, 64))
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        torch.mm(xq, torch.randn(64, 16))
    with pytest.raises(ValueError, match="wrong dimension"):
        torch.mm(xq, NVFP4Tensor.from_hp(torch.randn(64, 32)))  # B (K, N) blocked along N
    with pytest.raises(ValueError, match="RHT"):
        torch.mm(xq, NVFP4Tensor.from_hp(torch.randn(16, 64), rht=True).t())


def test_transpose_is_a_view_and_2d_transposes_exactly():
    w = torch.randn(32, 48)
    wq = NVFP4Tensor.from_hp(w, block="2d")
    wt = wq.t()
    assert wt.shape == (48, 32) and wt.qdata is wq.qdata
    assert torch.equal(wt.dequantize(), wq.dequantize().t())
    assert torch.equal(wq.transpose(0, 1).dequantize(), wt.dequantize())


def test_reshape_slice_detach_clone_to():
    x = torch.randn(4, 32, 64)
    t = NVFP4Tensor.from_hp(x, scaling="per_token")
    flat = t.reshape(128, 64)
    assert torch.equal(flat.dequantize(), t.dequantize().reshape(128, 64))
    assert torch.equal(flat[32:80].dequantize(), flat.dequantize()[32:80])
    w = NVFP4Tensor.from_hp(torch.randn(64, 32), block="2d")
    assert torch.equal(w[16:48].dequantize(), w.dequantize()[16:48])
    with pytest.raises(ValueError, match="multiples of 16"):
        w[8:24]
    for c in (t.detach(), t.clone()):
        assert isinstance(c, NVFP4Tensor) and torch.equal(c.dequantize(), t.dequantize())
    t32 = t.to(torch.float32)
    assert isinstance(t32, NVFP4Tensor) and t32.dtype == torch.float32 and t32.qdata is not None
    assert torch.equal(t32.dequantize(), t.dequantize(torch.float32))


def test_copy_():
    a = NVFP4Tensor.from_hp(torch.randn(16, 32))
    b = NVFP4Tensor.from_hp(torch.randn(16, 32))
    a.copy_(b)
    assert torch.equal(a.dequantize(), b.dequantize())


def test_unsupported_op_names_itself():
    t = NVFP4Tensor.from_hp(torch.randn(16, 32))
    with pytest.raises(NotImplementedError, match="sin"):
        torch.sin(t)


def test_repr_is_informative():
    t = NVFP4Tensor.from_hp(torch.randn(64, 128), scaling="per_token")
    text = repr(t)
    for word in ("shape=(64, 128)", "bfloat16" if t.dtype == torch.bfloat16 else "float32",
                 "1x16", "per_token", "rounding=rn", "outer_scale=per-token", "block_scale in",
                 "zero codes=", "values[0, :8]="):
        assert word in text


def test_save_load_round_trip():
    t = NVFP4Tensor.from_hp(torch.randn(32, 64), block="2d", rht=False)
    buf = io.BytesIO()
    torch.save({"t": t}, buf)
    buf.seek(0)
    u = torch.load(buf)["t"]
    assert isinstance(u, NVFP4Tensor) and u.block == "2d"
    assert torch.equal(u.qdata, t.qdata) and torch.equal(u.scale.view(torch.uint8), t.scale.view(torch.uint8))


def test_compiles_fullgraph():
    xq = NVFP4Tensor.from_hp(torch.randn(32, 64))
    wq = NVFP4Tensor.from_hp(torch.randn(16, 64), block="2d")

    def f(a, b):
        return torch.nn.functional.linear(a, b) * 2

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(xq, wq)
    assert torch.equal(out, f(xq, wq))


def test_from_hp_detaches_its_input():
    """An NVFP4Tensor carries no autograd history: no gradient reaches x through it, rather than
    one through the amax that reaches the block maxima only."""
    x = torch.randn(64, 16, requires_grad=True)
    t = NVFP4Tensor.from_hp(x)
    deq = t.dequantize()
    assert not t.requires_grad and not deq.requires_grad and deq.grad_fn is None
    assert torch.equal(deq, NVFP4Tensor.from_hp(x.detach()).dequantize())
    with pytest.raises(RuntimeError, match="does not require grad"):
        deq.sum().backward()
    assert x.grad is None


@pytest.mark.parametrize("signs, message", [
    ([1, 2] * 8, "16 values of \\+1/-1"), ([0] * 16, "16 values of \\+1/-1"),
    (torch.ones(8), "16 values of \\+1/-1"),
])
def test_from_hp_checks_rht_signs(signs, message):
    with pytest.raises(ValueError, match="rht_signs: must be " + message):
        NVFP4Tensor.from_hp(torch.randn(16, 32), rht=True, rht_signs=signs)
    with pytest.raises(ValueError, match="rht_signs given, but rht=False"):
        NVFP4Tensor.from_hp(torch.randn(16, 32), rht_signs=torch.ones(16))


def test_from_hp_takes_signs_as_a_list():
    x = torch.randn(16, 32)
    signs = [1, -1, -1, 1] * 4
    t = NVFP4Tensor.from_hp(x, rht=True, rht_signs=signs)
    assert torch.equal(t.rht_signs, torch.tensor(signs, dtype=torch.float32))
    assert torch.equal(t.dequantize(torch.float32), R.dequantize(R.quantize(x, QuantSpec(rht=True), rht_signs=t.rht_signs)))


@pytest.mark.parametrize("shape, block, scaling", [((0, 64), "1d", "per_tensor"),
                                                   ((2, 0, 32), "1d", "per_token"),
                                                   ((0, 32), "2d", "per_tensor")])
def test_from_hp_of_an_empty_tensor_is_empty(shape, block, scaling):
    t = NVFP4Tensor.from_hp(torch.randn(shape), block=block, scaling=scaling)
    assert t.shape == shape and t.dequantize().shape == shape
    assert t.outer_scale.shape == (shape[:-1] if scaling == "per_token" else ())
    assert "shape=" + str(shape) in repr(t)


def test_repr_of_a_meta_tensor():
    t = NVFP4Tensor.from_hp(torch.randn(32, 64, device="meta"), scaling="per_token")
    assert t.device.type == "meta"
    assert "shape=(32, 64)" in repr(t) and "device=meta" in repr(t)


def test_matmul_runs_on_the_tensors_backend(monkeypatch):
    """A matmul of NVFP4Tensors runs on the backend they were made with (the Triton kernels
    under the interpreter here), not on the device's default."""
    from nvfp4_recipe.backends import triton as triton_backend
    calls = []
    mm = triton_backend.TritonBackend.mm
    monkeypatch.setattr(triton_backend.TritonBackend, "mm",
                        lambda self, a, b, **kw: calls.append(1) or mm(self, a, b, **kw))
    x, w = torch.randn(32, 64), torch.randn(16, 64)
    xq = NVFP4Tensor.from_hp(x, backend="triton")
    wq = NVFP4Tensor.from_hp(w, block="2d", backend="triton")
    assert xq.backend == "triton"
    out = torch.mm(xq, wq.t())
    assert calls == [1]
    assert torch.allclose(out, R.scaled_mm(xq.operand, wq.operand), rtol=1e-5, atol=1e-6)
