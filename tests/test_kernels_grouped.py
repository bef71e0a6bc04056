"""The grouped kernels (``kernels/grouped_amax.py``, ``grouped_quantize.py``, ``expert_weights.py``,
``grouped_gemm.py``) against per-group calls of the dense reference.

Quantization must equal ``reference.quantize`` called on each group alone, bit for bit, with the SR
counter bases of docs/moe.md; the grouped GEMM must equal the dense reference GEMM of each group
within the fp32 accumulation bound of tests/test_kernels_gemm.py (its docstring derives it). Small
shapes with an empty group and rows past the last group run on ``DEV`` (the Triton interpreter on
CPU tensors; compiled on a GPU machine); ``cuda`` tests run the compiled kernels on larger, uneven
groups.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from nvfp4_recipe import reference as R
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.backends.grouped import check_offsets, expert_slice, group_bounds, group_slice
from nvfp4_recipe.kernels.expert_weights import quantize_experts
from nvfp4_recipe.kernels.grouped_amax import grouped_amax_pass
from nvfp4_recipe.kernels.grouped_gemm import (_INTERP_GROUPED_GEMM_CONFIG, expert_inner,
                                               grouped_scaled_mm)
from nvfp4_recipe.kernels.grouped_quantize import quantize_grouped
from nvfp4_recipe.recipe import NVFP4Recipe
from nvfp4_recipe.spec import GemmRole

from nvfp4_cases import (PAIR_IDS, assert_inner_equals, assert_same, idfn, rand, recipe_pairs,
                         signs_for, spec)
from test_kernels_gemm import DEV, assert_matches_reference

# 112 tokens: groups of 32, 0 (empty), 48 and 16 tokens, then 16 rows that belong to no group
OFFS = (32, 32, 80, 96)
ROW_OFFSET, COL_OFFSET = 2**32 - 40, 2**31  # the row counters wrap past 2**32


def offsets(ends, device=DEV):
    return torch.tensor(ends, dtype=torch.int32, device=device)


def per_group_reference(x, offs, row, col, seed, signs):
    """The oracle: for group g starting at token s, ``reference.quantize`` of x[s:e] with counter
    base ROW_OFFSET + s K / 16 and of x[s:e]^T with COL_OFFSET + s K / 16."""
    k = x.shape[1]
    out = []
    for s, e in group_bounds(offs):
        base = s * k // 16
        out.append((None if row is None else R.quantize(x[s:e], row, seed=seed,
                                                           offset=ROW_OFFSET + base),
                    None if col is None else R.quantize(x[s:e].t(), col, seed=seed,
                                                        offset=COL_OFFSET + base, rht_signs=signs)))
    return out


def check_grouped(x, offs, row, col, inner=(False, False), seed=11, signs=None):
    s = None if signs is None else signs.to(x.device)
    copies = quantize_grouped(x, offs, row, col, inner=inner, seed=seed, row_offset=ROW_OFFSET,
                              col_offset=COL_OFFSET, signs=s)
    refs = per_group_reference(x, offs, row, col, seed, s)
    for g, (start, end) in enumerate(group_bounds(offs)):
        for copy, ref, is_inner in zip(copies, refs[g], inner):
            if ref is None:
                assert copy is None
                continue
            got = group_slice(copy, g, start, end)
            (assert_inner_equals if is_inner else assert_same)(got, ref)
    return copies


@pytest.mark.parametrize("name,row,col", recipe_pairs(), ids=PAIR_IDS)
def test_pair_matches_per_group_reference(name, row, col):
    """Both copies of the recipe's operand pairs (X: RN + RHT column copy; dY: SR + SR RHT;
    estimated amax; per-token scales with RHT), codes and outer scales of every group, the empty
    one included."""
    check_grouped(rand((112, 48), device=DEV, seed=1), offsets(OFFS), row, col, signs=signs_for())


def test_rht_amax_of_infinities_is_nan():
    """Two Infs 8 apart in one column block meet only in the RHT's last butterfly stage
    (Inf - Inf = NaN): that group's RHT amax is NaN, as the reference's, though the kernel's
    first take folds that stage into the maximum (which gives Inf); the other groups' amaxes stay
    finite and exact."""
    _, row, col = recipe_pairs()[0]
    x, offs, signs = rand((112, 48), seed=3), offsets(OFFS), signs_for()
    x[34, 5] = x[42, 5] = float("inf")  # group 2 (rows 32-79), block rows 32-47, column 5
    x = x.to(DEV)
    got = grouped_amax_pass(x, offs, row, col, signs.to(DEV))[1].cpu()
    want = torch.stack([R.operand_amax(x[s:e].t().cpu(), col, signs) if e > s else torch.tensor(0.0)
                        for s, e in group_bounds(offs)])
    assert got[2].isnan() and torch.equal(got[[0, 1, 3]], want[[0, 1, 3]])
    assert want[2].isnan()


@pytest.mark.parametrize("inner", [(True, True), (True, False)], ids=idfn)
def test_inner_values_match_per_group_reference(inner):
    """Transient copies come back as fp16 inner values equal to the reference's dequantized codes."""
    r = NVFP4Recipe()
    check_grouped(rand((112, 48), torch.float32, DEV, seed=2), offsets(OFFS),
                  r.spec(GemmRole.DY_DGRAD), r.spec(GemmRole.DY_WGRAD), inner,
                  seed=torch.tensor(5, device=DEV), signs=signs_for())


