"""The backends' primitives (``nvfp4_recipe.backends``): the Triton backend gives the reference
backend's bits for quantize, quantize_pair (transient copies as inner values, a B operand prepared
in the same pass, transposed views read through their base), prepare_weight and mm; "auto" and
named backends resolve as documented. The Triton backend runs on ``kernel_device``: under the
interpreter on CPU tensors, compiled on a GPU machine, where the reference runs on the GPU too."""

import logging

import pytest
import torch

import nvfp4_recipe.backends as B
from nvfp4_recipe import reference as R
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.backends.reference import ReferenceBackend
from nvfp4_recipe.kernels.runtime import inner_values_supported
from nvfp4_recipe.operand import NVFP4Operand
from nvfp4_recipe.spec import Block, FourOverSix, Form, QuantSpec

from nvfp4_cases import (INTERPRETING, PAIR_IDS, assert_inner_equals, assert_same, backend_device,
                         idfn, rand, recipe_pairs, signs_for, spec, triton_backend)
from test_kernels_gemm import assert_matches_reference

REF = ReferenceBackend()


@pytest.mark.parametrize("sp,shape,dtype", [
    (spec(), (48, 80), torch.bfloat16),
    (spec(scaling="per_token", rounding="sr"), (2, 24, 64), torch.bfloat16),  # leading dims
    (spec(rounding="sr", rht=True), (40, 48), torch.float32),
    (spec(scaling="per_token", rht=True, amax_scale=1.37), (32, 48), torch.float16),
    (spec(block="2d"), (48, 80), torch.bfloat16),
    (spec(block="2d", rounding="sr", amax_scale=0.75), (32, 48), torch.float32),
], ids=idfn)
def test_quantize_matches_reference(sp, shape, dtype, kernel_device):
    x = rand(shape, dtype, kernel_device)
    kw = dict(seed=11, offset=5, signs=signs_for().to(kernel_device))
    assert_same(triton_backend(kernel_device).quantize(x, sp, **kw), REF.quantize(x, sp, **kw))


@pytest.mark.parametrize("sp", [spec(rounding="sr", rht=True), spec(scaling="per_token"),
                                spec(block="2d")], ids=idfn)
def test_quantize_transposed_view(sp, kernel_device):
    """``quantize(x.t())`` (the columnwise copy) reads x through the columnwise path."""
    x = rand((48, 64), device=kernel_device)
    dev = kernel_device
    kw = dict(seed=torch.tensor(7, device=dev), offset=torch.tensor(2**31 + 9, device=dev),
              signs=signs_for().to(dev))
    assert_same(triton_backend(dev).quantize(x.t(), sp, **kw), REF.quantize(x.t(), sp, **kw))


def test_quantize_empty(kernel_device):
    x = torch.randn(0, 32, device=kernel_device)
    out = triton_backend(kernel_device).quantize(x, spec())
    assert out.qdata.shape == (0, 16) and torch.equal(R.dequantize(out), x)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("name,row,col", recipe_pairs(), ids=PAIR_IDS)
def test_quantize_pair_transient_and_prepared(name, row, col, transposed, kernel_device):
    """quantize_pair as the layer calls it: transient copies come back as inner values, the others
    as codes, b prepared (dequantized) in the same launch; a transposed view is read through its
    base. Everything equals the reference backend's."""
    dev = kernel_device
    x = rand((80, 48), device=dev, seed=12).t() if transposed else \
        rand((48, 80), device=dev, seed=12)
    b = REF.quantize(rand((32, 80), device=dev, seed=13), spec())
    kw = dict(seed=torch.tensor(3, device=dev), row_offset=1, col_offset=2**31,
              signs=signs_for().to(dev))
    for transient in ((True, False), (True, True), (False, False)):
        r, c, bp = triton_backend(dev).quantize_pair(x, row, col, **kw, transient=transient,
                                                     prepare=b)
        ref_r, ref_c, ref_b = REF.quantize_pair(x, row, col, **kw, prepare=b)
        for out, ref, is_inner in ((r, ref_r, transient[0]), (c, ref_c, transient[1])):
            (assert_inner_equals if is_inner else assert_same)(out, ref)
        assert_inner_equals(bp, ref_b)


