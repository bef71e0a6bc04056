"""The quantize kernels (``kernels/quantize.py``) are bit-exact with the reference.

The small ragged shapes run on ``kernel_device``: under the Triton interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), compiled on a GPU machine; ``cuda`` tests
run the compiled kernels on larger ones.
"""

import dataclasses

import pytest
import torch

from nvfp4_recipe import reference as R
from nvfp4_recipe.spec import FourOverSix, QuantSpec
from nvfp4_recipe.kernels.quantize import quantize_1d, quantize_2d

from nvfp4_cases import (PAIR_IDS, assert_inner_equals, assert_same, idfn, rand, recipe_pairs,
                         signs_for, spec)


def reference_pair(x, row, col, seed, row_offset, col_offset, signs):
    """The reference's copies, computed on x's device (a NaN's sign bit is the platform's: x86 and
    CUDA make Inf * 0 with opposite signs)."""
    return (None if row is None else R.quantize(x, row, seed=seed, offset=row_offset, rht_signs=signs),
            None if col is None else R.quantize(x.t(), col, seed=seed, offset=col_offset, rht_signs=signs))


def check_pair(x, row, col, inner=(False, False), seed=0, row_offset=0, col_offset=0, signs=None):
    """quantize_1d's copies equal the reference's: codes bit for bit, inner values exactly."""
    s = None if signs is None else signs.to(x.device)
    out = quantize_1d(x, row, col, inner=inner, seed=seed, row_offset=row_offset,
                      col_offset=col_offset, signs=s)
    to_int = lambda v: int(v) if isinstance(v, torch.Tensor) else v
    refs = reference_pair(x, row, col, to_int(seed), to_int(row_offset), to_int(col_offset), s)
    for o, ref, is_inner in zip(out, refs, inner):
        if ref is None:
            assert o is None
        elif is_inner:
            assert_inner_equals(o, ref)
        else:
            assert_same(o, ref)


@pytest.mark.parametrize("sp,shape,dtype", [
    (spec(), (48, 80), torch.bfloat16),
    (spec(scaling="per_token", rounding="sr"), (48, 64), torch.bfloat16),
    (spec(rounding="sr", rht=True), (40, 48), torch.float32),  # rowwise RHT, M not a multiple of 16
    (spec(scaling="per_token", rht=True, amax_scale=1.37), (32, 48), torch.float16),
    (spec(scaling="per_token", rht=True), (48, 208), torch.bfloat16),  # per-row RHT amax, loop tiles
], ids=idfn)
def test_rowwise_matches_reference(sp, shape, dtype, kernel_device):
    check_pair(rand(shape, dtype, kernel_device), sp, None, seed=11, row_offset=5,
               signs=signs_for())


@pytest.mark.parametrize("sp", [spec(), spec(scaling="per_token", rounding="sr")], ids=idfn)
def test_rowwise_loop_tail(sp, kernel_device):
    """Rowwise-only calls run the prefetch-loop kernel: several tiles per program, a program whose
    last tiles are partly or wholly past K, and M not a multiple of the tile height; the Philox
    counter wraps."""
    check_pair(rand((40, 208), torch.bfloat16, kernel_device, seed=5), sp, None, seed=3,
               row_offset=2**32 - 100)


@pytest.mark.parametrize("name,row,col", recipe_pairs(), ids=PAIR_IDS)
@pytest.mark.parametrize("inner", [(False, False), (True, True), (True, False), (False, True)], ids=idfn)
def test_pair_matches_reference(name, row, col, inner, kernel_device):
    check_pair(rand((48, 80), device=kernel_device, seed=1), row, col, inner,
               seed=torch.tensor(123, device=kernel_device), row_offset=3, col_offset=2**31,
               signs=signs_for())


@pytest.mark.parametrize("sp", [spec(), spec(scaling="per_token", rounding="sr"),
                                spec(rounding="sr", rht=True)], ids=idfn)