@pytest.mark.parametrize("row,col", [
    (spec(scaling="per_token", rounding="sr"), None),
    (None, spec(rounding="sr", rht=True, amax_scale=1.37)),
    (None, spec(scaling="per_token", rht=True)),
], ids=idfn)
def test_one_copy_matches_per_group_reference(row, col):
    """Either copy alone, fp16 input, the per-group amax shared by nothing."""
    check_grouped(rand((112, 64), torch.float16, DEV, seed=3), offsets(OFFS), row, col,
                  signs=signs_for())


def test_group_streams_are_disjoint():
    """Two groups holding the same tokens get different SR codes (their counters differ), and the
    rowwise SR copy of each group is the dense copy of the whole matrix under the same counters
    (per-token scales, where the two quantizations coincide)."""
    half = rand((48, 32), torch.float32, seed=4)
    x = torch.cat([half, half]).to(DEV)
    offs = offsets((48, 96))
    sp = spec(scaling="per_token", rounding="sr")
    rows, cols = quantize_grouped(x, offs, sp, spec(rounding="sr", rht=True), seed=3,
                                  row_offset=ROW_OFFSET, col_offset=COL_OFFSET,
                                  signs=signs_for().to(DEV))
    assert not torch.equal(rows.data.qdata[:48], rows.data.qdata[48:])
    assert not torch.equal(cols.data.qdata[:, :24], cols.data.qdata[:, 24:])
    assert_same(rows.data, R.quantize(x, sp, seed=3, offset=ROW_OFFSET))


@pytest.mark.parametrize("sp", [spec(block="2d"), spec(block="2d", rounding="sr", amax_scale=0.75),
                                spec()], ids=idfn)
@pytest.mark.parametrize("inner", [False, True], ids=["codes", "inner"])
def test_experts_match_per_expert_reference(sp, inner):
    """W_g (codes, or the fp16 inner values of the fprop GEMM) and W_g^T of every expert: 2d
    blocks from one read (W^T the exact transpose), or 1d; expert g's SR counter base is
    offset + g N K / 16."""
    check_experts(rand((3, 48, 32), torch.float32, seed=5).to(DEV), sp, inner)


def four_over_six_pairs():
    """(name, row, col) of the recipe's operand pairs with 4/6 on all operands: X (RN, RHT column
    copy; MSE, bound 448), dY (SR, SR + RHT; MAE fast math, bound 256), per-token."""
    mse = NVFP4Recipe(four_over_six="all", four_over_six_error="mse", four_over_six_e4m3_max=448)
    fast = NVFP4Recipe(four_over_six="all", four_over_six_fast_math=True)
    tok = NVFP4Recipe(four_over_six="all", scaling="per_token")
    return [("x_4over6", mse.spec(GemmRole.X_FPROP), mse.spec(GemmRole.X_WGRAD)),
            ("dy_4over6", fast.spec(GemmRole.DY_DGRAD), fast.spec(GemmRole.DY_WGRAD)),
            ("per_token_4over6", tok.spec(GemmRole.DY_DGRAD), tok.spec(GemmRole.DY_WGRAD))]


