"""The numerics spec (docs/numerics.md) in reference.py: TransformerEngine's NVFP4 chain, checked
against an independent implementation of it (tests/te_nvfp4.py), torchao 0.18 and first principles."""

import math

import pytest
import torch
import triton
import triton.language as tl
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

import te_nvfp4 as TE
from nvfp4_recipe import formats as F
from nvfp4_recipe import reference as R
from nvfp4_recipe.backends.reference import ReferenceBackend
from nvfp4_recipe.formats import E2M1_GRID
from nvfp4_recipe.recipe import NVFP4Recipe
from nvfp4_recipe.spec import GemmRole, QuantSpec


def spread(shape, dtype=torch.float32, lo=-6, hi=4, seed=0):
    """Random values whose block magnitudes span 10**lo .. 10**hi (each block of 16 along the last
    dim its own magnitude, times a per-element spread of 2**-3 .. 2**3), with zero blocks."""
    g = torch.Generator().manual_seed(seed)
    nb = shape[:-1] + (shape[-1] // 16,)
    blocks = 10 ** (torch.rand(nb + (1,), generator=g) * (hi - lo) + lo)
    spread_ = torch.exp2(torch.randint(-3, 4, nb + (16,), generator=g).float())
    x = torch.randn(shape, generator=g) * (blocks * spread_).reshape(shape)
    x.reshape(-1, 16)[torch.rand(x.numel() // 16, generator=g) < 0.05] = 0
    x.reshape(-1, shape[-1])[0, :16] = 0  # at least one zero block
    return x.to(dtype)


def assert_te_equal(d, codes, scale, s_dec, tile=(1, 16)):
    """Bitwise equality of a quantization with the TE oracle's: codes, E4M3 scales, decode scales
    and the dequantized values."""
    got = F.unpack_nibbles(d.qdata).reshape(codes.shape)
    assert torch.equal(got, codes), (got != codes).nonzero()[:5]
    assert torch.equal(d.scale.reshape(scale.shape).view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(d.outer_scale.reshape(s_dec.shape), s_dec)
    deq = R.dequantize(d).reshape(codes.shape)
    assert torch.equal(deq, TE.dequantize(codes, scale, s_dec, tile))


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SR = QuantSpec(rounding="sr")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_rn_1d_matches_transformer_engine(dtype, seed):
    """Per-tensor 1x16 RN: codes, block scales (E4M3 subnormals and zeros included) and outer
    scales equal TE's chain bit for bit, on block magnitudes 1e-6 .. 1e4 with zero blocks."""
    hi = 4 if dtype != torch.float16 else 3.5  # fp16 overflows past 65504
    x = spread((64, 256), dtype, hi=hi, seed=seed)
    d = R.quantize(x)
    assert_te_equal(d, *TE.quantize(x))
    nonzero = d.scale.float()[d.scale.float() > 0]
    assert (nonzero < 2**-6).any() and (d.scale.float() == 0).sum() > 16  # what TE keeps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rn_2d_matches_transformer_engine(dtype):
    x = spread((96, 160), dtype, lo=-3, hi=2, seed=3)
    assert_te_equal(R.quantize(x, QuantSpec(block="2d")), *TE.quantize(x, tile=(16, 16)), tile=(16, 16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rn_per_token_matches_transformer_engine(dtype):
    x = spread((48, 128), dtype, lo=-4, hi=2, seed=4)
    x[7] = 0  # an all-zero row: S_enc = FLT_MAX, zero codes
    d = R.quantize(x, QuantSpec(scaling="per_token"))
    assert_te_equal(d, *TE.quantize(x, row_scaled=True))
    assert torch.equal(R.dequantize(d)[7], torch.zeros(128))


def test_rht_operand_matches_transformer_engine_fp32():
    """The columnwise RHT operand (blocks along tokens) of fp32 inputs: TE's chain applied to the
    transformed operand, bit for bit (the transform itself is checked against its matrix below)."""
    x = spread((128, 48), lo=-3, hi=3, seed=5)
    signs = torch.tensor(TE.TE_SIGNS, dtype=torch.float32)
    d = R.quantize(x.t(), QuantSpec(rht=True), rht_signs=signs)
    assert_te_equal(d, *TE.quantize(R.rht(x.t(), signs)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("data", ["wide", "randn"])
def test_rht_operand_matches_transformer_engine_16bit(dtype, data):
    """16-bit inputs: the transform is rounded to the input dtype before its amax and quantization,
    as TE does. Our fp32 butterfly rounded to 16 bits equals the exact transform rounded once
    wherever the fp32 sums are exact and not a 16-bit rounding tie (a double rounding); the sums
    lose bits only where a block's values span more binades than fp32 holds beyond the 16-bit
    mantissa. Every mismatch must be one of those cases, and they must be rare, also on
    wide-range blocks (magnitudes 1e-3 .. 1e2 times 2**+-3 within each block)."""
    g = torch.Generator().manual_seed(6)
    x = (spread((512, 64), dtype, lo=-3, hi=2, seed=6) if data == "wide"
         else (torch.randn(512, 64, generator=g) * 3).to(dtype))
    signs = torch.tensor(TE.TE_SIGNS, dtype=torch.float32)
    ours, exact = R.rht(x.t(), signs), TE.rht(x.t())
    f = R.rht(x.t().float(), signs).double()  # the butterfly's fp32 values before rounding
    near = ours.double()
    other = 2 * f - near  # f is a tie iff its mirror image about f is the other 16-bit neighbour
    tie = (other.to(dtype).double() == other) & (other != near)
    diff = ours != exact
    assert torch.all((tie | (f != TE.rht(x.t().double())))[diff])
    assert diff.float().mean() < (1e-3 if data == "wide" else 1e-4)
    assert_te_equal(R.quantize(x.t(), QuantSpec(rht=True), rht_signs=signs), *TE.quantize(ours))


def test_sr_rule_matches_transformer_engine():
    """With explicit random bytes, the SR codes equal TE's floor rule on every value, including
    grid points, values past 6 and sums t that land exactly on a grid point."""
    g = torch.Generator().manual_seed(7)
    grid = torch.tensor(E2M1_GRID)
    lo = grid[torch.randint(0, 7, (2000,), generator=g)]
    k = torch.randint(1, 256, (2000,), generator=g)
    step = torch.where(lo < 2, 0.5, torch.where(lo < 4, 1.0, 2.0))
    edges = lo + k * step / 256  # with r = 256 - k, t lands exactly on the next grid point
    v = torch.cat([torch.empty(20000).uniform_(-7, 7, generator=g), grid, -grid, edges, -edges])
    r = torch.randint(0, 256, v.shape, generator=g)
    r[-4000:] = (256 - k).repeat(2)
    assert torch.equal(R.round_sr(v, r), TE.sr_codes(v, r))


def test_sr_quantize_matches_transformer_engine():
    """SR quantization of a tensor equals TE's chain fed with the same random bytes
    (``sr_bits``: one Philox call per 16 elements, element j of a word taking bits [8j, 8j + 8))."""
    x = spread((32, 128), lo=-3, hi=2, seed=8)
    bits = R.sr_bits(5, 77, x.shape)
    words = torch.stack(R.philox4x32(5, torch.arange(77, 77 + x.numel() // 16)), dim=-1)
    expect = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1)  # (n/16, 4, 4)
    assert torch.equal(bits.reshape(-1, 4, 4), expect)
    d = R.quantize(x, SR, seed=5, offset=77)
    assert_te_equal(d, *TE.quantize(x, sr_bits=bits))


def test_sr_expectation_bias_is_below_one_256th_of_a_step_toward_zero():
    """Over all 256 random bytes the SR mean is lo + step * floor(256 f) / 256 for |v| = lo + f step
    (the floor rule rounds up for r >= 256 (1 - f)): the bias is toward zero and below step / 256.
    Exhaustive over r, so exact (values with few mantissa bits keep t exact in fp32)."""
    g = torch.Generator().manual_seed(9)
    v = torch.empty(3000).uniform_(0, 6, generator=g)
    v = v - v % 2**-12
    r = torch.arange(256)
    codes = R.round_sr(v[:, None].expand(-1, 256), r[None].expand(len(v), -1))
    mean = F.e2m1_decode(codes).double().mean(1)
    vd = v.double()
    step = torch.where(vd < 2, 0.5, torch.where(vd < 4, 1.0, 2.0))
    lo = torch.floor(vd / step) * step
    assert torch.equal(mean, lo + step * torch.floor(256 * (vd - lo) / step) / 256)
    assert torch.all(mean <= vd) and torch.all(vd - mean < step / 256)


def test_sr_mean_converges_to_x():
    """Over N independent offsets the SR mean of an element with neighbours lo < v < hi has standard
    deviation at most (hi - lo) / (2 sqrt(N)) (a two-point distribution) and a bias toward zero
    below (hi - lo) / 256 (previous test); we require -5.5 sigma_max - bias <= |mean| - |v| <=
    5.5 sigma_max for every element (the chance that any of 1024 elements exceeds this is below
    1e-4 under the normal approximation)."""
    x = torch.randn(16, 64)
    n = 1000
    data = [R.quantize(x, SR, seed=11, offset=k * 64) for k in range(n)]
    mean = torch.stack([R.dequantize(d) for d in data]).mean(0)
    d0 = data[0]
    step_scale = d0.scale.float().repeat_interleave(16, 1) * d0.outer_scale
    target = torch.clamp(x / step_scale, -6, 6) * step_scale  # the block max may clamp at 6
    a = target.abs() / step_scale
    step = torch.where(a >= 4, 2.0, torch.where(a >= 2, 1.0, 0.5)) * step_scale
    sigma = step / (2 * math.sqrt(n))
    err = mean.abs() - target.abs()
    assert torch.all(err <= 5.5 * sigma + 1e-7)
    assert torch.all(err >= -5.5 * sigma - step / 256 - 1e-7)


def _e4m3_midpoints() -> torch.Tensor:
    v = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return (v[1:] + v[:-1]) / 2


def _near_boundary(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Where a and b (two fp32 roundings of the same exact value) lie within 4 ulps of one of the
    rounding ``bounds`` or on opposite sides of it."""
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    ulp = 4 * (torch.nextafter(hi, torch.tensor(float("inf"))) - hi)
    return ((bounds >= (lo - ulp)[..., None]) & (bounds <= (hi + ulp)[..., None])).any(-1)


def test_torchao_018_agrees_where_no_subnormal_scale_and_no_tie():
    """torchao 0.18's inference quantizer (``nvfp4_quantize(x, 16, amax / 2688)``) computes the
    block scale as (block_amax / 6) / s_outer clamped below at 2**-6 and the values as
    x / (s_outer * scale): equal to TE's chain in exact arithmetic, so the two agree except in
    blocks whose TE scale is below 2**-6 (torchao clamps it) and where their different fp32
    roundings straddle an E4M3 or E2M1 rounding boundary (a tie). We exclude exactly those blocks
    and require equality elsewhere, and that ties are rare where no scale is subnormal."""
    for x in (spread((64, 256), lo=-3, hi=3, seed=10), torch.randn(64, 256) * 3):
        amax = x.abs().amax()
        t_scale, t_q = nvfp4_quantize(x, 16, amax / 2688)
        d = R.quantize(x)
        blocks = x.reshape(64, 16, 16)
        bamax = blocks.abs().amax(-1)
        s_enc = R.encode_scale(amax)
        ours = bamax * (s_enc * (1 / 6))  # the fp32 values each chain rounds to E4M3
        theirs = (bamax / 6) / (amax / 2688)
        tie = _near_boundary(ours, theirs, _e4m3_midpoints())
        scaled = (blocks * R.value_scales(d.scale, R.decode_scale(s_enc))[..., None]).abs()
        t_scaled = (blocks / ((amax / 2688) * t_scale.float().reshape(64, 16, 1))).abs()
        thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        tie |= _near_boundary(scaled, t_scaled, thresholds).any(-1)
        keep = (d.scale.float() >= 2**-6) & ~tie
        assert torch.equal(d.scale.view(torch.uint8)[keep], t_scale.view(torch.uint8)[keep])
        codes = F.unpack_nibbles(d.qdata).reshape(64, 16, 16)
        assert torch.equal(codes[keep], F.unpack_nibbles(t_q).reshape(64, 16, 16)[keep])
        if (d.scale.float() >= 2**-6).all():  # normal data: nearly every block agrees
            assert tie.float().mean() < 0.05
        else:
            assert keep.float().mean() > 0.5


def test_all_zero_tensor_gives_zero_codes_and_finite_scales():
    d = R.quantize(torch.zeros(32, 64))
    assert torch.all((d.qdata & 0x77) == 0) and torch.all(d.scale.float() == 0)
    assert d.outer_scale == 1 / torch.tensor(F.FLT_MAX)  # S_enc = FLT_MAX: finite
    assert torch.equal(R.dequantize(d), torch.zeros(32, 64))


def test_zero_rows_per_token():
    x = torch.randn(32, 64)
    x[3] = 0
    d = R.quantize(x, QuantSpec(scaling="per_token"))
    assert torch.all(torch.isfinite(d.scale.float())) and torch.all(torch.isfinite(d.outer_scale))
    assert torch.all(R.dequantize(d)[3] == 0)


@pytest.mark.parametrize("scale", [1e-36, 1e-40, 3e-44])
def test_small_amax_is_well_defined(scale):
    """Below amax ~ 8e-36, S_enc saturates at FLT_MAX (TE's guard): the block scales then use less of
    E4M3's range, but the result is defined and equals TE's chain bit for bit; while the inputs
    keep full fp32 precision the values keep their usual accuracy."""
    x = torch.randn(32, 64) * scale
    d = R.quantize(x)
    assert_te_equal(d, *TE.quantize(x))
    assert d.outer_scale == 1 / torch.tensor(F.FLT_MAX)
    if scale > 1e-38:
        assert (R.dequantize(d).double() - x.double()).norm() / x.double().norm() < 0.2


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
def test_non_finite_input_propagates(bad, scaling):
    """The one deliberate difference from TE: a NaN or Inf makes the outer scale and everything
    computed from that tensor (per-token: that row) non-finite, where TE maps an Inf amax to
    S_enc = 1 and saturates the Inf (finite codes and outputs that hide the overflow)."""
    x = torch.randn(32, 64)
    x[5, 7] = bad
    d = R.quantize(x, QuantSpec(scaling=scaling))
    deq = R.dequantize(d)
    assert not torch.isfinite(deq[5]).any()
    if scaling == "per_token":
        assert torch.isfinite(deq[torch.arange(32) != 5]).all()
    y = R.scaled_mm(d, R.quantize(torch.randn(16, 64)))
    assert not torch.isfinite(y[5]).any()
    codes, scale, s_dec = TE.quantize(x, row_scaled=scaling == "per_token")
    te = TE.dequantize(codes, scale, s_dec)
    if math.isnan(bad):
        assert not torch.isfinite(te[5]).all()
    else:  # TE: finite everywhere, the Inf saturated to the largest E2M1 x E4M3 value
        row_dec = s_dec.reshape(-1)[5] if s_dec.dim() else s_dec
        assert torch.isfinite(te).all() and te[5, 7].abs() == 6 * 448 * row_dec


def test_2d_blocks_share_one_scale_per_tile_and_transpose_exactly():
    w = spread((48, 64), lo=-3, hi=2)
    d = R.quantize(w, QuantSpec(block="2d"))
    assert d.scale.shape == (3, 4)
    deq = R.dequantize(d)
    dt = R.transpose_2d(d)
    assert dt.qdata.shape == (64, 24)
    assert torch.equal(R.dequantize(dt), deq.t())
    _, expect, _ = TE.quantize(w, tile=(16, 16))
    assert torch.equal(d.scale.view(torch.uint8), expect.view(torch.uint8))


def test_per_token_mm_matches_the_factored_formula():
    a = spread((32, 64), lo=-2, hi=2, seed=1)
    b = spread((48, 64), lo=-2, hi=2, seed=2)
    qa, qb = R.quantize(a, QuantSpec(scaling="per_token")), R.quantize(b, QuantSpec(scaling="per_token"))
    assert qa.outer_scale.shape == (32,) and qb.outer_scale.shape == (48,)
    assert torch.equal(qa.outer_scale, R.decode_scale(R.encode_scale(a.abs().amax(1))))
    d = R.scaled_mm(qa, qb)
    ia = R.dequantize_inner(qa).double()
    ib = R.dequantize_inner(qb).double()
    expect = qa.outer_scale.double()[:, None] * qb.outer_scale.double()[None, :] * (ia @ ib.t())
    # fp32 accumulation of 64 exact products: relative error below 64 * 2**-24 of sum |a_k b_k|
    bound = 64 * 2**-24 * (qa.outer_scale.double()[:, None] * qb.outer_scale.double()[None, :]
                           * (ia.abs() @ ib.abs().t())) + 1e-30
    assert torch.all((d.double() - expect).abs() <= bound)


# ------------------------------------------------------------------------------------ SR
@triton.jit
def _randint4x_kernel(out_ptr, seed, offset, N: tl.constexpr):
    i = tl.arange(0, N)
    r0, r1, r2, r3 = tl.randint4x(seed, (offset + i).to(tl.uint32))
    tl.store(out_ptr + i * 4, r0.to(tl.int64) & 0xFFFFFFFF)  # no enumerate in compiled Triton
    tl.store(out_ptr + i * 4 + 1, r1.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + i * 4 + 2, r2.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + i * 4 + 3, r3.to(tl.int64) & 0xFFFFFFFF)


def test_philox_equals_triton_randint4x(kernel_device):
    seed, offset = (123 << 32) + 987654321, 2**32 - 40  # also wraps the 32-bit counter
    out = torch.empty(64 * 4, dtype=torch.int64, device=kernel_device)
    _randint4x_kernel[(1,)](out, seed, offset, 64)
    ref = torch.stack(R.philox4x32(seed, (torch.arange(64) + offset) % 2**32), dim=-1).reshape(-1)
    assert torch.equal(out.cpu(), ref)


def test_sr_is_deterministic_per_seed_and_offset():
    x = torch.randn(32, 64)
    a = R.quantize(x, SR, seed=3, offset=100)
    b = R.quantize(x, SR, seed=3, offset=100)
    c = R.quantize(x, SR, seed=3, offset=101)
    d = R.quantize(x, SR, seed=4, offset=100)
    assert torch.equal(a.qdata, b.qdata)
    assert not torch.equal(a.qdata, c.qdata) and not torch.equal(a.qdata, d.qdata)
    assert torch.equal(a.scale.view(torch.uint8), c.scale.view(torch.uint8))


# ------------------------------------------------------------------------------------ RHT
def test_rht_is_orthogonal_and_matches_the_matrix():
    signs = NVFP4Recipe().signs()
    m = signs[:, None] * R.hadamard16() / 4  # diag(signs) @ H16 / 4
    assert torch.allclose(m @ m.t(), torch.eye(16), atol=0)
    x = torch.randn(8, 64)
    y = R.rht(x, signs)
    assert torch.allclose(y, (x.reshape(-1, 16) @ m).reshape(8, 64), rtol=1e-6, atol=1e-6)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-5)


def test_wgrad_with_rht_equals_wgrad_without_when_quantization_is_bypassed():
    dy, x = torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 48, dtype=torch.float64)
    signs = torch.tensor(NVFP4Recipe(rht_signs=(1, -1) * 8).rht_signs, dtype=torch.float32)
    a, b = R.rht(dy.t().float(), signs), R.rht(x.t().float(), signs)  # blocks along tokens
    assert torch.allclose((a.double() @ b.double().t()), dy.t() @ x, rtol=1e-5, atol=1e-5)


def test_amax_estimation_changes_only_the_outer_scale():
    x = torch.randn(64, 32)
    signs = NVFP4Recipe().signs()
    measured = NVFP4Recipe().spec(GemmRole.X_WGRAD)
    estimated = NVFP4Recipe(amax_estimation=(2.0, 1.0)).spec(GemmRole.X_WGRAD)
    assert estimated == measured.__class__(**{**measured.__dict__, "amax_scale": 2.0})
    backend = ReferenceBackend()
    est = backend.quantize(x, estimated, signs=signs)
    assert torch.equal(est.outer_scale, R.decode_scale(R.encode_scale(2.0 * x.abs().amax())))
    meas = backend.quantize(x, measured, signs=signs)
    assert torch.equal(meas.outer_scale, R.decode_scale(R.encode_scale(R.rht(x, signs).abs().amax())))
    same = R.quantize(x, QuantSpec(rht=True), rht_signs=signs, amax_=2.0 * x.abs().amax())
    assert torch.equal(est.qdata, same.qdata) and torch.equal(est.scale.view(torch.uint8), same.scale.view(torch.uint8))
    for role in (GemmRole.X_FPROP, GemmRole.W_FPROP, GemmRole.DY_DGRAD):
        assert NVFP4Recipe(amax_estimation=(2.0, 1.0)).spec(role) == NVFP4Recipe().spec(role)


# ------------------------------------------------------------------------------------ errors
def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="multiple of 16"):
        R.quantize(torch.randn(4, 24))
    with pytest.raises(TypeError, match="int32"):
        R.quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="rounding"):
        QuantSpec(rounding="up")
    with pytest.raises(ValueError, match="2d"):
        R.quantize(torch.randn(8, 32), QuantSpec(block="2d"))
    with pytest.raises(ValueError, match="per_token"):
        QuantSpec(block="2d", scaling="per_token")
    with pytest.raises(ValueError, match="K mismatch"):
        R.scaled_mm(R.quantize(torch.randn(16, 32)), R.quantize(torch.randn(16, 64)))
