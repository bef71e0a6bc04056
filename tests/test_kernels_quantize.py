"""The Triton quantization kernels (``triton`` backend) are bit-exact with the reference backend.

CPU tests run the kernels under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
without a GPU) on small ragged shapes; ``cuda`` tests run them compiled on larger ones.
"""

import pytest
import torch
import triton
import triton.language as tl

from nvfp4_recipe import reference as R
from nvfp4_recipe.backends import Backend, get_backend
from nvfp4_recipe.formats import E2M1_GRID, e2m1_encode_rn
from nvfp4_recipe.kernels import amax as A
from nvfp4_recipe.kernels import common as C
from nvfp4_recipe.kernels.quantize import Inner, quantize_1d
from nvfp4_recipe import triton_backend as TB
from nvfp4_recipe.recipe import NVFP4Recipe, OperandSpec

REF = Backend()


def triton_backend(device):
    return get_backend("triton", torch.device(device))


def rand(shape, dtype=torch.bfloat16, device="cpu", seed=0):
    """Random values over many magnitudes (per row and per element), with exact zeros,
    a zero 16x16 tile and values that hit E2M1 grid points exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x * torch.exp2(torch.randint(-12, 12, shape[:-1] + (1,), generator=g).float())
    x = x * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
    x[torch.rand(shape, generator=g) < 0.02] = 0.0
    x[..., :16, 16:32] = 0.0
    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0])
    x.view(-1, 16)[3, :8] = grid  # a block whose values are exactly on the E2M1 grid
    return x.to(dtype).to(device)


def signs_for(seed=3):
    return R.random_signs(torch.Generator().manual_seed(seed))


def assert_same(out: R.NVFP4Data, ref: R.NVFP4Data):
    """Bit-exact equality of two quantizations (a NaN outer scale equals a NaN)."""
    assert out.qdata.dtype == torch.uint8 and out.scale.dtype == torch.float8_e4m3fn
    assert out.outer_scale.dtype == torch.float32
    assert out.qdata.shape == ref.qdata.shape and out.scale.shape == ref.scale.shape
    assert out.outer_scale.shape == ref.outer_scale.shape
    assert torch.equal(out.qdata, ref.qdata), (out.qdata != ref.qdata).nonzero()[:5]
    assert torch.equal(out.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    nan = ref.outer_scale.isnan()
    assert torch.equal(out.outer_scale.isnan(), nan)
    assert torch.equal(out.outer_scale[~nan], ref.outer_scale[~nan])


def spec(block="1d", scaling="per_tensor", rounding="rn", rht=False, amax_scale=None):
    return OperandSpec(block, scaling, rounding, rht, amax_scale)


def idfn(v):
    """Short test ids without spaces (GPU runs split tests by id)."""
    if isinstance(v, OperandSpec):
        return v.encode().replace("|", "-")
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, tuple):
        return "x".join(map(str, v))
    return str(v)


# ------------------------------------------------------------------------------------- CPU
@triton.jit
def _round_kernel(v_ptr, r_ptr, out_ptr, n, SR: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + o, mask=o < n, other=0.0)
    r = tl.load(r_ptr + o, mask=o < n, other=0).to(tl.uint32)
    c, s = C.nibbles(v, r, SR)
    tl.store(out_ptr + o, (c - (C.SR_OFFSET if SR else C.RN_OFFSET) + s * 8).to(tl.int32), mask=o < n)


def rounding_cases(device="cpu"):
    """Values for the E2M1 rounding helpers: many magnitudes, both signs and zeros, the grid, its
    midpoints and their fp32 neighbours, values past 6, and SR sums t = |v| + (r / 256) * step
    that land exactly on a grid point, one or two ulps either side, and where the fp32 rounding of
    t itself decides (|v| with bits below t's ulp)."""
    g = torch.Generator().manual_seed(0)
    n = 4096
    mags = [torch.exp2(torch.empty(n).uniform_(-40, 3, generator=g)),
            torch.tensor(E2M1_GRID + (6.4, 6.49, 7.0, 1e30, 2.0**-140)),
            torch.tensor([(a + b) / 2 for a, b in zip(E2M1_GRID, E2M1_GRID[1:])])]
    r = torch.randint(0, 256, (n,), generator=g)
    for lo, hi in zip(E2M1_GRID, E2M1_GRID[1:]):
        mags.append((torch.tensor(hi) - (r[:256].double() / 256) * (hi - lo)).float())
    rounded = torch.arange(128, 192)  # 0.5 - r / 512 in (0.125, 0.25]: t's ulp is twice |v|'s
    mags.append((0.5 - rounded.double() / 512 - 2.0**-26).float())
    v = torch.cat(mags)
    v = torch.cat([v, torch.nextafter(v, torch.tensor(0.0)), torch.nextafter(v, torch.tensor(8.0)),
                   torch.nextafter(torch.nextafter(v, torch.tensor(8.0)), torch.tensor(8.0))])
    v = torch.cat([v, -v, torch.tensor([0.0, -0.0])])
    bits = torch.randint(0, 256, v.shape, generator=g)
    k = len(mags[0]) + len(mags[1]) + len(mags[2])
    hit = torch.cat([r[:256].repeat(7), rounded])  # the sums that land on a grid point
    for rep in range(8):  # the values, their neighbours, and all of them negated
        first = k + rep * (len(v) - 2) // 8
        bits[first:first + len(hit)] = hit
    bits[:16] = 0  # tiny values stay when r = 0
    return v.to(device), bits.to(torch.int32).to(device)


def check_rounding(device):
    v, bits = rounding_cases(device)
    for sr in (False, True):
        out = torch.empty(v.shape, dtype=torch.int32, device=device)
        _round_kernel[(triton.cdiv(v.numel(), 1024),)](v, bits, out, v.numel(), SR=sr, BLOCK=1024)
        ref = R.round_sr(v.cpu(), bits.cpu().long()) if sr else e2m1_encode_rn(v.cpu().clamp(-6, 6))
        out = out.cpu()
        bad = (out != ref.int()).nonzero()[:5, 0]
        assert bad.numel() == 0, (sr, v[bad], bits[bad], out[bad], ref[bad])


def test_rounding_helpers():
    check_rounding("cpu")


@triton.jit
def _philox_kernel(out_ptr, seed, offset, N: tl.constexpr):
    i = tl.arange(0, N)
    words = C.philox4x32(seed, (offset + i).to(tl.uint32))
    for w in tl.static_range(4):
        tl.store(out_ptr + i * 4 + w, words[w].to(tl.int64) & 0xFFFFFFFF)


def check_philox(device):
    """The kernels' Philox (64-bit products) gives ``reference.philox4x32``, the spec's stream."""
    for seed, offset in (((123 << 32) + 987654321, 2**32 - 40), (7, 0), (2**31 + 5, 12345)):
        out = torch.empty(64 * 4, dtype=torch.int64, device=device)
        _philox_kernel[(1,)](out, seed, offset, 64)
        ref = torch.stack(R.philox4x32(seed, (torch.arange(64) + offset) % 2**32), dim=-1)
        assert torch.equal(out.cpu(), ref.reshape(-1)), (seed, offset)


def test_philox():
    check_philox("cpu")


QUANTIZE_CASES = [
    # (spec, shape, dtype)
    (spec(), (48, 80), torch.bfloat16),
    (spec(scaling="per_token", rounding="sr"), (2, 24, 64), torch.bfloat16),
    (spec(rounding="sr", rht=True), (40, 48), torch.float32),  # rowwise RHT, M not a multiple of 16
    (spec(scaling="per_token", rht=True, amax_scale=1.37), (32, 48), torch.float16),
    (spec(block="2d"), (48, 80), torch.bfloat16),
    (spec(block="2d", rounding="sr", amax_scale=0.75), (32, 48), torch.float32),
]


@pytest.mark.parametrize("sp,shape,dtype", QUANTIZE_CASES, ids=idfn)
def test_quantize_matches_reference(sp, shape, dtype):
    x = rand(shape, dtype)
    kw = dict(seed=11, offset=5, rht_signs=signs_for())
    assert_same(triton_backend("cpu").quantize(x, sp, **kw), REF.quantize(x, sp, **kw))


@pytest.mark.parametrize("sp", [spec(), spec(scaling="per_token", rounding="sr")], ids=idfn)
def test_quantize_rowwise_loop_tail(sp):
    """Rowwise-only calls run the prefetch-loop kernel: several tiles per program, a program whose
    last tiles are partly or wholly past K, and M not a multiple of the tile height."""
    x = rand((40, 208), torch.bfloat16, seed=5)
    kw = dict(seed=3, offset=2**32 - 100, rht_signs=signs_for())  # the Philox counter wraps
    assert_same(triton_backend("cpu").quantize(x, sp, **kw), REF.quantize(x, sp, **kw))


@pytest.mark.parametrize("sp", [spec(rounding="sr", rht=True), spec(scaling="per_token"),
                                spec(block="2d")], ids=idfn)
def test_quantize_transposed_view(sp):
    """``quantize(x.t())`` (the columnwise copy) reads x through the columnwise path."""
    x = rand((48, 64))
    kw = dict(seed=torch.tensor(7), offset=torch.tensor(2**31 + 9), rht_signs=signs_for())
    assert_same(triton_backend("cpu").quantize(x.t(), sp, **kw), REF.quantize(x.t(), sp, **kw))


def _recipe_pairs():
    r = NVFP4Recipe()
    est = NVFP4Recipe(amax_estimation=(2.0, 1.0))
    tok = NVFP4Recipe(scaling="per_token", stochastic_rounding=False)
    return [("x", r.operand("x_fprop"), r.operand("x_wgrad")),
            ("dy", r.operand("dy_dgrad"), r.operand("dy_wgrad")),
            ("x_estimated", est.operand("x_fprop"), est.operand("x_wgrad")),
            ("per_token_rht", tok.operand("dy_dgrad"), tok.operand("dy_wgrad"))]


@pytest.mark.parametrize("name,row,col", _recipe_pairs(), ids=[p[0] for p in _recipe_pairs()])
def test_quantize_pair_matches_reference(name, row, col):
    x = rand((48, 80), seed=1)
    kw = dict(seed=torch.tensor(123), row_offset=3, col_offset=2**31, rht_signs=signs_for())
    out = triton_backend("cpu").quantize_pair(x, row, col, **kw)
    ref = REF.quantize_pair(x, row, col, **kw)
    assert_same(out[0], ref[0])
    assert_same(out[1], ref[1])


def check_inner_copies(x, row, col, inner, **kw):
    """quantize_1d with the copies ``inner`` names written as inner values: those equal the
    dequantized reference codes exactly (fp16), the others the reference codes."""
    specs = [None if s is None else TB._copy_spec(s)._replace(inner=i)
             for s, i in ((row, inner[0]), (col, inner[1]))]
    out = quantize_1d(x, *specs, seed=kw["seed"], row_offset=kw["row_offset"],
                      col_offset=kw["col_offset"], signs=kw["rht_signs"])
    refs = (REF.quantize(x, row, kw["seed"], kw["row_offset"], kw["rht_signs"]) if row else None,
            REF.quantize(x.t(), col, kw["seed"], kw["col_offset"], kw["rht_signs"]) if col else None)
    for o, ref, is_inner in zip(out, refs, inner):
        if ref is None:
            continue
        if not is_inner:
            assert_same(TB._data(o), ref)
            continue
        assert o.values.dtype == torch.float16
        want = R.dequantize_inner(ref.qdata, ref.scale).to(o.values.device)
        assert torch.equal(o.values.float(), want), (o.values.float() != want).nonzero()[:5]
        assert torch.equal(o.outer_scale, ref.outer_scale.to(o.outer_scale.device))


@pytest.mark.parametrize("inner", [(True, True), (True, False), (False, True)], ids=idfn)
@pytest.mark.parametrize("name,row,col", _recipe_pairs(), ids=[p[0] for p in _recipe_pairs()])
def test_inner_copies_equal_dequantized_codes(name, row, col, inner):
    x = rand((48, 80), seed=4)
    check_inner_copies(x, row, col, inner, seed=torch.tensor(5), row_offset=7, col_offset=2**31,
                       rht_signs=signs_for())


@pytest.mark.parametrize("sp", [spec(), spec(scaling="per_token", rounding="sr")], ids=idfn)
def test_inner_rowwise_only(sp):
    """The rowwise-only (prefetch loop) kernel with inner values."""
    x = rand((40, 208), torch.float32, seed=6)
    check_inner_copies(x, sp, None, (True, False), seed=3, row_offset=9,
                       col_offset=0, rht_signs=signs_for())


@pytest.mark.parametrize("transposed", [False, True])
def test_gemm_operands_transient_copy_is_inner(transposed):
    """The backend hook NVFP4Linear uses: the transient copy comes back as inner values, the
    other as codes, both equal to the reference (a transposed view is read through its base)."""
    r = NVFP4Recipe()
    row, col = r.operand("dy_dgrad"), r.operand("dy_wgrad")
    x = rand((80, 48), seed=12).t() if transposed else rand((48, 80), seed=12)
    kw = dict(seed=torch.tensor(3), row_offset=1, col_offset=2**31, rht_signs=signs_for())
    a, at, none = triton_backend("cpu").gemm_operands(x, row, col, **kw, transient=(True, False))
    ref = REF.quantize_pair(x, row, col, **kw)
    assert isinstance(a, Inner) and isinstance(at, R.NVFP4Data) and none is None
    assert torch.equal(a.values.float(), R.dequantize_inner(ref[0].qdata, ref[0].scale))
    assert torch.equal(a.outer_scale, ref[0].outer_scale)
    assert_same(at, ref[1])


def check_dequantize_rider(x, b_shape, device="cpu"):
    """The dY pass of NVFP4Linear with X^T riding along (``quantize_1d(dequantize=...)``): the
    rider's values equal the dequantize pass's, bit for bit, and the pair equals the pair alone."""
    r = NVFP4Recipe()
    row, col = (TB._copy_spec(r.operand(role))._replace(inner=True)
                for role in ("dy_dgrad", "dy_wgrad"))
    b = TB._data(quantize_1d(rand(b_shape, seed=8, device=device), TB._copy_spec(spec()))[0])
    kw = dict(seed=torch.tensor(7, device=device), row_offset=3, col_offset=2**31,
              signs=signs_for().to(device))
    out = torch.full((b_shape[0], b_shape[1]), float("nan"), dtype=torch.float16, device=device)
    got = quantize_1d(x, row, col, **kw, dequantize=(b.qdata, b.scale, out))
    alone = quantize_1d(x, row, col, **kw)
    for g, a in zip(got, alone):
        assert torch.equal(g.values, a.values) and torch.equal(g.outer_scale, a.outer_scale)
    want = R.dequantize_inner(b.qdata.cpu(), b.scale.cpu())
    assert torch.equal(out.float().cpu(), want), (out.float().cpu() != want).nonzero()[:5]


@pytest.mark.parametrize("b_shape", [(40, 80), (112, 1024)], ids=idfn)
def test_dequantize_rides_on_the_pair(b_shape):
    """Ragged rider shapes (rows and K not multiples of the dequantize tile), fewer and more
    rider tiles than programs."""
    check_dequantize_rider(rand((48, 80), seed=4), b_shape)


def test_dequantize_rider_rejects_bad_input():
    x = rand((32, 32))
    b = TB._data(quantize_1d(rand((16, 32)), TB._copy_spec(spec()))[0])
    good = torch.empty(16, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="columnwise copy"):
        quantize_1d(x, TB._copy_spec(spec()), dequantize=(b.qdata, b.scale, good))
    with pytest.raises(ValueError, match=r"out must be \(16, 32\)"):
        quantize_1d(x, col=TB._copy_spec(spec()), dequantize=(b.qdata, b.scale, good.t()))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quantize_1d(x, col=TB._copy_spec(spec()), dequantize=(b.qdata, b.qdata, good))


@pytest.mark.parametrize("transposed,dgrad", [(False, True), (True, True), (False, False),
                                              (True, False)], ids=idfn)
def test_gemm_operands_prepares_b(transposed, dgrad):
    """gemm_operands(b=X^T) as linear_grads calls it: b's inner values, from the dY pass or (no
    columnwise copy in that launch) a dequantize pass, equal the dequantized codes; the copies
    equal the reference."""
    r = NVFP4Recipe()
    row, col = (r.operand("dy_dgrad") if dgrad else None), r.operand("dy_wgrad")
    x = rand((80, 48), seed=12).t() if transposed else rand((48, 80), seed=12)
    b = REF.quantize(rand((32, 80), seed=13), spec())
    kw = dict(seed=torch.tensor(3), row_offset=1, col_offset=2**31, rht_signs=signs_for())
    a, at, b_inner = triton_backend("cpu").gemm_operands(x, row, col, **kw, b=b)
    assert torch.equal(b_inner.values.float(), R.dequantize_inner(b.qdata, b.scale))
    assert b_inner.outer_scale is b.outer_scale
    ref = REF.quantize(x.t(), col, kw["seed"], kw["col_offset"], kw["rht_signs"])
    assert torch.equal(at.values.float(), R.dequantize_inner(ref.qdata, ref.scale))
    assert (a is None) != dgrad


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_quantize_weight_matches_reference(block):
    w = rand((32, 64), seed=2)
    sp = spec(block=block)
    out, ref = triton_backend("cpu").quantize_weight(w, sp), REF.quantize_weight(w, sp)
    assert_same(out[0], ref[0])
    assert_same(out[1], ref[1])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: Inf / NaN
@pytest.mark.parametrize("sp", [spec(), spec(scaling="per_token", rounding="sr")], ids=idfn)
def test_zero_tiny_and_huge(sp):
    """All-zero rows (s_outer = 0), a tensor so small that 1 / s_outer / scale overflows (the
    kernels' exact slow path), and one near the fp32 maximum."""
    x = rand((32, 48), torch.float32)
    x[5] = 0.0
    for t in (torch.zeros(32, 48), x, x * 1e-37, x * 1e-31, x * 1e33):
        kw = dict(seed=1, offset=0)
        assert_same(triton_backend("cpu").quantize(t, sp, **kw), REF.quantize(t, sp, **kw))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nonfinite_propagates():
    """An Inf or a NaN makes the amax, the outer scale and the blocks non-finite as in the
    reference. NaN sign bits are platform-defined (x86 and CUDA differ), so they are ignored."""
    x = rand((32, 48), torch.float32)
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[3, 7] = bad
        for sp in (spec(), spec(scaling="per_token", rounding="sr")):
            out = triton_backend("cpu").quantize(y, sp, seed=4)
            ref = REF.quantize(y, sp, seed=4)
            assert torch.equal(out.outer_scale.isnan(), ref.outer_scale.isnan())
            assert torch.equal(out.outer_scale.isinf(), ref.outer_scale.isinf())
            s, rs = out.scale.view(torch.uint8), ref.scale.view(torch.uint8)
            assert torch.equal(s & 0x7F, rs & 0x7F)
            nan_blocks = (rs & 0x7F) == 0x7F
            q, rq = out.qdata, ref.qdata
            assert torch.equal(q[~nan_blocks.repeat_interleave(8, -1)],
                               rq[~nan_blocks.repeat_interleave(8, -1)])
            assert torch.equal(q & 0x77, rq & 0x77)  # magnitudes everywhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=idfn)
@pytest.mark.parametrize("rht", [False, True])
def test_amax_kernel(rht, dtype):
    """9 tiles of 32 x 32 for 4 programs under the interpreter: the persistent grid's programs
    loop over several tiles and fold their maxima together."""
    x = rand((80, 96), dtype, seed=5)
    signs = signs_for()
    r, c = A.amax(x, A.PER_INDEX, A.PER_INDEX, rht, signs if rht else None)
    xt = R.rht(x.t(), signs) if rht else x.t().float()
    assert torch.equal(r, R.amax(x, "per_token"))
    assert torch.equal(c, R.amax(xt, "per_token"))
    r, c = A.amax(x, A.TENSOR, A.TENSOR, rht, signs if rht else None)
    assert torch.equal(r, R.amax(x, "per_tensor")) and torch.equal(c, R.amax(xt, "per_tensor"))


def check_rht_amax_nonfinite(device):
    """The RHT amax folds its last butterfly stage into |a| + |b|, which gives Inf where the
    transform has Inf - Inf = NaN: such programs recompute exactly, so the amaxes match the
    reference's (NaN where two Infs meet in the last stage, Inf for one Inf) in every column."""
    signs = signs_for()
    for rows in ((1, 9), (1,), (2, 3)):  # (1, 9): the last stage pairs elements j and j + 8
        x = rand((80, 96), torch.float32, seed=12)
        for r in rows:
            x[16 + r, 40] = float("inf")
        xt = R.rht(x.t(), signs)
        ref_c = R.amax(xt, "per_token")
        assert ref_c.isfinite().sum() == 95  # one non-finite column
        x, signs_d = x.to(device), signs.to(device)
        _, c = A.amax(x, A.NONE, A.PER_INDEX, True, signs_d)
        c = c.cpu()
        assert torch.equal(c.isnan(), ref_c.isnan()) and torch.equal(c.isinf(), ref_c.isinf())
        assert torch.equal(c[ref_c.isfinite()], ref_c[ref_c.isfinite()])
        _, c = A.amax(x, A.TENSOR, A.TENSOR, True, signs_d)
        ref = R.amax(xt, "per_tensor")
        assert c.isnan().item() == ref.isnan() and c.isinf().item() == ref.isinf()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_rht_amax_nonfinite():
    check_rht_amax_nonfinite("cpu")


def test_rejects_bad_input():
    be = triton_backend("cpu")
    with pytest.raises(TypeError, match="int32"):
        be.quantize(torch.ones(16, 16, dtype=torch.int32), spec())
    with pytest.raises(ValueError, match="multiple of 16"):
        be.quantize(torch.ones(16, 24), spec())
    with pytest.raises(ValueError, match="per_token"):
        be.quantize(torch.ones(16, 16), spec(block="2d", scaling="per_token"))
    with pytest.raises(TypeError, match="bfloat16"):
        A.amax(torch.ones(16, 16, dtype=torch.float64))


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.cuda
def test_cuda_rounding_helpers(device):
    check_rounding(device)


@pytest.mark.cuda
def test_cuda_philox(device):
    check_philox(device)


@pytest.mark.cuda
def test_cuda_rht_amax_nonfinite(device):
    check_rht_amax_nonfinite(device)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(16400, 4112), (256, 4096)], ids=idfn)