FOS_PAIRS = four_over_six_pairs()
FOS_IDS = [p[0] for p in FOS_PAIRS]


@pytest.mark.parametrize("name,row,col", FOS_PAIRS, ids=FOS_IDS)
def test_four_over_six_pair_matches_per_group_reference(name, row, col):
    check_grouped(rand((112, 48), device=DEV, seed=6), offsets(OFFS), row, col, signs=signs_for())


def four_over_six_weight_specs():
    w = NVFP4Recipe(four_over_six="weights").spec(GemmRole.W_FPROP)
    w1d = NVFP4Recipe(four_over_six="weights", weight_2d=False, four_over_six_error="mse")
    return [w, dataclasses.replace(w, rounding="sr"), w1d.spec(GemmRole.W_FPROP)]


@pytest.mark.parametrize("sp", four_over_six_weight_specs(), ids=idfn)
def test_four_over_six_experts_match_per_expert_reference(sp):
    check_experts(rand((3, 48, 32), torch.float32, seed=8).to(DEV), sp, inner=False)


def check_experts(w, sp, inner):
    """W_g and W_g^T of ``quantize_experts`` equal each expert's reference quantization."""
    wq, wtq = quantize_experts(w, sp, seed=9, offset=100, inner=inner)
    n, k = w.shape[1:]
    for g in range(w.shape[0]):
        ref = R.quantize(w[g], sp, seed=9, offset=100 + g * n * k // 16)
        (assert_inner_equals if inner else assert_same)(expert_slice(wq, g), ref)
        ref_t = R.transpose_2d(ref) if sp.block.value == "2d" else \
            R.quantize(w[g].t(), sp, seed=9, offset=100 + g * n * k // 16)
        assert_same(expert_slice(wtq, g), ref_t)


def check_rider(x, offs, w, device=DEV):
    """dY's grouped pass with the experts' W^T (2d codes) riding along, as dgrad runs it
    (``TritonBackend.quantize_groups(prepare=...)``): W^T's inner values equal the dequantize pass's, and
    the copies equal those of the pass alone."""
    r = NVFP4Recipe()
    _, wt = quantize_experts(w, r.spec(GemmRole.W_FPROP))
    kw = dict(seed=torch.tensor(5, device=device), signs=signs_for().to(device),
              transient=(True, True))
    specs = (r.spec(GemmRole.DY_DGRAD), r.spec(GemmRole.DY_WGRAD))
    be = get_backend("triton", device)
    rows, cols, prepared = be.quantize_groups(x, offs, *specs, **kw, prepare=wt)
    alone = be.quantize_groups(x, offs, *specs, **kw)
    end = int(offs[-1])  # rows past the last group are left unwritten
    assert torch.equal(rows.data.values[:end], alone[0].data.values[:end])
    assert torch.equal(cols.data.values[:, :end], alone[1].data.values[:, :end])
    assert prepared.qdata is None and torch.equal(prepared.values, expert_inner(wt))
    assert torch.equal(prepared.outer_scale, wt.outer_scale)
    assert be.quantize_groups(x, offs, specs[0], None, **kw, prepare=wt)[2] is wt  # nothing to ride on


def test_weight_dequantize_rides_on_the_dy_pass():
    check_rider(rand((112, 48), seed=3).to(DEV), offsets(OFFS), rand((4, 32, 48), seed=4).to(DEV))


def check_grouped_gemms(x, dy, w, offs, recipe, inner, method="auto"):
    """fprop (X, W), dgrad (dY, W^T) and wgrad (dY^T, X^T) of the grouped GEMM against each group's
    dense reference GEMM; the transient copies given to the GEMM as inner values when ``inner``
    (the reference takes the same copies as codes, equal by the tests above)."""
    signs = signs_for().to(x.device)
    pair = lambda t, row, col, transient, seed=0: quantize_grouped(
        t, offs, recipe.spec(row), recipe.spec(col), inner=transient, seed=seed, signs=signs)
    xq, xt = pair(x, GemmRole.X_FPROP, GemmRole.X_WGRAD, (False, False))
    dyq, dyt = pair(dy, GemmRole.DY_DGRAD, GemmRole.DY_WGRAD, (False, False), seed=2)
    if inner:
        xq_in = pair(x, GemmRole.X_FPROP, GemmRole.X_WGRAD, (True, False))[0]
        dyq_in, dyt_in = pair(dy, GemmRole.DY_DGRAD, GemmRole.DY_WGRAD, (True, True), seed=2)
    else:
        xq_in, dyq_in, dyt_in = xq, dyq, dyt
    wq, wt = quantize_experts(w, recipe.spec(GemmRole.W_FPROP))
    y = grouped_scaled_mm(xq_in, wq, out_dtype=torch.bfloat16, method=method)
    dx = grouped_scaled_mm(dyq_in, wt, out_dtype=torch.float32, method=method)
    dw = grouped_scaled_mm(dyt_in, xt, out_dtype=torch.float32, method=method)
    assert y.shape == (x.shape[0], w.shape[1]) and dx.shape == x.shape
    assert dw.shape == w.shape
    for g, (s, e) in enumerate(group_bounds(offs)):
        if e > s:
            assert_matches_reference(y[s:e], group_slice(xq, g, s, e), expert_slice(wq, g))
            assert_matches_reference(dx[s:e], group_slice(dyq, g, s, e), expert_slice(wt, g),
                                     out_dtype=torch.float32)
        else:
            assert (dw[g] == 0).all()
        assert_matches_reference(dw[g], group_slice(dyt, g, s, e), group_slice(xt, g, s, e),
                                 out_dtype=torch.float32)
    end = group_bounds(offs)[-1][1]
    assert (y[end:] == 0).all() and (dx[end:] == 0).all()


@pytest.mark.parametrize("scaling,method", [("per_tensor", "pointers"), ("per_token", "pointers"),
                                            ("per_tensor", "tma")])
def test_grouped_gemms_match_per_group_dense(scaling, method):
    """The three grouped GEMMs within the accumulation bound of each group's dense GEMM, reading
    the operands through pointers or TMA descriptors (groups' neighbours masked off); rows past
    the last group are zeros and the empty group's weight gradient is zero."""
    check_grouped_gemms(rand((112, 48), seed=6).to(DEV), rand((112, 32), seed=7).to(DEV),
                        rand((4, 32, 48), torch.float32, seed=8).to(DEV), offsets(OFFS),
                        NVFP4Recipe(scaling=scaling), inner=scaling == "per_tensor", method=method)


def test_bad_arguments_raise():
    x, offs = rand((32, 32)).to(DEV), offsets((16, 32))
    with pytest.raises(TypeError, match="int32"):
        quantize_grouped(x, offs.long(), spec())
    with pytest.raises(ValueError, match="no RHT"):
        quantize_grouped(x, offs, spec(rht=True), signs=signs_for())
    with pytest.raises(ValueError, match="2d"):
        quantize_grouped(x, offs, spec(block="2d"))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_grouped(x[:24], offs, None, spec())
    with pytest.raises(ValueError, match="columnwise copy"):
        quantize_grouped(x, offs, spec(), dequantize=(quantize_grouped(x, offs, spec())[0].data,
                                                      torch.empty(32, 32, dtype=torch.float16,
                                                                  device=DEV)))
    with pytest.raises(ValueError, match="per-tensor spec"):
        quantize_experts(x.reshape(2, 16, 32), spec(scaling="per_token"))
    rows, cols = quantize_grouped(x, offs, spec(), spec())
    wq, _ = quantize_experts(rand((3, 16, 32)).to(DEV), spec(block="2d"))
    with pytest.raises(ValueError, match="groups"):
        grouped_scaled_mm(rows, wq)
    wq2, _ = quantize_experts(rand((2, 16, 32)).to(DEV), spec(block="2d"))
    with pytest.raises(ValueError, match=r"A's outer scale must be a contiguous float32 \(2,\)"):
        bad = rows.data._replace(outer_scale=torch.ones(3, device=DEV))
        grouped_scaled_mm(rows._replace(data=bad), wq2)
    with pytest.raises(ValueError, match=r"B's outer scale"):
        grouped_scaled_mm(rows, wq2._replace(outer_scale=torch.ones(4, device=DEV)))
    with pytest.raises(TypeError, match="int32"):
        grouped_scaled_mm(rows._replace(offs=rows.offs.long()), wq2)
    cfg = {k: v for k, v in _INTERP_GROUPED_GEMM_CONFIG.items() if k != "P"}  # P defaults to 1
    assert torch.equal(grouped_scaled_mm(rows, wq2, cfg=cfg), grouped_scaled_mm(rows, wq2))
    with pytest.raises(ValueError, match="along K"):
        grouped_scaled_mm(cols, rows)


def test_check_offsets_names_the_group():
    with pytest.raises(ValueError, match="group 1 has 24 tokens"):
        check_offsets(offsets((16, 40), "cpu"), 64)
    with pytest.raises(ValueError, match="past the 32 rows"):
        check_offsets(offsets((16, 48), "cpu"), 32)
    with pytest.raises(TypeError, match="int32"):
        check_offsets(torch.tensor([16]), 32)
    check_offsets(offsets((0, 16, 16, 48), "cpu"), 64)


def test_kernels_compile_for_hopper():
    """Every grouped kernel variant the backends launch compiles for sm90 (PTX and cubin, no GPU
    needed; tests/compile_grouped.py): the checks of the compiler, which the interpreter skips."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(tests), env.get("PYTHONPATH"))
                                        if p)
    run = subprocess.run([sys.executable, "compile_grouped.py", "90"], cwd=tests, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


# ----------------------------------------------------------------------------------------------
# Compiled kernels on a GPU: larger, uneven groups
# ----------------------------------------------------------------------------------------------
GPU_ENDS = (512, 512, 1536, 2048, 2064, 3072)  # an empty group, a group of 16, 256 rows past them


@pytest.mark.cuda
@pytest.mark.parametrize("name,row,col", recipe_pairs(), ids=PAIR_IDS)
@pytest.mark.parametrize("inner", [(False, False), (True, True)], ids=idfn)
def test_pair_matches_per_group_reference_cuda(device, name, row, col, inner):
    check_grouped(rand((3328, 1024), device=device, seed=1), offsets(GPU_ENDS, device), row, col,
                  inner, seed=torch.tensor(7, device=device), signs=signs_for())


@pytest.mark.cuda
@pytest.mark.parametrize("sp", [spec(block="2d"), spec(block="2d", rounding="sr"), spec()], ids=idfn)
@pytest.mark.parametrize("inner", [False, True], ids=["codes", "inner"])
def test_experts_match_per_expert_reference_cuda(device, sp, inner):
    w = rand((4, 1024, 768), torch.bfloat16, device, seed=2)
    wq, wtq = quantize_experts(w, sp, seed=3, inner=inner)
    for g in range(4):
        ref = R.quantize(w[g], sp, seed=3, offset=g * 1024 * 768 // 16)
        (assert_inner_equals if inner else assert_same)(expert_slice(wq, g), ref)
        if sp.block.value == "2d":
            assert_same(expert_slice(wtq, g), R.transpose_2d(ref))


@pytest.mark.cuda
@pytest.mark.parametrize("name,row,col", FOS_PAIRS, ids=FOS_IDS)
def test_four_over_six_pair_matches_per_group_reference_cuda(device, name, row, col):
    check_grouped(rand((3328, 1024), device=device, seed=3), offsets(GPU_ENDS, device), row, col,
                  (True, True), seed=torch.tensor(7, device=device), signs=signs_for())


@pytest.mark.cuda
@pytest.mark.parametrize("sp", four_over_six_weight_specs(), ids=idfn)
def test_four_over_six_experts_match_per_expert_reference_cuda(device, sp):
    check_experts(rand((4, 1024, 768), torch.bfloat16, device, seed=4), sp, inner=True)


@pytest.mark.cuda
def test_weight_dequantize_rides_on_the_dy_pass_cuda(device):
    check_rider(rand((3328, 1024), device=device, seed=6), offsets(GPU_ENDS, device),
                rand((6, 768, 1024), torch.float32, device, seed=7), device)


@pytest.mark.cuda
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
@pytest.mark.parametrize("method", ["auto", "pointers"])
def test_grouped_gemms_match_per_group_dense_cuda(device, scaling, method):
    check_grouped_gemms(rand((3328, 768), device=device, seed=3),
                        rand((3328, 1024), device=device, seed=4),
                        rand((6, 1024, 768), torch.float32, device, seed=5),
                        offsets(GPU_ENDS, device), NVFP4Recipe(scaling=scaling), inner=True,
                        method=method)
