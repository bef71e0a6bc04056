"""NVFP4Tensor: construction, the op table, repr, serialization and torch.compile."""

import copy
import io
import pickle

import pytest
import torch

from nvfp4_recipe import NVFP4Tensor
from nvfp4_recipe import reference as R
from nvfp4_recipe.operand import NVFP4Operand
from nvfp4_recipe.spec import Block, FourOverSix, Form, QuantSpec
from nvfp4_recipe.tensor import _FIELD_BY_FIELD, _from_pickle

from nvfp4_cases import INTERPRETING, signs_for
from test_kernels_gemm import assert_matches_reference


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


def test_matmul_runs_on_the_tensors_backend(monkeypatch, kernel_device):
    """A matmul of NVFP4Tensors runs on the backend they were made with (the Triton kernels, on
    ``kernel_device``: under the interpreter on the CPU, whose default is the reference), not on
    the device's default."""
    from nvfp4_recipe.backends import triton as triton_backend
    calls = []
    mm = triton_backend.TritonBackend.mm
    monkeypatch.setattr(triton_backend.TritonBackend, "mm",
                        lambda self, a, b, **kw: calls.append(1) or mm(self, a, b, **kw))
    x, w = torch.randn(32, 64).to(kernel_device), torch.randn(16, 64).to(kernel_device)
    xq = NVFP4Tensor.from_hp(x, backend="triton")
    wq = NVFP4Tensor.from_hp(w, block="2d", backend="triton")
    assert xq.backend == "triton"
    out = torch.mm(xq, wq.t())
    assert calls == [1]
    if INTERPRETING:  # the interpreter's GEMM path sums as the reference's
        assert torch.allclose(out, R.scaled_mm(xq.operand, wq.operand), rtol=1e-5, atol=1e-6)
    else:  # the compiled GEMM sums in another order: within its bound (tests/test_kernels_gemm.py)
        assert_matches_reference(out, xq.operand, wq.operand, out_dtype=out.dtype)


# ---------------------------------------------------------------------------- from_hp arguments
@pytest.mark.parametrize("name", ["seed", "offset"])
@pytest.mark.parametrize("value, error", [
    (1.5, TypeError), ("abc", TypeError), (True, TypeError), (None, TypeError),
    (torch.tensor([3.0]), TypeError), (torch.tensor([1, 2]), TypeError), (torch.tensor(True), TypeError),
    (-1, ValueError), (2**63, ValueError), (2**70, ValueError),
])
def test_from_hp_checks_seed_and_offset(name, value, error):
    with pytest.raises(error, match=f"from_hp: {name} must be an int in \\[0, 2\\*\\*63\\)"):
        NVFP4Tensor.from_hp(torch.randn(16, 32), rounding="sr", **{name: value})


def test_from_hp_takes_64_bit_keys_and_tensor_streams():
    x = torch.randn(32, 64)
    spec = QuantSpec(rounding="sr")
    for seed, offset in ((2**63 - 1, 2**40 + 3), (2**32, 0)):
        t = NVFP4Tensor.from_hp(x, rounding="sr", seed=seed, offset=offset)
        assert torch.equal(t.qdata, R.quantize(x, spec, seed=seed, offset=offset).qdata)
    high = NVFP4Tensor.from_hp(x, rounding="sr", seed=2**32)  # the key's high word counts
    assert not torch.equal(high.qdata, NVFP4Tensor.from_hp(x, rounding="sr", seed=0).qdata)
    as_tensors = NVFP4Tensor.from_hp(x, rounding="sr", seed=torch.tensor([2**32]),
                                     offset=torch.tensor(0, dtype=torch.int32))
    assert torch.equal(as_tensors.qdata, high.qdata)


def test_from_hp_wants_a_bool_rht():
    with pytest.raises(TypeError, match="from_hp: rht must be a bool, got 1"):
        NVFP4Tensor.from_hp(torch.randn(16, 32), rht=1)


def test_from_hp_wants_a_plain_tensor():
    with pytest.raises(TypeError, match="from_hp: x must be a torch.Tensor, got list"):
        NVFP4Tensor.from_hp(torch.randn(16, 32).tolist())
    with pytest.raises(TypeError, match="already quantized.*call .dequantize\\(\\) first"):
        NVFP4Tensor.from_hp(NVFP4Tensor.from_hp(torch.randn(16, 32)))