def test_inner_rowwise_only(sp, kernel_device):
    """The rowwise-only (prefetch loop) kernel with inner values."""
    check_pair(rand((40, 208), torch.float32, kernel_device, seed=6), sp, None, (True, False),
               seed=3, row_offset=9, signs=signs_for())


def test_rowwise_rht_with_a_columnwise_copy(kernel_device):
    """An RHT along K runs in the rowwise-only kernel, so a call that also asks for a columnwise
    copy makes it in a second pass; both equal the reference's."""
    sp = spec(rounding="sr", rht=True)
    check_pair(rand((48, 80), device=kernel_device, seed=13), sp, sp, (False, True), seed=4,
               row_offset=1, col_offset=2**31, signs=signs_for())


@pytest.mark.parametrize("sp", [spec(block="2d"), spec(block="2d", rounding="sr", amax_scale=0.75)], ids=idfn)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=idfn)
@pytest.mark.parametrize("inner", [False, True], ids=["codes", "inner"])
def test_2d_w_and_wt_from_one_read(sp, dtype, inner, kernel_device):
    """W (as codes, or as the fp16 inner values its fprop GEMM reads) and W^T from one read."""
    w = rand((48, 80), dtype, kernel_device, seed=2)
    wq, wtq = quantize_2d(w, sp, seed=7, offset=9, inner=inner)
    ref = R.quantize(w, sp, seed=7, offset=9)
    if inner:
        assert_inner_equals(wq, ref)
    else:
        assert_same(wq, ref)
    assert_same(wtq, R.transpose_2d(ref))


def check_dequantize_rider(x, b_shape, device="cpu", block="1d"):
    """The dY pass of NVFP4Linear with X^T (1d) or a weight (2d) riding along
    (``quantize_1d(dequantize=...)``): the rider's values equal the dequantize pass's, bit for
    bit, and the pair equals the pair alone."""
    _, row, col = recipe_pairs()[1]
    b_hp = rand(b_shape, seed=8, device=device)
    b = quantize_1d(b_hp, spec())[0] if block == "1d" else quantize_2d(b_hp, write_wt=False)[0]
    kw = dict(inner=(True, True), seed=torch.tensor(7, device=device), row_offset=3,
              col_offset=2**31, signs=signs_for().to(device))
    out = torch.full(b_shape, float("nan"), dtype=torch.float16, device=device)
    got = quantize_1d(x, row, col, **kw, dequantize=(b, out))
    alone = quantize_1d(x, row, col, **kw)
    for g, a in zip(got, alone):
        assert torch.equal(g.values, a.values) and torch.equal(g.outer_scale, a.outer_scale)
    want = R.dequantize_inner(b._replace(qdata=b.qdata.cpu(), scale=b.scale.cpu()))
    assert torch.equal(out.float().cpu(), want), (out.float().cpu() != want).nonzero()[:5]


@pytest.mark.parametrize("b_shape,block", [((40, 80), "1d"), ((112, 1024), "1d"), ((48, 80), "2d")],
                         ids=idfn)
def test_dequantize_rides_on_the_pair(b_shape, block, kernel_device):
    """Ragged rider shapes (rows and K not multiples of the dequantize tile), fewer and more
    rider tiles than programs, 1d and 2d blocks."""
    check_dequantize_rider(rand((48, 80), device=kernel_device, seed=4), b_shape, kernel_device,
                           block)


