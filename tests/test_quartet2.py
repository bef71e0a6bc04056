"""Quartet II's recipe (arXiv 2601.22813): 4/6 in fprop, MS-EDEN in dgrad and wgrad
(``NVFP4Recipe.backward_estimator="ms_eden"``, docs/recipe.md). The MS-EDEN rounding equals a
transcription of the reference code (tests/quartet2_ref.py) bit for bit given the same rotated
operand, amax and uniforms; the rotation and the forward's 4/6 agree with it within the tolerances
docs/recipe.md gives; dense layers and experts run the reference's backward; the estimator is
unbiased (statistically); the main job trains the recipe."""

import json
import types

import pytest
import torch
import torchao

import nvfp4_recipe as nr
import quartet2_ref as Q
from nvfp4_recipe import cli, gemms, moe, quantizers
from nvfp4_recipe import reference as R
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.layer import sr_key
from nvfp4_recipe.recipe import MS_EDEN_OFFSETS, ROTATION_SIGNS_OFFSET
from nvfp4_recipe.spec import (BackendName, BackwardEstimator, FourOverSix, GemmRole, MSEden,
                               QuantSpec, Rounding)
from nvfp4_recipe.train.config import RECIPES
from nvfp4_recipe.train.recipes import make_recipe

from nvfp4_cases import assert_fp32_products, assert_same_step, rand

QUARTET2 = RECIPES["nvfp4-quartet2"]
SPEC = QuantSpec(ms_eden=MSEden())
U = 2.0**-24
# the transcription's names of the backward's operands -> their roles' counters
COUNTERS = {"dy": MS_EDEN_OFFSETS[GemmRole.DY_DGRAD], "wt": MS_EDEN_OFFSETS[GemmRole.W_FPROP],
            "dyt": MS_EDEN_OFFSETS[GemmRole.DY_WGRAD], "xt": MS_EDEN_OFFSETS[GemmRole.X_WGRAD]}


def recipe(**fields) -> nr.NVFP4Recipe:
    return nr.NVFP4Recipe(**{**QUARTET2, "backend": "reference", **fields})


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31, ()))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


# ------------------------------------------------------------------------------ recipe and spec
def test_the_recipe_quantizes_fprop_with_4_over_6_and_the_backward_with_ms_eden():
    r = recipe(ms_eden_rotation=64)
    assert r.backward_estimator is BackwardEstimator.MS_EDEN and r.ms_eden_rotation == 64
    fos = FourOverSix("mse", 256)
    assert r.spec(GemmRole.X_FPROP) == QuantSpec(four_over_six=fos)
    assert r.spec(GemmRole.W_FPROP) == QuantSpec(four_over_six=fos)  # 1x16 weights
    for role in (GemmRole.DY_DGRAD, GemmRole.DY_WGRAD, GemmRole.X_WGRAD):
        assert r.spec(role) == QuantSpec(ms_eden=MSEden(64))
    assert "bwd-ms_eden(64)" in repr(nr.NVFP4Linear(16, 16, recipe=r))


@pytest.mark.parametrize("kwargs,field", [
    (dict(backward_estimator="eden"), "backward_estimator"),
    (dict(ms_eden_rotation=256), "ms_eden_rotation"),
    (dict(ms_eden_rotation=True), "ms_eden_rotation"),
    (dict(backward_estimator=None, ms_eden_rotation=64), "ms_eden_rotation"),
    (dict(rht=True), "rht"),
    (dict(stochastic_rounding=True), "stochastic_rounding"),
    (dict(scaling="per_token"), "scaling"),
    (dict(backward_override="dequantized"), "backward_override"),
    (dict(four_over_six="all"), "four_over_six")])
def test_invalid_combinations_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"NVFP4Recipe.{field}:"):
        recipe(**kwargs)


@pytest.mark.parametrize("field", ["block", "scaling", "rounding", "rht", "amax_scale",
                                   "four_over_six"])
def test_an_ms_eden_spec_takes_none_of_the_fields_it_replaces(field):
    other = dict(block="2d", scaling="per_token", rounding="sr", rht=True, amax_scale=2.0,
                 four_over_six=FourOverSix())[field]
    with pytest.raises(ValueError, match=f"takes no {field}"):
        QuantSpec(ms_eden=MSEden(), **{field: other})
    with pytest.raises(ValueError, match="rotation"):
        MSEden(rotation=48)