# ---------------------------------------------------------------------------- pickle
def _fields(t):
    return ([t.qdata, t.scale.view(torch.uint8), t.outer_scale, t.rht_signs],
            [getattr(t, name) for name in t.tensor_attribute_names] + [t.shape, t.dtype, t.spec])


PICKLED = {
    "1d": lambda: NVFP4Tensor.from_hp(torch.randn(48, 64, dtype=torch.bfloat16)),
    "2d": lambda: NVFP4Tensor.from_hp(torch.randn(32, 64), block="2d", rounding="sr", seed=9),
    "2d transposed view": lambda: NVFP4Tensor.from_hp(torch.randn(32, 64), block="2d").t(),
    "per_token 3-D": lambda: NVFP4Tensor.from_hp(torch.randn(2, 16, 32), scaling="per_token"),
    "rht": lambda: NVFP4Tensor.from_hp(torch.randn(16, 64), rht=True, rht_signs=[1, -1] * 8,
                                       backend="reference").to(torch.float16),
    "row slice": lambda: NVFP4Tensor.from_hp(torch.randn(64, 32), scaling="per_token")[8:40:2],
    "4/6": lambda: NVFP4Tensor.from_hp(torch.randn(32, 64), block="2d", four_over_six="mse",
                                       four_over_six_e4m3_max=256),
}


@pytest.mark.parametrize("make", list(PICKLED.values()), ids=list(PICKLED))
def test_pickle_round_trip(make):
    t = make()
    for u in (pickle.loads(pickle.dumps(t)), copy.copy(t), copy.deepcopy(t)):
        assert type(u) is NVFP4Tensor
        (tensors, attrs), (expect_tensors, expect_attrs) = _fields(u), _fields(t)
        assert attrs == expect_attrs
        for a, b in zip(tensors, expect_tensors):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
        assert u.scale.dtype == torch.float8_e4m3fn
        assert torch.equal(u.dequantize(), t.dequantize())


@pytest.mark.parametrize("fos", [None, "mae"])
def test_torch_save_loads_old_and_new_checkpoints(monkeypatch, fos):
    """torch.save goes through ``__reduce_ex__`` too (weights_only load included, a 4/6 spec's
    fields too); a file written with torch.Tensor's reduction (before NVFP4Tensor had its own)
    still loads."""
    t = NVFP4Tensor.from_hp(torch.randn(32, 64), scaling="per_token", rht=True, four_over_six=fos)

    def round_trip():
        buf = io.BytesIO()
        torch.save({"t": t}, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)["t"]

    new = round_trip()
    monkeypatch.setattr(NVFP4Tensor, "__reduce_ex__", torch.Tensor.__reduce_ex__)
    for u in (new, round_trip()):
        assert _fields(u)[1] == _fields(t)[1] and torch.equal(u.rht_signs, t.rht_signs)
        assert torch.equal(u.dequantize(), t.dequantize())


def test_tensors_pickled_field_by_field_load_with_their_spec(monkeypatch):
    """Files of versions whose tensor held its spec's fields one by one: pickled by
    ``__reduce_ex__`` (block, scaling, rounding, ..., rht_signs, and from 2026-11-27 amax_scale and
    four_over_six) or, before it, by torch.Tensor's reduction (those fields in the state)."""
    fos = FourOverSix("mse", 448, True)
    signs = signs_for(2)
    full = QuantSpec(scaling="per_token", rounding="sr", rht=True, amax_scale=0.5, four_over_six=fos)
    t = NVFP4Tensor.from_operand(R.quantize(torch.randn(32, 64), full, seed=4, rht_signs=signs),
                                 torch.bfloat16, signs, "reference")
    fields = ["per_token" if k == "scaling" else "sr" if k == "rounding" else "1d" if k == "block"
              else getattr(t, k) for k in _FIELD_BY_FIELD]
    for attributes, spec in ((fields, full), (fields[:7], QuantSpec(scaling="per_token",
                                                                       rounding="sr", rht=True))):
        u = _from_pickle(t.qdata, t.scale.view(torch.uint8), t.outer_scale, *attributes)
        assert u.spec == spec and u.orig_dtype == torch.bfloat16 and u.backend == "reference"
        assert torch.equal(u.rht_signs, signs) and torch.equal(u.dequantize(), t.dequantize())
    state = dict(zip(_FIELD_BY_FIELD[:7], fields), qdata=t.qdata, scale=t.scale,
                 outer_scale=t.outer_scale)
    monkeypatch.setattr(NVFP4Tensor, "__reduce_ex__", torch.Tensor.__reduce_ex__)
    monkeypatch.setattr(NVFP4Tensor, "__getstate__", lambda self: state, raising=False)
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    u = torch.load(buf, weights_only=True)
    assert u.spec == QuantSpec(scaling="per_token", rounding="sr", rht=True)
    assert torch.equal(u.dequantize(), t.dequantize())