def test_rejects_bad_input(kernel_device):
    ones = lambda *shape, **kw: torch.ones(*shape, device=kernel_device, **kw)
    x = rand((32, 32), device=kernel_device)
    b = quantize_1d(rand((16, 32), device=kernel_device), spec())[0]
    good = torch.empty(16, 32, dtype=torch.float16, device=kernel_device)
    with pytest.raises(ValueError, match="columnwise copy"):
        quantize_1d(x, spec(), dequantize=(b, good))
    with pytest.raises(ValueError, match=r"out must be \(16, 32\)"):
        quantize_1d(x, col=spec(), dequantize=(b, good.t()))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quantize_1d(x, col=spec(), dequantize=(b._replace(scale=b.qdata), good))
    with pytest.raises(TypeError, match="int32"):
        quantize_1d(ones(16, 16, dtype=torch.int32), spec())
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_1d(ones(16, 24), spec())
    with pytest.raises(ValueError, match="quantize_2d"):
        quantize_1d(ones(16, 16), spec(block="2d"))
    with pytest.raises(ValueError, match="RHT signs"):
        quantize_1d(ones(16, 16), col=spec(rht=True))
    with pytest.raises(ValueError, match="2d spec"):
        quantize_2d(ones(16, 16), spec())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: Inf / NaN
@pytest.mark.parametrize("sp", [spec(), spec(scaling="per_token", rounding="sr")], ids=idfn)
def test_zero_tiny_and_huge(sp, kernel_device):
    """All-zero rows (S_enc = FLT_MAX), tensors so small that S_enc saturates and S_dec is an fp32
    subnormal (the fp64 division), and one near the fp32 maximum."""
    x = rand((32, 48), torch.float32, kernel_device)
    x[5] = 0.0
    for t in (torch.zeros(32, 48, device=kernel_device), x, x * 1e-37, x * 1e-31, x * 1e33):
        check_pair(t, sp, sp, seed=1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nonfinite_propagates(kernel_device):
    """An Inf or a NaN makes the amax, the outer scale and the blocks non-finite as in the
    reference. NaN sign bits are platform-defined (x86 and CUDA differ), so they are ignored."""
    x = rand((32, 48), torch.float32, kernel_device)
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[3, 7] = bad
        for sp in (spec(), spec(scaling="per_token", rounding="sr")):
            out = quantize_1d(y, sp, seed=4)[0]
            ref = R.quantize(y, sp, seed=4)
            assert torch.equal(out.outer_scale.isnan(), ref.outer_scale.isnan())
            assert torch.equal(out.outer_scale.isinf(), ref.outer_scale.isinf())
            s, rs = out.scale.view(torch.uint8), ref.scale.view(torch.uint8)
            assert torch.equal(s & 0x7F, rs & 0x7F)
            nan_blocks = ((rs & 0x7F) == 0x7F).repeat_interleave(8, -1)
            assert torch.equal(out.qdata[~nan_blocks], ref.qdata[~nan_blocks])
            assert torch.equal(out.qdata & 0x77, ref.qdata & 0x77)  # magnitudes everywhere


def fos(error="mae", e4m3_max=448, fast_math=False):
    return FourOverSix(error, e4m3_max, fast_math)


FOS_1D = [  # (row spec, column spec): 4/6 with per-token, SR, RHT, amax estimation, both errors
    (QuantSpec(four_over_six=fos()), QuantSpec(rht=True, four_over_six=fos("mse", 256))),
    (QuantSpec(scaling="per_token", rounding="sr", four_over_six=fos("mse", 448, True)),
     QuantSpec(scaling="per_token", rounding="sr", rht=True, amax_scale=1.37,
               four_over_six=fos("mae", 256, True))),
    (None, QuantSpec(rounding="sr", rht=True, four_over_six=fos("mse", 256))),
]
FOS_2D = [QuantSpec("2d", four_over_six=fos()), QuantSpec("2d", rounding="sr", four_over_six=fos("mse", 256)),
          QuantSpec("2d", amax_scale=0.75, four_over_six=fos("mae", 256, True))]


@pytest.mark.parametrize("row,col", FOS_1D, ids=lambda s: idfn(s) + ("-4o6" if s else ""))
def test_four_over_six_pair_matches_reference(row, col, kernel_device):
    """4/6 copies (docs/numerics.md item 11) from the pair kernel, and the rowwise copy alone from
    the prefetch-loop kernel (with the RHT along K when asked), bit for bit."""
    x = rand((48, 80), torch.bfloat16, kernel_device, seed=int(torch.randint(0, 2**31, ())))
    check_pair(x, row, col, seed=11, row_offset=5, col_offset=9, signs=signs_for())
    if row is not None:
        check_pair(x, dataclasses.replace(row, rht=True), None, seed=11, row_offset=5,
                   signs=signs_for())


@pytest.mark.parametrize("sp", FOS_2D, ids=idfn)
@pytest.mark.parametrize("inner", [False, True], ids=["codes", "inner"])
def test_four_over_six_2d_w_and_wt_match_reference(sp, inner, kernel_device):
    w = rand((48, 64), torch.float32, kernel_device, seed=int(torch.randint(0, 2**31, ())))
    wq, wtq = quantize_2d(w, sp, seed=2, offset=1, inner=inner)
    ref = R.quantize(w, sp, seed=2, offset=1)
    (assert_inner_equals if inner else assert_same)(wq, ref)
    assert_same(wtq, R.transpose_2d(ref))


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(16400, 4112), (256, 4096)], ids=idfn)
@pytest.mark.parametrize("name,row,col", recipe_pairs(), ids=PAIR_IDS)
def test_cuda_pair(shape, name, row, col, device):
    x = rand(shape, device=device, seed=6)
    check_pair(x, row, col, seed=torch.tensor(99, device=device), row_offset=17,
               col_offset=2**31 + 1, signs=signs_for())
    check_pair(x, row, col, (True, True), seed=98, row_offset=5, col_offset=2**31 + 3,
               signs=signs_for())
    check_pair(x, row, None, (True, False), seed=98, row_offset=5, signs=signs_for())