@pytest.mark.parametrize("name,row,col", _recipe_pairs(), ids=[p[0] for p in _recipe_pairs()])
def test_cuda_pair(shape, name, row, col, device):
    x = rand(shape, device=device, seed=6)
    kw = dict(seed=torch.tensor(99, device=device), row_offset=17, col_offset=2**31 + 1,
              rht_signs=signs_for().to(device))
    out = triton_backend(device).quantize_pair(x, row, col, **kw)
    ref = REF.quantize_pair(x, row, col, **kw)
    assert_same(out[0], ref[0])
    assert_same(out[1], ref[1])


@pytest.mark.cuda
@pytest.mark.parametrize("name,row,col", _recipe_pairs(), ids=[p[0] for p in _recipe_pairs()])
def test_cuda_inner_copies(name, row, col, device):
    x = rand((16400, 4112), device=device, seed=10)
    kw = dict(seed=torch.tensor(98, device=device), row_offset=5, col_offset=2**31 + 3,
              rht_signs=signs_for().to(device))
    check_inner_copies(x, row, col, (True, True), **kw)
    check_inner_copies(x, row, None, (True, False), **kw)


@pytest.mark.cuda
def test_cuda_dequantize_rider(device):
    """The rider at a gpu-preset wgrad shape (X^T 2048 x 8192: more rider tiles than programs)
    and a ragged one, with the GPU's inline-PTX dequantization."""
    x = rand((8192, 512), device=device, seed=11)
    check_dequantize_rider(x, (2048, 8192), device)
    check_dequantize_rider(x, (1000, 4112), device)