def test_quantize_pair_rowwise_only_prepares_b_in_its_own_pass(kernel_device):
    _, row, _ = recipe_pairs()[1]
    x = rand((48, 80), device=kernel_device, seed=1)
    b = REF.quantize(rand((32, 80), device=kernel_device, seed=2), spec())
    r, c, bp = triton_backend(kernel_device).quantize_pair(x, row, None, seed=5,
                                                           transient=(True, False), prepare=b)
    assert c is None
    assert_inner_equals(r, REF.quantize(x, row, seed=5))
    assert_inner_equals(bp, b)


@pytest.mark.parametrize("block", ["1d", "2d"])
@pytest.mark.parametrize("need_t", [False, True])
def test_prepare_weight_matches_reference(block, need_t, kernel_device):
    w = rand((32, 64), device=kernel_device, seed=2)
    sp = spec(block=block)
    (wq, wtq), (rw, rwt) = (triton_backend(kernel_device).prepare_weight(w, sp, need_t=need_t),
                            REF.prepare_weight(w, sp, need_t=need_t))
    assert_inner_equals(wq, rw)  # W feeds fprop's GEMM at once: inner values
    if need_t:
        assert_same(wtq, rwt)
        assert torch.equal(R.dequantize(rwt), R.dequantize(rw).t()) == (block == "2d")
    else:
        assert wtq is None and rwt is None


def test_mm_matches_reference_from_codes_and_inner_values(kernel_device):
    a = REF.quantize(rand((48, 64), device=kernel_device, seed=3), spec(scaling="per_token"))
    b = REF.quantize(rand((32, 64), device=kernel_device, seed=4), spec(block="2d"))
    be = triton_backend(kernel_device)
    ref = REF.mm(a, b, out_dtype=torch.float32)
    out = be.mm(a, be.prepare(b), out_dtype=torch.float32)
    if INTERPRETING:  # the interpreter's GEMM path sums as the reference's
        assert torch.allclose(out, ref, rtol=1e-5, atol=0)
    else:  # the compiled GEMM sums in another order: within its bound (tests/test_kernels_gemm.py)
        assert_matches_reference(out, a, b, out_dtype=torch.float32)
    assert b.block is Block.D2


