"""The exact 2d transpose kernel (``kernels/transpose.py``) moves codes and tile scales as
``reference.transpose_2d`` does, bit for bit, and the backends' ``transpose_2d`` primitive is it."""

import pytest
import torch

from nvfp4_recipe import reference as R
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.kernels.transpose import transpose_2d
from nvfp4_recipe.spec import FourOverSix, QuantSpec

from nvfp4_cases import assert_same, rand, spec

SPECS = {"rn": spec(block="2d"), "sr": spec(block="2d", rounding="sr"),
         "4over6": QuantSpec(block=spec(block="2d").block, four_over_six=FourOverSix("mae", 256))}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("shape", [(16, 16), (48, 80), (96, 160), (128, 64)])
def test_transpose_2d_moves_the_references_codes_and_scales(name, shape, kernel_device):
    """Fresh random weights of ragged shapes (tiles past the kernel's edges), codes and scales of
    any spec: the kernel's W^T is the reference's bit for bit, and dequantizes to W's transpose."""
    sp = SPECS[name]
    w = rand(shape, device=kernel_device, seed=int(torch.randint(1 << 30, ())))
    wq = R.quantize(w, sp, seed=int(torch.randint(1 << 30, ())))
    got = transpose_2d(wq)
    assert_same(got, R.transpose_2d(wq))
    assert got.spec == wq.spec and got.outer_scale is wq.outer_scale
    assert torch.equal(R.dequantize(got), R.dequantize(wq).t())
    assert_same(transpose_2d(got), wq)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_backend_primitive_is_the_exact_transpose(backend, kernel_device):
    be = get_backend(backend, kernel_device)
    wq = R.quantize(rand((64, 48), device=kernel_device, seed=5), SPECS["rn"])
    assert_same(be.transpose_2d(wq), R.transpose_2d(wq))


def test_transpose_2d_refuses_what_has_no_exact_transpose(kernel_device):
    w = rand((32, 32), device=kernel_device, seed=1)
    with pytest.raises(ValueError, match="2d blocks"):
        transpose_2d(R.quantize(w, spec()))  # 1x16 blocks run along the other dimension
    wq = R.quantize(w, SPECS["rn"])
    with pytest.raises(ValueError, match="codes"):
        transpose_2d(wq._replace(qdata=None, scale=None, values=R.dequantize(wq).half()))
    with pytest.raises(ValueError, match="contiguous"):
        transpose_2d(wq._replace(qdata=wq.qdata.t().contiguous().t()))
