"""The dequantize kernel (``kernels/dequantize.py``): codes x block scales, exactly the reference's."""

import pytest
import torch

from nvfp4_recipe import reference as R
from nvfp4_recipe.kernels.dequantize import dequantize_inner

from test_kernels_gemm import DEV, random_operand


@pytest.mark.parametrize("block", ["1d", "2d"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_inner_is_exact(block, out_dtype):
    """Every byte value and E4M3 scales over 2**-9 .. 448 (subnormal ones included); 80 bytes a
    row: a partial tile."""
    gen = torch.Generator().manual_seed(1)
    op = random_operand(48, 160, block, device=DEV, gen=gen)
    out = dequantize_inner(op, out_dtype)
    assert out.dtype == out_dtype
    assert torch.equal(out.float().cpu(), R.dequantize_inner(op._replace(qdata=op.qdata.cpu(),
                                                                         scale=op.scale.cpu())))


def test_dequantize_inner_needs_no_outer_scale():
    """Inner values do not involve the outer scale: an operand without one (what the grouped
    GEMMs pass for all experts' stacked codes) dequantizes, with the codes still checked."""
    gen = torch.Generator().manual_seed(3)
    op = random_operand(32, 96, "1d", device=DEV, gen=gen)
    ref = R.dequantize_inner(op._replace(qdata=op.qdata.cpu(), scale=op.scale.cpu()))
    assert torch.equal(dequantize_inner(op._replace(outer_scale=None), torch.float32).cpu(), ref)
    with pytest.raises(ValueError, match="block scales"):
        dequantize_inner(op._replace(scale=op.scale[:, :-1], outer_scale=None))


def test_dequantize_of_an_empty_operand():
    op = random_operand(0, 64, device=DEV)
    assert dequantize_inner(op).shape == (0, 64)


@pytest.mark.cuda
@pytest.mark.parametrize("block", ["1d", "2d"])
def test_gpu_dequantize_exact(device, block):
    """Compiled: the inline-PTX path for fp16 (sm89+), the portable one for bf16 and fp32."""
    gen = torch.Generator().manual_seed(12)
    op = random_operand(528, 1040, block, device=device, gen=gen)
    ref = R.dequantize_inner(op._replace(qdata=op.qdata.cpu(), scale=op.scale.cpu()))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(dequantize_inner(op, dtype).float().cpu(), ref)