def test_backend_names(kernel_device):
    assert get_backend("auto", torch.device("cpu")).name == "reference"
    assert get_backend("triton", kernel_device).name == "triton"  # CPU: the interpreter in tests
    with pytest.raises(ValueError, match="backend 'native' cannot run here"):
        get_backend("native", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown NVFP4 backend 'cuda'"):
        get_backend("cuda", torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("name,row,col", recipe_pairs(), ids=PAIR_IDS)
def test_cuda_pair_and_prepare(name, row, col, device):
    x = rand((4112, 2064), device=device, seed=14)
    b = REF.quantize(rand((1040, 4112), seed=15).to(device), spec())
    kw = dict(seed=torch.tensor(9, device=device), row_offset=7, col_offset=2**31,
              signs=signs_for().to(device))
    r, c, bp = get_backend("triton", device).quantize_pair(x, row, col, **kw, transient=(True, True),
                                                          prepare=b)
    ref_r, ref_c, _ = REF.quantize_pair(x, row, col, **kw)
    assert_inner_equals(r, ref_r)
    assert_inner_equals(c, ref_c)
    assert_inner_equals(bp, b)


def test_auto_picks_triton_on_every_gpu_and_native_is_opt_in(monkeypatch, caplog):
    """On a CUDA device "auto" is the Triton backend even where the native one could run (sm100+:
    it has not run on a Blackwell GPU yet); naming "native" works and logs once that it is
    untested."""
    B._load("native")  # registers the native and Triton backends
    monkeypatch.setattr(B, "_available", lambda name, device: None)  # every backend can run
    monkeypatch.setattr(B, "_WARNED", set())
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="nvfp4_recipe"):
        assert B._resolve("auto", cuda).name == "triton"
        assert not caplog.records
        assert B._resolve("native", cuda).name == "native"
        assert B._resolve("native", cuda).name == "native"
    assert [r.getMessage() for r in caplog.records if "untested" in r.getMessage()] == [
        caplog.records[0].getMessage()]
    assert "Blackwell" in caplog.text


def _primitive_operands(be, x, w, w3, offs, signs, specs):
    """(primitive, operand, spec it was quantized under, whether it may come back as inner
    values) for every operand ``be``'s primitives return."""
    dense, row, col, w2d, experts = specs
    kw = dict(seed=5, signs=signs)
    q = be.quantize(x, dense, **kw)
    wq, wtq = be.prepare_weight(w, w2d, need_t=True)
    r, c, bp = be.quantize_pair(x, row, col, **kw, transient=(True, False), prepare=wtq)
    gr, gc, gp = be.quantize_groups(x, offs, row, col, **kw, transient=(True, False),
                                    prepare=be.quantize_experts(w3, experts, need_t=True)[1])
    eq, etq = be.quantize_experts(w3, experts, need_t=True)
    return [("quantize", q, dense, False), ("prepare_weight", wq, w2d, True),
            ("prepare_weight_t", wtq, w2d, False), ("prepare", be.prepare(wtq), w2d, True),
            ("quantize_pair_row", r, row, True), ("quantize_pair_col", c, col, False),
            ("quantize_pair_prepared", bp, w2d, True), ("quantize_groups_row", gr.data, row, True),
            ("quantize_groups_col", gc.data, col, False),
            ("quantize_groups_prepared", gp, experts, True), ("quantize_experts", eq, experts, False),
            ("quantize_experts_t", etq, experts, False)]


@pytest.mark.parametrize("name", ["reference", "triton"])
def test_operands_carry_their_spec_and_form_across_the_compile_boundary(name):
    """Every operand a primitive returns carries the spec it was quantized under and says its form
    (codes, or the inner values a transient or prepared copy may come back as), in eager mode and
    through the registered operators under torch.compile, with the same bits."""
    dev = backend_device(name)
    be = get_backend(name, dev)
    fos = FourOverSix("mse", 256)
    specs = (spec(scaling="per_token", rounding="sr", rht=True, amax_scale=1.5),
             QuantSpec(rounding="sr", four_over_six=fos), spec(rht=True, amax_scale=0.75),
             QuantSpec(Block.D2, four_over_six=fos), QuantSpec(rounding="sr"))
    args = (rand((48, 64), device=dev, seed=1), rand((32, 64), device=dev, seed=2),
            rand((2, 32, 64), device=dev, seed=3),
            torch.tensor([16, 48], dtype=torch.int32, device=dev), signs_for().to(dev))
    eager = _primitive_operands(be, *args, specs)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _primitive_operands(be, *a, specs), backend="aot_eager",
                             fullgraph=True)(*args)
    for (what, op, sp, may_be_values), (_, got, _, _) in zip(eager, compiled):
        assert isinstance(got, NVFP4Operand) and got.spec == op.spec == sp, what
        assert got.block is sp.block and got.form is op.form, what
        if op.form is Form.CODES:
            assert op.qdata is not None and op.values is None, what
            assert torch.equal(got.qdata, op.qdata) and torch.equal(got.scale.view(torch.uint8),
                                                                    op.scale.view(torch.uint8))
        else:
            assert may_be_values and op.qdata is None and op.scale is None, what
            assert torch.equal(got.values, op.values), what
        assert torch.equal(got.outer_scale, op.outer_scale), what
    forms = {what: op.form for what, op, _, _ in eager}
    values = name == "triton" and inner_values_supported(dev)
    for what in ("prepare_weight", "quantize_pair_row", "quantize_pair_prepared",
                 "quantize_groups_row", "quantize_groups_prepared"):
        assert forms[what] is (Form.VALUES if values else Form.CODES), what