# ------------------------------------------------------------------------------ randomness
def test_signs_and_uniforms_are_philox_words_of_the_srs_layout():
    """The block uniforms are the top 24 bits of the word SR's first 4 elements of the block take
    (``sr_bits``, tested against Triton's ``tl.randint4x``); the signs are the bits of one call."""
    seed, offset = fresh_seed(), 1000
    u = R.block_uniforms(seed, offset, 64)
    b = R.sr_bits(seed, offset, (64, 16)).to(torch.int64)
    word = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
    assert torch.equal(u, (word >> 8).float() * U) and 0 <= u.min() and u.max() < 1
    words = torch.stack(R.philox4x32(seed, torch.tensor([offset])), -1)[0]
    signs = R.rotation_signs(seed, offset, 128)
    want = torch.tensor([1 - 2 * ((int(words[i // 32]) >> (i % 32)) & 1) for i in range(128)])
    assert torch.equal(signs, want.float())
    assert torch.equal(R.rotation_signs(seed, offset, 32), signs[:32])


def test_rotation_size_is_the_largest_power_of_two_dividing_the_dimension():
    assert [R.rotation_size(n, 128) for n in (0, 16, 48, 64, 96, 128, 384, 400)] == \
        [128, 16, 16, 64, 32, 128, 128, 16]
    assert R.rotation_size(256, 32) == 32


# ------------------------------------------------------------------------------ the rotation
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_rotation_is_the_reference_hadamard_product_to_fp32_rounding(d):
    """Ours is a fixed fp32 butterfly times fp32(d**-0.5) (docs/recipe.md); the reference's a
    matrix product (here exact, rounded once): they differ by at most (log2 d + 2) roundings of
    the group's sum of magnitudes / sqrt(d). The rotation is orthogonal: it inverts."""
    seed = fresh_seed()
    x = rand((64, 256), seed=seed)
    signs = R.rotation_signs(seed, 3, d)
    ours = R.hadamard_rotate(x, signs)
    want = Q.rotate(x, Q.rerotate(Q.hadamard_matrix(d), signs))
    group_sum = x.float().abs().reshape(-1, d).sum(-1, keepdim=True).expand(-1, d).reshape(x.shape)
    stages = d.bit_length() - 1
    assert ((ours - want).abs() <= (stages + 2) * U * group_sum / d ** 0.5).all()
    back = R.hadamard_rotate(ours, torch.ones(d)) * signs.repeat(256 // d)
    assert torch.allclose(back, x.float(), rtol=0, atol=1e-5 * x.float().abs().max().item())


# ------------------------------------------------------------------------------ MS-EDEN rounding
def operand(shape, seed, dtype=torch.bfloat16):
    """Fresh values over many magnitudes, a zero block, grid values and a zero rotation group."""
    x = rand(shape, dtype=dtype, seed=seed)
    x[-1, -128:] = 0
    return x


@pytest.mark.parametrize("rows,cols,d", [(32, 256, 128), (48, 128, 64), (16, 96, 32), (64, 48, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_ms_eden_round_is_the_reference_kernel_bit_for_bit(rows, cols, d, dtype):
    """Given the rotated operand, its amax and the uniforms, ``reference.ms_eden_round`` gives the
    codes, the rounded E4M3 scales, S_dec and the dequantized values of ``eden_1x16s_fp4_kernel``
    bit for bit (a zero's code is -0 in both)."""
    seed = fresh_seed()
    size = R.rotation_size(cols, d)
    y = R.hadamard_rotate(operand((rows, cols), seed, dtype), R.rotation_signs(seed, 0, size))
    amax = y.abs().max()
    u = R.block_uniforms(seed, 77, y.numel() // 16)
    codes, scale, s_dec = R.ms_eden_round(y, size, amax, u)
    fp4, ref_scale, ref_s_dec, ref_deq = Q.eden_kernel(y, size, amax, u)
    assert torch.equal(bits(R.e2m1_decode(codes)), bits(fp4))
    assert torch.equal(bits(scale), bits(ref_scale)) and torch.equal(bits(s_dec), bits(ref_s_dec))
    op = R.NVFP4Operand(R.pack_nibbles(codes), scale, s_dec, SPEC)
    assert torch.equal(bits(R.dequantize(op)), bits(ref_deq))


def test_the_scales_round_both_ways_and_the_corrections_differ_per_group():
    """The inputs of the bit-exact test exercise what the kernel does: scales rounded up and down
    from the same E4M3 value, corrections above and below 1, subnormal and replaced (1) scales."""
    x = operand((64, 256), 5)
    y = R.hadamard_rotate(x, R.rotation_signs(5, 0, 128))
    blocks = y.reshape(-1, 16)
    v_max = Q.f32(6 / Q.BACKWARD_SCALE_OVERRIDE)
    amax = y.abs().max()
    s_dec = amax / Q.f32(Q.SCALES_MAX_EDEN) / v_max
    sf = Q.to_e4m3(blocks.abs().amax(-1) / v_max / s_dec).float()
    codes, scale, _ = R.ms_eden_round(y, 128, amax, R.block_uniforms(5, 0, y.numel() // 16))
    moved = scale.float().reshape(-1) - torch.where(sf == 0, 1.0, sf)
    assert (moved > 0).any() and (moved < 0).any() and (moved == 0).any()
    assert (sf == 0).any() and (sf < 2**-6).any()
    zero_group = codes.reshape(-1, 128)[-1]
    assert (R.e2m1_decode(zero_group) == 0).all()


def test_an_all_zero_operand_quantizes_to_zeros_and_a_non_finite_one_stays_non_finite():
    signs = R.rotation_signs(1, 0, 128)
    op = R.quantize(torch.zeros(32, 128), SPEC, rht_signs=signs)
    assert torch.equal(op.outer_scale, torch.tensor(1.0)) and (R.dequantize(op) == 0).all()
    assert (op.scale.float() == 1).all()  # the reference's convention for zero scales
    x = torch.randn(32, 128)
    x[3, 5] = float("inf")
    op = R.quantize(x, SPEC, rht_signs=signs)
    assert not torch.isfinite(op.outer_scale) and not torch.isfinite(R.dequantize(op)).all()


def test_quantize_agrees_with_the_reference_rotation_and_kernel():
    """End to end (our butterfly against the reference's matrix product): the codes and E4M3
    scales of all but a few blocks (rounding near a threshold) and S_dec within 4 ulp."""
    seed = fresh_seed()
    x = operand((128, 512), seed)
    signs = R.rotation_signs(seed, 9, 128)
    ours = R.quantize(x, SPEC, seed=seed, offset=11, rht_signs=signs)
    y = Q.rotate(x, Q.rerotate(Q.hadamard_matrix(128), signs))
    fp4, scale, s_dec, _ = Q.eden_kernel(y, 128, y.abs().max(), R.block_uniforms(seed, 11, 4096))
    same = (R.e2m1_decode(R.unpack_nibbles(ours.qdata)) == fp4).reshape(-1, 16).all(-1) & (
        ours.scale.float().reshape(-1) == scale.reshape(-1))
    assert same.float().mean() >= 0.995
    assert abs(ours.outer_scale / s_dec - 1) <= 4 * U


def test_the_forward_4_over_6_agrees_with_quartet2s_forward():
    """The forward is TransformerEngine's 4/6 (MSE, bound 256; tests/test_four_over_six.py), not
    the reference's own arithmetic: S_dec as 1 / (1536 / amax) against amax / 256 / 6, the error
    of a candidate measured in another order, ties to even against ties away. They pick the same
    E4M3 scale for all but 1% of the blocks (a candidate's error within rounding of the other's),
    the same S_dec to 2 ulp, and under the same scale the same codes but at ties (to 4 ulp: the
    two S_dec may differ)."""
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(fresh_seed())) * 3
    x = x.bfloat16()
    op = R.quantize(x, recipe().spec(GemmRole.X_FPROP))
    fp4, scale, s_dec, _ = Q.four_over_six_kernel(x)
    same_scale = op.scale.float().reshape(-1) == scale.reshape(-1)
    assert same_scale.float().mean() >= 0.99
    assert abs(op.outer_scale / s_dec - 1) <= 2 * U
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    scaled = x.float().reshape(-1, 16) / (scale.reshape(-1, 1) * s_dec)  # the kernel's x_scaled
    at_tie = ((scaled.abs()[..., None] - ties).abs() <= 4 * U * ties).any(-1)
    other = (R.e2m1_decode(R.unpack_nibbles(op.qdata)) != fp4).reshape(-1, 16) & same_scale[:, None]
    assert (at_tie | ~other).all()


# ------------------------------------------------------------------------------ unbiasedness
def z2(samples, want: torch.Tensor) -> float:
    """Mean over elements of the squared z-score of the samples' mean against ``want``: about 1
    for an unbiased estimator, 1 + bias^2 / se^2 otherwise (se: the mean's standard error)."""
    s = torch.stack([t.double() for t in samples])
    mean, se = s.mean(0), s.std(0) / len(samples) ** 0.5
    return (((mean - want.double()) / se) ** 2).mean().item()


def test_an_ms_eden_operand_is_unbiased_and_one_with_rounded_scales_is_not():
    """Over 600 rotations and draws, rotated back: the mean of the quantized operand is x within
    its standard errors (the mean squared z-score over 8192 elements is 1 +- 0.02 unbiased; the
    Hadamard rotation leaves a bias under 0.2 standard errors at this count); rounding the
    corrected scales to nearest instead of stochastically (uniforms all 1/2) is biased (z^2 ~ 5)."""
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(fresh_seed()))
    draws = {"sr": [], "rn": []}
    for i in range(600):
        signs = R.rotation_signs(i, 0, 128)
        y = R.hadamard_rotate(x, signs)
        for name, u in (("sr", R.block_uniforms(i, 0, 512)), ("rn", torch.full((512,), 0.5))):
            codes, scale, s_dec = R.ms_eden_round(y, 128, y.abs().max(), u)
            deq = R.dequantize(R.NVFP4Operand(R.pack_nibbles(codes), scale, s_dec, SPEC))
            draws[name].append(R.hadamard_rotate(deq, torch.ones(128)) * signs.repeat(2))
    assert z2(draws["sr"], x) < 1.15
    assert z2(draws["rn"], x) > 3


def quartet2_layer(n=128, k=128, **fields):
    torch.manual_seed(fresh_seed())
    return nr.NVFP4Linear(k, n, recipe=recipe(**fields))


def test_dgrad_and_wgrad_are_unbiased():
    """400 backwards of one forward (each draws its rotation and scale rounding from the next SR
    key): the mean dX is dY W_q and the mean dW is dY^T X_q, W_q and X_q the forward's NVFP4
    operands, within the standard errors (z^2 over 16384 elements: 1 +- 0.02)."""
    layer = quartet2_layer()
    x = torch.randn(128, 128, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    r = layer.recipe
    wq = R.dequantize(R.quantize(layer.weight.detach(), r.spec(GemmRole.W_FPROP)))
    xq = R.dequantize(R.quantize(x.detach(), r.spec(GemmRole.X_FPROP)))
    grads = [torch.autograd.grad(y, (x, layer.weight), dy, retain_graph=True) for _ in range(400)]
    assert layer.sr_step.item() == 400
    assert z2([g[0] for g in grads], dy @ wq) < 1.15
    assert z2([g[1] for g in grads], dy.t() @ xq) < 1.15


# ------------------------------------------------------------------------------ the layers
def eden_copy(t: torch.Tensor, key, counter: int, signs: torch.Tensor) -> torch.Tensor:
    """The transcription's MS-EDEN copy of t (rows, L) rotated along L: our rotation (the
    documented difference), its amax, the uniforms of ``counter``."""
    size = R.rotation_size(t.shape[1], signs.shape[0])
    y = R.hadamard_rotate(t, signs[:size])
    return Q.eden_kernel(y, size, y.abs().max(), R.block_uniforms(key, counter, y.numel() // 16))[3]


@pytest.mark.parametrize("shape", [(128, 128, 128), (96, 48, 64)], ids=["rotation128", "smaller"])
@pytest.mark.parametrize("forward_override", [None, "high_precision"])
def test_a_linear_runs_quartet2s_backward(shape, forward_override):
    """dX and dW of an NVFP4Linear are ``Quartet_II_fn.backward`` of the transcription on the
    forward's NVFP4 X and W (the unquantized ones under forward_override, the reference's
    ``disable_forward_quant``), with the rotation signs and uniforms of the layer's SR key: the
    same operands, multiplied within fp32 accumulation."""
    m, n, k = shape
    layer = quartet2_layer(n, k, forward_override=forward_override)
    x = torch.randn(m, k, requires_grad=True)
    dy = torch.randn(m, n)
    key = sr_key(*layer.sr_state())
    signs = R.rotation_signs(key, ROTATION_SIGNS_OFFSET, 128)
    layer(x).backward(dy)
    r, w = layer.recipe, layer.weight.detach()
    if forward_override is None:
        xq = R.dequantize(R.quantize(x.detach(), r.spec(GemmRole.X_FPROP)))
        wq = R.dequantize(R.quantize(w, r.spec(GemmRole.W_FPROP)))
    else:
        xq, wq = x.detach(), w
    copies = {}

    def quantize(t, name):
        copies[name] = eden_copy(t, key, COUNTERS[name], signs)
        return copies[name]
    Q.backward(xq, wq, dy, quantize)
    assert_fp32_products(x.grad, [(copies["dy"], copies["wt"].t())])
    assert_fp32_products(layer.weight.grad, [(copies["dyt"], copies["xt"].t())])


def experts(n=48, k=64, group=32):
    """One grouped linear of 3 experts (N, K; groups of ``group`` and 2 ``group`` tokens around an
    empty one, 16 rows past the end) with its inputs, dY and the SR key of its backward."""
    g = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(3 * group + 16, k, generator=g).requires_grad_()
    w = torch.randn(3, n, k, generator=g).requires_grad_()
    offs = torch.tensor([group, group, 3 * group], dtype=torch.int32)
    r = recipe()
    seed, step = torch.tensor(7), torch.tensor(0)
    y = moe.grouped_linear(x, w, offs, r, r.signs(), seed, step)
    dy = torch.randn(y.shape, generator=g)
    return x, w, offs, y, dy, sr_key(seed, torch.tensor(0))


def test_experts_run_the_same_backward_per_group():
    """Each expert's dX rows and dW are the linear's MS-EDEN backward on its tokens: dY_g and
    dY_g^T with counters from the group's first row, W_g^T quantized alone (counters from
    expert g's first element), X_g^T from the group's NVFP4 X, one rotation for all."""
    x, w, offs, y, dy, key = experts()
    y.backward(dy)
    r, spec = recipe(), SPEC
    signs = R.rotation_signs(key, ROTATION_SIGNS_OFFSET, 128)
    n, k = w.shape[1:]

    def q(t, role, base):
        return R.dequantize(R.quantize(t, spec, seed=key, offset=MS_EDEN_OFFSETS[role] + base,
                                       rht_signs=signs))
    bounds = [0] + offs.tolist()
    dx_pairs, dw_pairs = [], []
    for g, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        wq = R.dequantize(R.quantize(w.detach()[g], r.spec(GemmRole.W_FPROP)))
        xq = R.dequantize(R.quantize(x.detach()[s:e], r.spec(GemmRole.X_FPROP)))
        dx_pairs.append((q(dy[s:e], GemmRole.DY_DGRAD, s * n // 16),
                         q(wq.t(), GemmRole.W_FPROP, g * n * k // 16).t()))
        dw_pairs.append((q(dy[s:e].t(), GemmRole.DY_WGRAD, s * n // 16),
                         q(xq.t(), GemmRole.X_WGRAD, s * k // 16).t()))
    assert_fp32_products(x.grad, dx_pairs)  # rows past the last group: zeros
    assert_fp32_products(w.grad.flatten(0, 1), dw_pairs)
    assert (w.grad[1] == 0).all()  # the empty group


def test_experts_gradients_are_unbiased():
    """As the linear's, per group (groups of 128 and 256 tokens: 128-point rotations)."""
    x, w, offs, y, dy, _ = experts(128, 128, 128)
    r = recipe()
    wq = [R.dequantize(R.quantize(w.detach()[g], r.spec(GemmRole.W_FPROP))) for g in (0, 2)]
    xq = [R.dequantize(R.quantize(x.detach()[s], r.spec(GemmRole.X_FPROP)))
          for s in (slice(0, 128), slice(128, 384))]
    grads = [torch.autograd.grad(y, (x, w), dy, retain_graph=True) for _ in range(300)]
    want_dx = torch.cat([dy[:128] @ wq[0], dy[128:384] @ wq[1]])
    assert z2([g[0][:384] for g in grads], want_dx) < 1.15
    want_dw = torch.stack([dy[:128].t() @ xq[0], dy[128:384].t() @ xq[1]])
    assert z2([g[1][[0, 2]] for g in grads], want_dw) < 1.15


@pytest.mark.parametrize("fields,changes", [
    (dict(backward_estimator=None), (False, True, True)),
    (dict(ms_eden_rotation=64), (False, True, True)),
    (dict(seed=1), (False, True, True)),
    (dict(four_over_six=None, four_over_six_error="mae"), (True, True, True))])
def test_each_field_changes_what_it_claims(fields, changes):
    """Against the Quartet II recipe: without the estimator (an RN backward from saved W^T, X^T),
    another rotation size or seed change dX and dW only; the forward's 4/6 changes all three."""
    def run(**f):
        torch.manual_seed(0)
        layer = nr.NVFP4Linear(128, 128, recipe=recipe(**f))
        x = torch.randn(128, 128, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn_like(y))
        return y.detach(), x.grad, layer.weight.grad
    for name, a, b, change in zip(("y", "dx", "dw"), run(), run(**fields), changes):
        assert (not torch.equal(a, b)) == change, name


def test_the_forward_operands_are_recorded_and_the_backwards_are_not():
    """inspect records fprop's W and X; MS-EDEN's copies come from a rotation drawn each backward
    and are not recorded."""
    layer = quartet2_layer()
    x = torch.randn(128, 128, requires_grad=True)
    with nr.capture(layer) as ops:
        layer(x).sum().backward()
    assert set(ops[""]) == {"w", "x"}
    assert ops[""]["x"].spec == layer.recipe.spec(GemmRole.X_FPROP)


def test_a_backward_from_saved_copies_and_tensor_parallel_layers_are_refused():
    r = recipe()
    with pytest.raises(ValueError, match="backward_estimator='ms_eden'"):
        quantizers.build(r, r.signs(), quantizers.Usage(True, False), dy=(16, 16), sr_key=0)
    x, w = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16)
    layout = gemms.Dense(shard=types.SimpleNamespace())
    with pytest.raises(ValueError, match="tensor-parallel"):
        gemms.GemmsFn.apply(x, w, None, r.signs(), None, r, "reference", torch.float32, layout)


def test_the_triton_backend_refuses_the_recipe_at_quantize_time(kernel_device):
    """Its kernels do not run MS-EDEN yet: quantize_ names the field (no silent fallback)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32)).to(kernel_device)
    with pytest.raises(ValueError, match="backward_estimator='ms_eden'.*backend='reference'"):
        nr.quantize_(model, recipe(backend="triton"))
    assert isinstance(model[0], torch.nn.Linear)
    triton = get_backend("triton", kernel_device)
    triton.check_spec(QuantSpec(rounding=Rounding.SR))
    with pytest.raises(ValueError, match="QuantSpec.ms_eden"):
        triton.check_spec(SPEC)


def test_torchaos_quantize_refuses_the_recipe():
    """Each layer's MS-EDEN stream comes from its name, which torchao's handler is not given."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match="NVFP4Recipe.backward_estimator.*nvfp4_recipe.quantize_"):
        torchao.quantization.quantize_(model, recipe())


@pytest.mark.parametrize("extra", [(), ("--moe",), ("--mode", "compile")],
                         ids=["dense", "moe", "compile"])
def test_the_main_job_trains_the_recipe(tmp_path, extra):
    out = tmp_path / "out"
    status = cli.main(["train", "--preset", "tiny", "--no-progress", "--out", str(out), "--device",
                       "cpu", "--recipes", "nvfp4-quartet2", "--steps", "8", "--eval-every", "8",
                       *extra])
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert status == 0 and run["status"] == "ok" and run["val_loss"] < run["val_curve"][0][1]


def test_the_main_jobs_recipe_runs_on_the_reference_backend_unless_told_otherwise():
    """`train --recipes nvfp4-quartet2` on a GPU takes the reference backend (the only one that
    runs MS-EDEN) where --backend is auto; a backend named on the command line is kept."""
    assert make_recipe("nvfp4-quartet2", 0, "auto").backend is BackendName.REFERENCE
    assert make_recipe("nvfp4-quartet2", 0, "triton").backend is BackendName.TRITON
    assert make_recipe("nvfp4", 0, "auto").backend is BackendName.AUTO


def test_a_frozen_layer_runs_the_ms_eden_backward_of_the_layer_it_was_trained_as():
    """A frozen base is a given W in the one autograd Function: holding the codes a trained layer
    quantizes its weight to (same layer seed, so the same SR stream), its fprop and its MS-EDEN
    dX are that layer's bit for bit, on fresh random inputs."""
    torch.manual_seed(int(torch.randint(1 << 30, ())))
    r = make_recipe("nvfp4-quartet2", 0, "auto")
    layer = nr.quantize_(torch.nn.Sequential(torch.nn.Linear(64, 48)), r)[0]
    wq = layer.quantized_weight()
    frozen = nr.NVFP4FrozenLinear(wq.qdata, wq.scale, wq.outer_scale, layer.bias.detach(), recipe=r,
                                  dtype=torch.float32, layer_seed=layer.layer_seed)
    assert_same_step((layer, frozen), torch.randn(32, 64), torch.randn(32, 48))