@pytest.mark.cuda
@pytest.mark.parametrize("row,col", FOS_1D, ids=lambda s: idfn(s) + ("-4o6" if s else ""))
def test_cuda_four_over_six_pair(row, col, device):
    x = rand((16400, 4112), device=device, seed=8)
    check_pair(x, row, col, seed=5, row_offset=1000, col_offset=7, signs=signs_for())
    check_pair(x, row, col, (row is not None, True), seed=5, row_offset=1000, col_offset=7,
               signs=signs_for())
    if row is not None:
        check_pair(x, dataclasses.replace(row, rht=True), None, seed=5, row_offset=3,
                   signs=signs_for())


@pytest.mark.cuda
@pytest.mark.parametrize("sp", FOS_2D, ids=idfn)
def test_cuda_four_over_six_2d(sp, device):
    w = rand((4096, 14336), torch.bfloat16, device=device, seed=9)
    for inner in (False, True):
        wq, wtq = quantize_2d(w, sp, seed=2, offset=1, inner=inner)
        ref = R.quantize(w, sp, seed=2, offset=1)
        (assert_inner_equals if inner else assert_same)(wq, ref)
        assert_same(wtq, R.transpose_2d(ref))


@pytest.mark.cuda
def test_cuda_dequantize_rider(device):
    """The rider at a gpu-preset wgrad shape (X^T 2048 x 8192: more rider tiles than programs)
    and a ragged one, with the GPU's inline-PTX dequantization."""
    x = rand((8192, 512), device=device, seed=11)
    check_dequantize_rider(x, (2048, 8192), device)
    check_dequantize_rider(x, (1000, 4112), device)


@pytest.mark.cuda
@pytest.mark.parametrize("sp,dtype", [(spec(), torch.float32),
                                      (spec(scaling="per_token", rounding="sr"), torch.bfloat16),
                                      (spec(rounding="sr", rht=True, amax_scale=1.5), torch.float16),
                                      (spec(scaling="per_token", rounding="sr", rht=True), torch.bfloat16)],
                         ids=idfn)
