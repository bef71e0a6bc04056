"""The native Blackwell backend (nvfp4_recipe.backends.native).

No Blackwell GPU was available: what runs here is the scale layout (against cuBLAS's documented
block-scaling layout, computed independently below) and the whole ``native_scaled_mm`` call with
``torch._scaled_mm`` replaced by an emulation of its documented semantics. The one real-hardware
test needs an sm100+ GPU and is skipped elsewhere.
"""

import logging

import pytest
import torch

from nvfp4_recipe import backends
from nvfp4_recipe import reference as R
from nvfp4_recipe.backends import native
from nvfp4_recipe.operand import NVFP4Operand

from test_kernels_gemm import LAYOUTS, assert_matches_reference, layout_operands


def cublas_scale_offset(r: torch.Tensor, c: torch.Tensor, cols: int) -> torch.Tensor:
    """Offset of scale (r, c) in cuBLAS's layout: 128x4 tiles in row-major order, each tile stored
    as [r % 32][(r % 128) // 32][c % 4] (cuBLAS docs, "1D block scaling factors layout")."""
    tiles_per_row = (cols + 3) // 4
    tile = (r // 128) * tiles_per_row + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    return flat.view(torch.uint8)[cublas_scale_offset(r, c, cols)].view(torch.float8_e4m3fn)


def random_scales(rows, cols, gen):
    return torch.randint(0, 0x7F, (rows, cols), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("rows, cols", [(128, 4), (200, 9), (16, 1), (384, 256)])
def test_swizzle_is_cublas_layout(rows, cols):
    gen = torch.Generator().manual_seed(rows * cols)
    s = random_scales(rows, cols, gen)
    flat = native.swizzle_scales(s, "1d")
    assert flat.dtype == torch.float8_e4m3fn
    assert flat.numel() == -(-rows // 128) * 128 * -(-cols // 4) * 4
    assert torch.equal(unswizzle(flat, rows, cols).view(torch.uint8), s.view(torch.uint8))
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    used = torch.zeros(flat.numel(), dtype=torch.bool)
    used[cublas_scale_offset(r, c, cols).flatten()] = True
    assert (flat.view(torch.uint8)[~used] == 0).all()  # padding is zero


def test_swizzle_2d_repeats_rows():
    gen = torch.Generator().manual_seed(0)
    s = random_scales(8, 6, gen)
    expanded = s.view(torch.uint8).repeat_interleave(16, dim=0).view(torch.float8_e4m3fn)
    assert torch.equal(native.swizzle_scales(s, "2d").view(torch.uint8),
                       native.swizzle_scales(expanded, "1d").view(torch.uint8))


def emulated_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                       use_fast_accum=False):
    """torch._scaled_mm for FP4 as documented: A (M, K/2) and B (K/2, N) float4_e2m1fn_x2, scales
    in the swizzled layout, fp32 accumulation of the dequantized products."""
    assert a.dtype == b.dtype == torch.float4_e2m1fn_x2 and b.stride(0) == 1
    assert bias is None and scale_result is None and not use_fast_accum
    qa, qb = a.view(torch.uint8), b.t().view(torch.uint8)
    k = 2 * qa.shape[1]
    zero = torch.zeros(())
    a_in = R.dequantize_inner(NVFP4Operand(qa, unswizzle(scale_a, qa.shape[0], k // 16), zero))
    b_in = R.dequantize_inner(NVFP4Operand(qb, unswizzle(scale_b, qb.shape[0], k // 16), zero))
    return (a_in @ b_in.t()).to(out_dtype)


@pytest.fixture
def emulated_blackwell(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    monkeypatch.setattr(native, "fp4_tensor_cores", lambda device: True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
def test_native_call_matches_reference(emulated_blackwell, layout, scaling):
    gen = torch.Generator().manual_seed(1)
    a, b = layout_operands(layout, 160, 192, 256, scaling, gen=gen)
    bias = torch.randn(b.rows, generator=gen)
    out = native.NativeBackend().mm(a, b, bias=bias, out_dtype=torch.bfloat16)
    assert_matches_reference(out, a, b, bias, torch.bfloat16)


def test_unaligned_shape_falls_back_once(emulated_blackwell, caplog, monkeypatch):
    monkeypatch.setattr(backends, "_WARNED", set())
    gen = torch.Generator().manual_seed(2)
    a, b = layout_operands("fprop_1d", 32, 32, 48, "per_tensor", gen=gen)
    with caplog.at_level(logging.WARNING, logger="nvfp4_recipe"):
        for _ in range(2):
            out = native.NativeBackend().mm(a, b, out_dtype=torch.float32)
    assert torch.equal(out, R.scaled_mm(a, b))
    assert sum("reference GEMM" in r.getMessage() for r in caplog.records) == 1


def test_native_refuses_without_fp4_tensor_cores():
    gen = torch.Generator().manual_seed(3)
    a, b = layout_operands("fprop_1d", 32, 32, 64, "per_tensor", gen=gen)
    with pytest.raises(ValueError, match="sm100"):
        native.native_scaled_mm(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_on_blackwell(device, layout):
    if not native.fp4_tensor_cores(device):
        pytest.skip("needs an sm100+ GPU")
    gen = torch.Generator().manual_seed(4)
    a, b = layout_operands(layout, 512, 768, 1024, "per_token", device=device, gen=gen)
    out = native.NativeBackend().mm(a, b, out_dtype=torch.bfloat16)
    assert_matches_reference(out, a, b, None, torch.bfloat16)
