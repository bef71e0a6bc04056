"""4/6 block scaling (docs/numerics.md item 11): the reference equals TransformerEngine's chain
(tests/te_nvfp4.py, an independent transcription) bit for bit, and the project's extensions (RHT,
SR) keep their promises."""

import inspect
import math

import pytest
import torch

import te_nvfp4 as TE
from nvfp4_recipe import reference as R
from nvfp4_recipe.recipe import NVFP4Recipe
from nvfp4_recipe.spec import FOUR_OVER_SIX_DEFAULT_E4M3_MAX, FourOverSix, QuantSpec
from nvfp4_recipe.tensor import NVFP4Tensor

from nvfp4_cases import rand, signs_for

FOS = [FourOverSix(err, bound, fast) for err in ("mae", "mse") for bound in (256, 448)
       for fast in (False, True)]


def fos_id(f):
    return f"{f.error}-{f.e4m3_max}{'-fast' if f.fast_math else ''}"


def te_4over6(x, fos, tile=(1, 16), row_scaled=False, **kw):
    return TE.quantize_4over6(x, tile, row_scaled, err_mode=fos.error.value.upper(),
                              fast_math=fos.fast_math, e4m3_max=fos.e4m3_max, **kw)


def assert_te(op, codes, scale, s_dec):
    assert torch.equal(R.unpack_nibbles(op.qdata), codes)
    assert torch.equal(op.scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(op.outer_scale, s_dec)


def fresh(shape, dtype):
    """rand() with a fresh seed (printed on failure by pytest's locals)."""
    return rand(shape, dtype, seed=int(torch.randint(0, 2**31, ())))


@pytest.mark.parametrize("fos", FOS, ids=fos_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block,scaling", [("1d", "per_tensor"), ("2d", "per_tensor"),
                                           ("1d", "per_token")])
def test_rn_matches_transformer_engine(fos, dtype, block, scaling):
    x = fresh((64, 96), dtype)
    op = R.quantize(x, QuantSpec(block, scaling, four_over_six=fos))
    assert_te(op, *te_4over6(x, fos, (16, 16) if block == "2d" else (1, 16), scaling == "per_token"))


def grid_blocks(n, seed):
    """Blocks of values a few E2M1/E4M3 steps apart (k * 2**e for small k): the two candidates'
    errors tie often, exactly or within rounding; a zero block and a block of one value too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-12, 13, (n, 16), generator=g).float()
    x = x * torch.exp2(torch.randint(-3, 3, (n, 1), generator=g).float())
    x[0] = 0.0
    x[1] = 3.0
    return x.reshape(-1, 64)


@pytest.mark.parametrize("fos", FOS, ids=fos_id)
def test_ties_and_zero_blocks_match_transformer_engine(fos):
    x = grid_blocks(4096, int(torch.randint(0, 2**31, ())))
    op = R.quantize(x, QuantSpec(four_over_six=fos))
    assert_te(op, *te_4over6(x, fos))
    assert op.scale.float()[0, 0] == 0  # the zero block: zero scale, zero codes
    assert torch.all(R.unpack_nibbles(op.qdata)[0, :16] == 0)


def test_ties_go_to_map_to_6():
    """Per token, bound 256 (S_enc = 1536 / amax, so base = 256 * block amax / row amax): a block
    both candidates hold exactly (6, 3, 1.5 are on the grid and 1.5 x the grid; errors 0 and 0)
    keeps map-to-6 (scale 256); one only map-to-4 holds (4, 3, 2, 1) takes it (scale 384)."""
    x = torch.zeros(2, 16)
    x[0, :4] = torch.tensor([6.0, 3.0, 1.5, 0.0])
    x[1, :4] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    op = R.quantize(x, QuantSpec(scaling="per_token", four_over_six=FourOverSix(e4m3_max=256)))
    assert op.scale.float()[:, 0].tolist() == [256.0, 384.0]
    assert_te(op, *te_4over6(x, FourOverSix(e4m3_max=256), row_scaled=True))


def test_outer_scale_uses_the_4_over_6_bound():
    x = fresh((32, 64), torch.float32)
    amax = x.abs().amax()
    for bound in (256, 448):
        op = R.quantize(x, QuantSpec(four_over_six=FourOverSix(e4m3_max=bound)))
        assert op.outer_scale == torch.tensor(1.0) / (torch.tensor(6.0 * bound) / amax)


def test_fast_math_changes_near_ties():
    """The fast-math error (on the scaled values) rounds differently: on blocks built so that
    the two candidates' errors tie in x's domain, some choices differ."""
    x = grid_blocks(8192, 1) * 1.1  # values off the power-of-two grid
    a = R.quantize(x, QuantSpec(four_over_six=FourOverSix(e4m3_max=448)))
    b = R.quantize(x, QuantSpec(four_over_six=FourOverSix(e4m3_max=448, fast_math=True)))
    assert not torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


def test_rht_operand_is_quantized_with_4_over_6_after_the_transform():
    x, signs = fresh((48, 64), torch.bfloat16), signs_for()
    fos = FourOverSix("mse", 256)
    op = R.quantize(x, QuantSpec(rht=True, four_over_six=fos), rht_signs=signs)
    assert_te(op, *te_4over6(TE.rht(x, tuple(signs.int().tolist())), fos))


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_sr_rounds_under_the_scale_rn_chose(block):
    """SR with 4/6: the candidate is chosen by its RN error, then the block is rounded
    stochastically under it (TE's SR rule, the same Philox bits)."""
    x, fos = fresh((32, 64), torch.bfloat16), FourOverSix("mae", 448)
    op = R.quantize(x, QuantSpec(block, rounding="sr", four_over_six=fos), seed=3, offset=9)
    rn = R.quantize(x, QuantSpec(block, four_over_six=fos))
    assert torch.equal(op.scale.view(torch.uint8), rn.scale.view(torch.uint8))
    codes, _, _ = te_4over6(x, fos, (16, 16) if block == "2d" else (1, 16),
                            sr_bits=R.sr_bits(3, 9, x.shape))
    assert torch.equal(R.unpack_nibbles(op.qdata), codes)


def test_sr_with_4_over_6_is_unbiased():
    """The mean of N SR draws converges to x (clamped to 6 x its scale) under both candidates: per
    element, SR's bias toward zero is below step/256 and its standard deviation at most step/2,
    so |mean - x| < step/256 + 6 step / (2 sqrt(N)) (a 6-sigma bound). The N draws are N copies
    of x as rows of one per-token operand (the same scales, fresh Philox bits per row)."""
    x = torch.randn(1, 64) * 0.5
    x[0, :16] = torch.tensor([4.0, 3.3, 2.2, 1.1] * 4)  # the row's amax; map-to-4 wins (scale 384)
    fos, n = FourOverSix("mse", 256), 4000
    rn = R.quantize(x, QuantSpec(scaling="per_token", four_over_six=fos))
    draws = R.dequantize(R.quantize(x.expand(n, 64), QuantSpec("1d", "per_token", "sr", four_over_six=fos),
                                    seed=int(torch.randint(0, 2**31, ())), offset=0))
    scale = R.expand_scale(rn.scale, rn.block).repeat_interleave(16, -1) * rn.outer_scale
    target = torch.maximum(torch.minimum(x, 6 * scale), -6 * scale)
    a = target.abs() / scale
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)) * scale
    assert torch.all((draws.mean(0) - target).abs() <= step / 256 + 6 * step / (2 * math.sqrt(n)))
    assert rn.scale.float()[0, 0] == 384