@pytest.mark.cuda
@pytest.mark.parametrize("sp,dtype", [(spec(), torch.float32), (spec(scaling="per_token", rounding="sr"), torch.bfloat16),
                                      (spec(rounding="sr", rht=True, amax_scale=1.5), torch.float16),
                                      (spec(block="2d"), torch.bfloat16)], ids=idfn)
def test_cuda_quantize(sp, dtype, device):
    x = rand((16400, 4112), dtype, device=device, seed=7)
    kw = dict(seed=5, offset=1000, rht_signs=signs_for().to(device))
    tb = triton_backend(device)
    assert_same(tb.quantize(x, sp, **kw), REF.quantize(x, sp, **kw))
    assert_same(tb.quantize(x.t(), sp, **kw), REF.quantize(x.t(), sp, **kw))


@pytest.mark.cuda
def test_cuda_weight_and_nonfinite(device):
    w = rand((4112, 16400), device=device, seed=8)
    for sp in (spec(block="2d"), spec()):
        out, ref = triton_backend(device).quantize_weight(w, sp), REF.quantize_weight(w, sp)
        assert_same(out[0], ref[0])
        assert_same(out[1], ref[1])
    w[100, 200] = float("inf")
    w[3000, 5] = float("nan")
    for sp in (spec(), spec(scaling="per_token")):  # CUDA NaNs are canonical: exact here
        assert_same(triton_backend(device).quantize(w, sp), REF.quantize(w, sp))


@pytest.mark.cuda
def test_cuda_graph_replay_advances_offset(device):
    """Seeds and offsets read from device tensors: a captured graph replays with new offsets."""
    r = NVFP4Recipe()
    row, col = r.operand("dy_dgrad"), r.operand("dy_wgrad")
    x = rand((1024, 2048), device=device, seed=9)
    seed = torch.tensor(42, device=device)
    off = torch.tensor(0, device=device)
    signs = signs_for().to(device)
    tb = triton_backend(device)
    tb.quantize_pair(x, row, col, seed, off, off + 2**31, signs)  # compile and autotune first
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = tb.quantize_pair(x, row, col, seed, off, off, signs)
    for step in (3, 10):
        off.fill_(step * 2**20)
        graph.replay()
        ref = REF.quantize_pair(x, row, col, 42, step * 2**20, step * 2**20, signs)
        assert_same(out[0], ref[0])
        assert_same(out[1], ref[1])
