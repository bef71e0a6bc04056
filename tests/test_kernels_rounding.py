"""The kernels' E2M1 rounding (RN and TE's SR rule) and Philox stream against the reference, on
``kernel_device`` (the CPU under the Triton interpreter, the GPU on a GPU machine) and compiled on a
GPU (``cuda``)."""

import pytest
import torch
import triton
import triton.language as tl

from nvfp4_recipe import reference as R
from nvfp4_recipe.formats import E2M1_GRID, e2m1_encode_rn
from nvfp4_recipe.kernels import philox as P
from nvfp4_recipe.kernels import quantize as Q
from nvfp4_recipe.kernels import rounding as RD


@triton.jit
def _round_kernel(v_ptr, r_ptr, out_ptr, n, SR: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + o, mask=o < n, other=0.0)
    r = tl.load(r_ptr + o, mask=o < n, other=0).to(tl.uint32)
    c, s = Q.nibbles(v, r, SR)
    tl.store(out_ptr + o, (c - (RD.SR_OFFSET if SR else RD.RN_OFFSET) + s * 8).to(tl.int32), mask=o < n)


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


def test_rounding_helpers(kernel_device):
    check_rounding(kernel_device)


@triton.jit
def _philox_kernel(out_ptr, seed, offset, N: tl.constexpr):
    i = tl.arange(0, N)
    words = P.philox4x32(seed, (offset + i).to(tl.uint32))
    for w in tl.static_range(4):
        tl.store(out_ptr + i * 4 + w, words[w].to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _bits16_kernel(out_ptr, seed, offset, N: tl.constexpr):
    c = tl.arange(0, N)
    b = P.bits16(seed, (offset + c[:, None] * 2 + tl.arange(0, 2)[None, :]).to(tl.uint32))
    tl.store(out_ptr + (c[:, None, None] * 32 + tl.arange(0, 2)[None, :, None] * 16
                        + tl.arange(0, 16)[None, None, :]), b.to(tl.int64))


def check_philox(device):
    """The kernels' Philox (64-bit products) gives ``reference.philox4x32``, the spec's stream,
    and their SR bytes ``reference.sr_bits`` (counter = the block's index plus the offset)."""
    for seed, offset in (((123 << 32) + 987654321, 2**32 - 40), (7, 0), (2**31 + 5, 12345)):
        out = torch.empty(64 * 4, dtype=torch.int64, device=device)
        _philox_kernel[(1,)](out, seed, offset, 64)
        ref = torch.stack(R.philox4x32(seed, (torch.arange(64) + offset) % 2**32), dim=-1)
        assert torch.equal(out.cpu(), ref.reshape(-1)), (seed, offset)
        bits = torch.empty(32 * 32, dtype=torch.int64, device=device)
        _bits16_kernel[(1,)](bits, seed, offset % 2**31, 32)
        assert torch.equal(bits.cpu(), R.sr_bits(seed, offset % 2**31, (32 * 32,)))


def test_philox(kernel_device):
    check_philox(kernel_device)


@pytest.mark.cuda
def test_cuda_rounding_helpers(device):
    check_rounding(device)


@pytest.mark.cuda
def test_cuda_philox(device):
    check_philox(device)
