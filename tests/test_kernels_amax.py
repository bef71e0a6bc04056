"""The amax kernel (``kernels/amax.py``): global, per-row, per-column and the RHT'd columnwise amaxes
equal the reference's, including the Inf cases of the folded last butterfly stage."""

import pytest
import torch

from nvfp4_recipe import reference as R
from nvfp4_recipe.kernels import amax as A
from nvfp4_recipe.spec import Scaling

from nvfp4_cases import idfn, rand, signs_for


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=idfn)
@pytest.mark.parametrize("rht", [False, True])
def test_amax_kernel(rht, dtype, kernel_device):
    """9 tiles of 32 x 32 for 4 programs under the interpreter: the persistent grid's programs
    loop over several tiles and fold their maxima together. The RHT amax is of the transform
    rounded to the input dtype (spec item 7)."""
    x = rand((80, 96), dtype, kernel_device, seed=5)
    signs = signs_for().to(kernel_device)
    r, c = A.amax(x, A.PER_INDEX, A.PER_INDEX, rht, signs if rht else None)
    xt = R.rht(x.t(), signs) if rht else x.t().float()
    assert torch.equal(r, R.amax(x, Scaling.PER_TOKEN))
    assert torch.equal(c, R.amax(xt, Scaling.PER_TOKEN))
    r, c = A.amax(x, A.TENSOR, A.TENSOR, rht, signs if rht else None)
    assert torch.equal(r, R.amax(x, Scaling.PER_TENSOR)) and torch.equal(c, R.amax(xt, Scaling.PER_TENSOR))
    r, c = A.amax(x, A.PER_INDEX, A.TENSOR, rht, signs if rht else None)
    assert torch.equal(r, R.amax(x, Scaling.PER_TOKEN)) and torch.equal(c, R.amax(xt, Scaling.PER_TENSOR))


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("row,col", [(A.TENSOR, A.NONE), (A.PER_INDEX, A.NONE), (A.NONE, A.TENSOR),
                                     (A.NONE, A.PER_INDEX), (A.NONE, A.NONE)])
def test_amax_kernel_one_output(row, col, rht, kernel_device):
    """Asking for one amax gives it alone, in its own shape (() or one per index), the other None."""
    x = rand((48, 80), torch.bfloat16, kernel_device, seed=6)
    signs = signs_for().to(kernel_device)
    xt = R.rht(x.t(), signs) if rht else x.t().float()
    r, c = A.amax(x, row, col, rht, signs)
    want = {A.NONE: None, A.TENSOR: Scaling.PER_TENSOR, A.PER_INDEX: Scaling.PER_TOKEN}
    for got, mode, ref in ((r, row, x), (c, col, xt)):
        if want[mode] is None:
            assert got is None
        else:
            assert got.shape == ref.shape[:1] if mode == A.PER_INDEX else got.shape == ()
            assert torch.equal(got, R.amax(ref, want[mode]))


def check_rht_amax_nonfinite(device, along_k=False):
    """The RHT amax folds its last butterfly stage into |a| + |b|, which gives Inf where the
    transform has Inf - Inf = NaN: such programs recompute exactly, so the amaxes match the
    reference's (NaN where two Infs meet in the last stage, Inf for one Inf) in every column
    (``along_k``: in every row, for the RHT along K of a rowwise copy)."""
    signs = signs_for()
    for rows in ((1, 9), (1,), (2, 3)):  # (1, 9): the last stage pairs elements j and j + 8
        x = rand((80, 96), torch.float32, seed=12)
        for r in rows:
            x[16 + r, 40] = float("inf")
        if along_k:  # the Infs along K, in row 40
            x = x.t().contiguous()
        ref_c = R.amax(R.rht(x if along_k else x.t(), signs), Scaling.PER_TOKEN)
        assert ref_c.isfinite().sum() == ref_c.numel() - 1  # one non-finite column (row)
        x, signs_d = x.to(device), signs.to(device)
        if along_k:
            amax = lambda mode: A.amax(x, mode, A.NONE, signs=signs_d, row_rht=True)[0]
        else:
            amax = lambda mode: A.amax(x, A.TENSOR, mode, True, signs_d)[1]
        c = amax(A.PER_INDEX).cpu()
        assert torch.equal(c.isnan(), ref_c.isnan()) and torch.equal(c.isinf(), ref_c.isinf())
        assert torch.equal(c[ref_c.isfinite()], ref_c[ref_c.isfinite()])
        c = amax(A.TENSOR)
        ref = ref_c.max() if not ref_c.isnan().any() else torch.tensor(float("nan"))
        assert c.isnan().item() == ref.isnan() and c.isinf().item() == ref.isinf()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("along_k", [False, True], ids=["along M", "along K"])
def test_rht_amax_nonfinite(along_k, kernel_device):
    check_rht_amax_nonfinite(kernel_device, along_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=idfn)
def test_row_rht_amax(dtype, kernel_device):
    """The amax of the RHT along K (a rowwise RHT copy) reads row blocks: global and per row, with
    several tiles per program under the interpreter, equal to the reference's (the transform
    rounded to the input dtype, spec item 7)."""
    x = rand((80, 96), dtype, kernel_device, seed=9)
    signs = signs_for().to(kernel_device)
    ref = R.rht(x, signs)
    r, c = A.amax(x, A.TENSOR, A.NONE, signs=signs, row_rht=True)
    assert c is None and torch.equal(r, R.amax(ref, Scaling.PER_TENSOR))
    r, _ = A.amax(x, A.PER_INDEX, A.NONE, signs=signs, row_rht=True)
    assert r.shape == (80,) and torch.equal(r, R.amax(ref, Scaling.PER_TOKEN))


def test_rejects_bad_input():
    with pytest.raises(TypeError, match="bfloat16"):
        A.amax(torch.ones(16, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="RHT signs"):
        A.amax(torch.ones(16, 16), A.NONE, A.TENSOR, col_rht=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        A.amax(torch.ones(24, 16), A.NONE, A.TENSOR, True, signs_for())
    with pytest.raises(ValueError, match="multiple of 16"):
        A.amax(torch.ones(16, 24), A.TENSOR, A.NONE, signs=signs_for(), row_rht=True)
    with pytest.raises(ValueError, match="RHT signs"):
        A.amax(torch.ones(16, 16), A.TENSOR, A.NONE, row_rht=True)
    with pytest.raises(ValueError, match="no column amax"):
        A.amax(torch.ones(16, 16), A.TENSOR, A.TENSOR, signs=signs_for(), row_rht=True)


@pytest.mark.cuda
@pytest.mark.parametrize("along_k", [False, True], ids=["along M", "along K"])
def test_cuda_rht_amax_nonfinite(device, along_k):
    check_rht_amax_nonfinite(device, along_k)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=idfn)
def test_cuda_amax(device, dtype):
    x = rand((16400, 4112), dtype, device=device, seed=3)
    signs = signs_for().to(device)
    r, c = A.amax(x, A.PER_INDEX, A.TENSOR, True, signs)
    assert torch.equal(r.cpu(), R.amax(x.cpu(), Scaling.PER_TOKEN))
    assert torch.equal(c.cpu(), R.amax(R.rht(x.t().cpu(), signs.cpu()), Scaling.PER_TENSOR))
    r, _ = A.amax(x, A.PER_INDEX, A.NONE, signs=signs, row_rht=True)
    assert torch.equal(r.cpu(), R.amax(R.rht(x.cpu(), signs.cpu()), Scaling.PER_TOKEN))
