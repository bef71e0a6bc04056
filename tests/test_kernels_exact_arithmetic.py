"""The fp32 shortcuts the quantize kernels take for the spec's divisions and roundings
(``kernels/rounding.py``, ``kernels/four_over_six.py``) give the spec's bits: exhaustively over fp32
significands where the claim is about every value, and through the quantize kernels at the amaxes
where they fall back to fp64. On ``kernel_device`` (the CPU under the Triton interpreter, the GPU
on a GPU machine) and compiled on a GPU (``cuda``), where the remainder is one hardware FMA."""

import pytest
import torch
import triton
import triton.language as tl

from nvfp4_recipe import reference as R
from nvfp4_recipe.formats import e2m1_decode, e2m1_encode_rn
from nvfp4_recipe.kernels import four_over_six
from nvfp4_recipe.kernels import rounding as RD
from nvfp4_recipe.kernels.quantize import quantize_1d, quantize_2d
from nvfp4_recipe.spec import FourOverSix, QuantSpec

from nvfp4_cases import assert_same, rand

BLOCK = 1 << 16


@triton.jit
def _elementwise_kernel(x_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o, mask=o < n, other=1.0)
    if OP == 0:
        y = four_over_six.div_exact(x, 3)
    elif OP == 1:
        y = four_over_six.div_exact(x, 21)
    elif OP == 2:
        y = RD.e2m1_value(x)
    elif OP == 3:
        y = RD.reciprocal(x)
    else:  # whether the whole block's amaxes allow the fp32 divisions
        y = tl.where(four_over_six.in_range(x, x), 1.0, 0.0) + tl.zeros_like(x)
    tl.store(out_ptr + o, y, mask=o < n)


def elementwise(x: torch.Tensor, op: int, block: int = BLOCK) -> torch.Tensor:
    out = torch.empty_like(x)
    _elementwise_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), OP=op, BLOCK=block)
    return out.cpu()


def binades(exponents, device) -> torch.Tensor:
    """Every fp32 significand in each binade [2**e, 2**(e + 1))."""
    m = torch.arange(1 << 23, dtype=torch.int32)
    return torch.cat([((e + 127 << 23) | m).view(torch.float32) for e in exponents]).to(device)


def check_div_exact(device):
    """p / 3 and p / 21 are the IEEE quotients on every significand (two binades: the quotient's
    significand depends on p's only)."""
    p = binades((0, 1), device)
    for op, d in ((0, 3.0), (1, 21.0)):
        want = (p.cpu().double() / d).float()
        got = elementwise(p, op)
        bad = (got != want).nonzero()[:5, 0]
        assert bad.numel() == 0, (d, p.cpu()[bad], got[bad], want[bad])


def check_e2m1_value(device):
    """The one-rounding E2M1 value equals decode(RN code) on every fp32 in [2**-2, 8) (below,
    each value rounds to 0 or 0.5 by the same binade's rule), past 6, and at 0."""
    a = torch.cat([binades(range(-2, 3), device).cpu(), torch.tensor([0.0, 6.0, 2.0**-126])])
    a = a.to(device)
    got = elementwise(a, 2)
    want = e2m1_decode(e2m1_encode_rn(a.cpu().clamp(max=6.0)))
    bad = (got != want).nonzero()[:5, 0]
    assert bad.numel() == 0, (a.cpu()[bad], got[bad], want[bad])


def check_reciprocal(device):
    """1 / s correctly rounded in fp32, subnormal results (s above 2**126) included."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    s = torch.exp2(torch.empty(1 << 16).uniform_(-60, 127.99, generator=g))
    s = torch.cat([s, torch.tensor([torch.finfo(torch.float32).max, 2.0**126, 2688.0])])
    for part in (s[s < 2.0**126], s):  # the fp32 branch alone, and with the fp64 one
        want = (1.0 / part.double()).float()
        got = elementwise(part.to(device), 3)
        bad = (got != want).nonzero()[:5, 0]
        assert bad.numel() == 0, (part[bad], got[bad], want[bad])


def check_in_range(device):
    """The fp32 divisions are taken only where every amax of the program is 0 or in
    [2**-100, 2**100]: one amax outside (or NaN, Inf) sends the whole program to fp64."""
    inside = [0.0, 2.0**-100, 1.0, 2.0**100]
    for outside in (2.0**-100 * 0.99, 2.0**100 * 1.01, float("nan"), float("inf")):
        x = torch.tensor(inside * 4, device=device)
        assert elementwise(x, 4, block=16).tolist() == [1.0] * 16
        x[5] = outside
        assert elementwise(x, 4, block=16).tolist() == [0.0] * 16, outside


@pytest.mark.parametrize("scale", [2.0**-110, 2.0**-95, 2.0**95, 2.0**110])
@pytest.mark.parametrize("bound", [256, 448])
def test_four_over_six_at_extreme_amaxes(scale, bound, kernel_device):
    """Tensors whose amax is outside [2**-100, 2**100] take the fp64 divisions, those inside the
    fp32 ones; per-token rows of both kinds in one program too. Both give the reference's bits."""
    fos = FourOverSix("mae", bound)
    x = rand((32, 64), torch.float32, kernel_device, seed=int(torch.randint(0, 2**31, ())))
    x = x / x.abs().amax() * scale
    x[1] *= 2.0**-40  # per token: a row far below the others
    for sp in (QuantSpec(four_over_six=fos), QuantSpec(scaling="per_token", four_over_six=fos)):
        assert_same(quantize_1d(x, sp)[0], R.quantize(x, sp))
    sp2 = QuantSpec("2d", four_over_six=fos)
    assert_same(quantize_2d(x, sp2, write_wt=False)[0], R.quantize(x, sp2))


@pytest.mark.parametrize("amax", [2.0**-120, 2.0**-114, 1e-30, 3.0])
def test_outer_scale_of_tiny_amaxes(amax, kernel_device):
    """S_dec = 1 / S_enc is subnormal for amaxes below about 2**-114: the fp64 branch."""
    x = rand((32, 64), torch.float32, kernel_device)
    x = x / x.abs().amax() * amax
    for sp in (QuantSpec(), QuantSpec(scaling="per_token")):
        assert_same(quantize_1d(x, sp)[0], R.quantize(x, sp))


def test_div_exact(kernel_device):
    check_div_exact(kernel_device)


def test_e2m1_value(kernel_device):
    check_e2m1_value(kernel_device)


def test_reciprocal(kernel_device):
    check_reciprocal(kernel_device)


def test_in_range(kernel_device):
    check_in_range(kernel_device)


@pytest.mark.cuda
def test_cuda_exact_arithmetic(device):
    check_div_exact(device)
    check_e2m1_value(device)
    check_reciprocal(device)
    check_in_range(device)