def test_from_hp_takes_the_4_over_6_arguments():
    x = fresh((32, 64), torch.bfloat16)
    t = NVFP4Tensor.from_hp(x, scaling="per_token", four_over_six="mse", four_over_six_e4m3_max=256,
                            four_over_six_fast_math=True, backend="reference")
    fos = FourOverSix("mse", 256, True)
    assert torch.equal(t.dequantize(torch.float32),
                       R.dequantize(R.quantize(x, QuantSpec(scaling="per_token", four_over_six=fos))))
    with pytest.raises(ValueError, match="from_hp: four_over_six:"):
        NVFP4Tensor.from_hp(x, four_over_six="max")
    with pytest.raises(ValueError, match="from_hp: four_over_six_e4m3_max:"):
        NVFP4Tensor.from_hp(x, four_over_six="mae", four_over_six_e4m3_max=512)
    with pytest.raises(ValueError, match="four_over_six=None"):
        NVFP4Tensor.from_hp(x, four_over_six_e4m3_max=448)  # 256 is the default: no error


@pytest.mark.parametrize("sp", [QuantSpec("2d", four_over_six=FourOverSix("mse", 256)),
                                QuantSpec(scaling="per_token", four_over_six=FourOverSix("mae", 448))],
                         ids=["2d", "1d-per_token"])
def test_triton_backend_quantizes_transposed_views_as_the_reference(sp, kernel_device):
    """A transposed view is read through its base; with 4/6 the 2d tiles of x.t() are not the
    transpose of x's (a tile's row errors add in another order), so they are quantized as x.t()."""
    x = fresh((64, 48), torch.bfloat16).to(kernel_device).t()
    t = NVFP4Tensor.from_hp(x, block=sp.block.value, scaling=sp.scaling.value,
                            four_over_six=sp.four_over_six.error.value,
                            four_over_six_e4m3_max=sp.four_over_six.e4m3_max, backend="triton")
    ref = R.quantize(x, sp)
    assert torch.equal(t.qdata, ref.qdata)
    assert torch.equal(t.scale.view(torch.uint8), ref.scale.view(torch.uint8))


def test_the_three_4_over_6_bound_defaults_agree():
    """FourOverSix(), NVFP4Recipe and from_hp default to one bound, 256 (the paper's), and a
    from_hp call without a bound quantizes as the recipe's 4/6 operands do."""
    from_hp_default = inspect.signature(NVFP4Tensor.from_hp).parameters["four_over_six_e4m3_max"]
    assert FOUR_OVER_SIX_DEFAULT_E4M3_MAX == 256
    assert FourOverSix().e4m3_max == NVFP4Recipe().four_over_six_e4m3_max == 256
    assert from_hp_default.default == 256
    assert NVFP4Recipe(four_over_six="all").spec("x_fprop").four_over_six == FourOverSix()
    x = fresh((32, 64), torch.float32)
    t = NVFP4Tensor.from_hp(x, four_over_six="mae", backend="reference")
    op = R.quantize(x, QuantSpec(four_over_six=FourOverSix("mae", 256)))
    assert torch.equal(t.qdata, op.qdata) and torch.equal(t.scale.view(torch.uint8), op.scale.view(torch.uint8))
    assert t.outer_scale == torch.tensor(1.0) / (torch.tensor(6.0 * 256) / x.abs().amax())