def test_the_constructor_checks_its_spec_and_signs():
    t = NVFP4Tensor.from_hp(torch.randn(16, 32))
    with pytest.raises(TypeError, match="spec must be a QuantSpec, got '1d'"):
        NVFP4Tensor(t.qdata, t.scale, t.outer_scale, "1d", t.dtype, False)
    with pytest.raises(ValueError, match="rht=True, but rht_signs is None"):
        NVFP4Tensor(t.qdata, t.scale, t.outer_scale, QuantSpec(rht=True), t.dtype, False)


# ---------------------------------------------------------------------------- row indexing, .T, comparisons
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
def test_row_indexing_keeps_whole_rows(scaling):
    t = NVFP4Tensor.from_hp(torch.randn(4, 32, 64), scaling=scaling)
    deq = t.dequantize()
    for index in (1, -1, slice(1, 3), slice(None, None, 2), (slice(None), 5), (2, slice(3, 30, 4))):
        u = t[index]
        assert isinstance(u, NVFP4Tensor) and u.shape == deq[index].shape
        assert torch.equal(u.qdata, t.qdata[index])
        assert torch.equal(u.scale.view(torch.uint8), t.scale.view(torch.uint8)[index])
        outer = t.outer_scale[index] if scaling == "per_token" else t.outer_scale
        assert torch.equal(u.outer_scale, outer)
        assert torch.equal(u.dequantize(), deq[index])
    row = t[1, 7]  # one row: a 1-D tensor, its own outer scale per token
    assert row.shape == (64,) and torch.equal(row.dequantize(), deq[1, 7])
    assert "values[:8]=" in repr(row)


def test_row_indexing_of_transposed_and_2d_tensors():
    t = NVFP4Tensor.from_hp(torch.randn(32, 64), scaling="per_token").t()  # (64, 32), blocks along dim 0
    assert torch.equal(t[:, 3:9].dequantize(), t.dequantize()[:, 3:9])
    assert torch.equal(t[:, 5].dequantize(), t.dequantize()[:, 5])
    for index in (2, slice(0, 16)):
        with pytest.raises(NotImplementedError, match="blocks of 16 run along"):
            t[index]
    w = NVFP4Tensor.from_hp(torch.randn(64, 32), block="2d")
    assert torch.equal(w.t()[:, 16:48].dequantize(), w.dequantize().t()[:, 16:48])
    with pytest.raises(ValueError, match="split its 16x16 tiles"):
        w[3]
    with pytest.raises(ValueError, match="multiples of 16"):
        w[0:32:2]


def test_T_is_t():
    x, w = torch.randn(32, 64), torch.randn(16, 64)
    xq, wq = NVFP4Tensor.from_hp(x), NVFP4Tensor.from_hp(w, block="2d")
    assert wq.T.shape == (64, 16) and wq.T.transposed and wq.T.T.transposed is False
    assert torch.equal(wq.T.dequantize(), wq.dequantize().T)
    assert torch.equal(xq @ wq.T, torch.mm(xq, wq.t()))
    assert torch.equal(wq.permute(0, 1).dequantize(), wq.dequantize())
    with pytest.raises(NotImplementedError, match="swapping the last two dims"):
        NVFP4Tensor.from_hp(torch.randn(2, 16, 32)).permute(1, 0, 2)


def test_comparisons_are_on_the_dequantized_values():
    x = torch.randn(32, 64)
    t, u = NVFP4Tensor.from_hp(x), NVFP4Tensor.from_hp(x + 0.3 * torch.randn_like(x))
    deq = t.dequantize()
    assert torch.equal(t == u, deq == u.dequantize()) and not (t == u).all()
    assert torch.equal(t != u, deq != u.dequantize())
    assert (t == deq).all() and torch.equal(t == 0, deq == 0) and (t == 0).any()
    assert torch.equal(t, t.clone()) and torch.equal(t, deq) and not torch.equal(t, u)
    negative_zero = torch.where(t.qdata & 0xF == 0, t.qdata | 0x8, t.qdata)  # -0 codes for +0 ones
    other_codes = NVFP4Tensor(negative_zero, t.scale, t.outer_scale, QuantSpec(), t.dtype, False)
    assert not torch.equal(other_codes.qdata, t.qdata) and torch.equal(other_codes, t)
    assert torch.allclose(t, deq + 1e-9) and not torch.allclose(t, u)
    assert torch.equal(torch.isclose(t, u, atol=0.1), torch.isclose(deq, u.dequantize(), atol=0.1))
    assert torch.equal(t.isclose(deq), torch.ones_like(deq, dtype=torch.bool))