def test_cuda_quantize(sp, dtype, device):
    x = rand((16400, 4112), dtype, device=device, seed=7)
    check_pair(x, sp, sp, seed=5, row_offset=1000, col_offset=7, signs=signs_for())


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cuda_2d_zero_tiny_and_nonfinite(device):
    w = rand((4112, 16400), device=device, seed=8)
    wq, wtq = quantize_2d(w)
    ref = R.quantize(w, spec(block="2d"))
    assert_same(wq, ref)
    assert_same(wtq, R.transpose_2d(ref))
    assert_inner_equals(quantize_2d(w, inner=True, write_wt=False)[0], ref)
    x = rand((1024, 2048), torch.float32, device=device, seed=3)
    x[5] = 0
    for t in (x * 1e-37, x * 1e-31, x):
        check_pair(t, spec(), spec(scaling="per_token", rounding="sr"), seed=2)
    x[100, 200] = float("inf")
    x[300, 5] = float("nan")
    for sp in (spec(), spec(scaling="per_token")):  # CUDA NaNs are canonical: exact here
        assert_same(quantize_1d(x, sp)[0], R.quantize(x, sp))


@pytest.mark.cuda
def test_cuda_two_gigaelement_matrix(device):
    """A matrix of 2**31 elements or more (131072 x 16400 bf16) is addressed with int64 offsets by
    the amax, quantize (pair, rowwise-only, 2d, inner values) and dequantize kernels. Per-token
    copies make rows, and for the columnwise copy columns, independent, and 2d blocks take the
    global amax, so slices at the far end are checked against the reference."""
    from nvfp4_recipe.kernels.amax import amax
    from nvfp4_recipe.kernels.dequantize import dequantize_inner
    x = torch.randn(131072, 16400, dtype=torch.bfloat16, device=device)
    x[-1, -1] = 1000.0  # the largest magnitude, past element 2**31
    assert amax(x)[0].item() == 1000.0
    sp = spec(scaling="per_token")
    tail = lambda op, n=16: op._replace(qdata=op.qdata[-n:], scale=op.scale[-n:],
                                        outer_scale=op.outer_scale[-n:])
    r, c = quantize_1d(x, sp, sp, inner=(True, False))
    assert_inner_equals(r._replace(values=r.values[-16:], outer_scale=r.outer_scale[-16:]),
                        R.quantize(x[-16:], sp))
    assert_same(tail(c), R.quantize(x[:, -16:].t(), sp))
    del r, c
    q = quantize_1d(x, sp)[0]
    assert_same(tail(q), R.quantize(x[-16:], sp))
    inner = dequantize_inner(q, torch.float16)
    assert torch.equal(inner[-16:].float(), R.dequantize_inner(tail(q)))
    del q, inner
    w2, wt2 = quantize_2d(x)
    g = amax(x)[0]
    assert_same(w2._replace(qdata=w2.qdata[-16:], scale=w2.scale[-1:]),
                R.quantize(x[-16:], spec(block="2d"), amax_=g))
    assert_same(wt2._replace(qdata=wt2.qdata[-16:], scale=wt2.scale[-1:]),
                R.transpose_2d(R.quantize(x[:, -16:], spec(block="2d"), amax_=g)))


@pytest.mark.cuda
def test_cuda_graph_replay_advances_offset(device):
    """Seeds and offsets read from device tensors: a captured graph replays with new offsets."""
    _, row, col = recipe_pairs()[1]
    x = rand((1024, 2048), device=device, seed=9)
    seed = torch.tensor(42, device=device)
    off = torch.tensor(0, device=device)
    signs = signs_for().to(device)
    quantize_1d(x, row, col, seed=seed, row_offset=off, col_offset=off, signs=signs)  # compile first
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = quantize_1d(x, row, col, seed=seed, row_offset=off, col_offset=off, signs=signs)
    for step in (3, 10):
        off.fill_(step * 2**20)
        graph.replay()
        ref = reference_pair(x, row, col, 42, step * 2**20, step * 2**20, signs)
        assert_same(out[0], ref[0])
        assert_same(out[1], ref[1])