@pytest.mark.parametrize("op, name", [
    (lambda t: t + 1, "aten.add.Tensor"), (lambda t: t * 2, "aten.mul.Tensor"),
    (lambda t: t.sum(), "aten.sum.default"), (lambda t: t.abs(), "aten.abs.default"),
    (lambda t: t < 0, "aten.lt.Scalar"), (lambda t: torch.cat([t, t]), "aten.cat.default"),
    (lambda t: torch.relu(t), "aten.relu.default"),
])
def test_other_ops_raise_one_clear_message(op, name):
    t = NVFP4Tensor.from_hp(torch.randn(16, 32))
    with pytest.raises(NotImplementedError) as info:
        op(t)
    message = str(info.value)
    assert message.startswith("NVFP4Tensor supports mm/addmm/bmm/matmul/linear")
    for word in ("row indexing and slicing", "t/T/mT", "==/!=/torch.equal/allclose"):
        assert word in message
    assert message.endswith(f"call .dequantize() first for {name}")


def test_repr_inside_containers_and_of_views():
    t = NVFP4Tensor.from_hp(torch.randn(2, 16, 64, dtype=torch.bfloat16), rounding="sr", rht=True)
    for text in (str([t]), str({"t": t}), f"{t}"):
        for word in ("NVFP4Tensor(shape=(2, 16, 64)", "dtype=torch.bfloat16", "block=1d",
                     "scaling=per_tensor", "rounding=sr", "rht=True", "outer_scale=", "values[0, 0, :8]="):
            assert word in text
    w = NVFP4Tensor.from_hp(torch.randn(32, 16), block="2d").t()
    assert "transposed view" in repr(w) and "values[:8, 0]=" in repr(w) and "16x16" in repr(w)


# ---------------------------------------------------------------------------- the operand's spec
def test_operand_and_spec_round_trip_through_from_operand():
    """from_operand reads the spec from the operand; ``spec`` and ``operand`` give it back whole
    (amax scale and 4/6 included), through views, slices and moves."""
    fos = FourOverSix("mse", 256, True)
    x, signs = torch.randn(32, 64), signs_for(1)
    for sp, rht_signs in ((QuantSpec(Block.D2, rounding="sr", amax_scale=1.25, four_over_six=fos), None),
                          (QuantSpec(scaling="per_token", rht=True), signs)):
        op = R.quantize(x, sp, seed=3, rht_signs=rht_signs)
        t = NVFP4Tensor.from_operand(op, torch.bfloat16, rht_signs, "reference")
        assert t.spec == sp and t.operand.spec == sp and t.operand.form is Form.CODES
        assert t.block == sp.block.value and t.scaling == sp.scaling.value
        assert t.rounding == sp.rounding.value and t.amax_scale == sp.amax_scale
        assert t.four_over_six == sp.four_over_six
        assert torch.equal(t.operand.qdata, op.qdata) and t.operand.qdata is op.qdata
        for u in (t.t(), t[16:32], t.to(torch.float32), t.detach(), t.clone()):
            assert u.spec == sp
        if sp.block is Block.D2:
            assert R.transpose_2d(t.operand).spec == sp


def test_from_operand_checks_form_and_signs():
    op = R.quantize(torch.randn(16, 32), QuantSpec(rht=True),
                    rht_signs=signs_for(1))
    with pytest.raises(ValueError, match="rht=True, but rht_signs is None"):
        NVFP4Tensor.from_operand(op, torch.float32)
    with pytest.raises(ValueError, match="rht=False, but rht_signs is given"):
        NVFP4Tensor.from_operand(op._replace(spec=QuantSpec()), torch.float32, torch.ones(16))
    values = op._replace(qdata=None, scale=None, values=R.dequantize_inner(op).half())
    assert values.form is Form.VALUES and values.rows == 16 and values.k == 32
    with pytest.raises(ValueError, match="holds codes; the operand holds values"):
        NVFP4Tensor.from_operand(values, torch.float32)
