"""Philox-4x32-10 and the stochastic-rounding bits of 16-element blocks (spec item 6), and the
kernel that draws a backward's Philox key from a layer's SR counters.

The same stream as ``tl.randint4x`` and ``reference.philox4x32`` for a uint32 counter, so that the
kernels' SR bits equal the reference's on CPU and GPU (Salmon et al., "Parallel random numbers: as
easy as 1, 2, 3", SC 2011).
"""

import torch
import triton
import triton.language as tl

from .runtime import Launcher
from .tiles import join16


@triton.jit
def _mul_wide(a, b: tl.constexpr):
    p = a.to(tl.uint64) * b
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def philox4x32(seed, counter):
    """Philox-4x32-10 (Salmon et al., SC 2011), the same four uint32 words as
    ``tl.randint4x(seed, counter)`` and ``reference.philox4x32``, for a uint32 ``counter`` tensor
    and an integer scalar ``seed`` (its low and high 32 bits are the key). Each round's two
    32 x 32-bit products are 64-bit multiplies, one instruction each (``tl.randint4x`` takes a
    high and a low multiply each), which measured faster in the gradient pair."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = counter
    c1 = counter * 0
    c2 = c1
    c3 = c1
    for _ in tl.static_range(10):
        hi_b, lo_b = _mul_wide(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul_wide(c0, 0xD2511F53)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def bits16(seed, counter):
    """SR randoms of 16-element blocks as an (A, B, 16) uint32 tensor in [0, 256)
    (``reference.sr_bits``): element j takes byte j % 4 of word j // 4 of
    ``randint4x(seed, counter)``; ``counter`` (A, B) uint32 is each block's Philox counter."""
    w0, w1, w2, w3 = philox4x32(seed, counter)
    return join16((w0 & 0xFF, (w0 >> 8) & 0xFF, (w0 >> 16) & 0xFF, w0 >> 24,
                   w1 & 0xFF, (w1 >> 8) & 0xFF, (w1 >> 16) & 0xFF, w1 >> 24,
                   w2 & 0xFF, (w2 >> 8) & 0xFF, (w2 >> 16) & 0xFF, w2 >> 24,
                   w3 & 0xFF, (w3 >> 8) & 0xFF, (w3 >> 16) & 0xFF, w3 >> 24))


@triton.jit
def _next_key_kernel(seed_ptr, step_ptr, key_ptr, rank):
    step = tl.load(step_ptr)
    tl.store(key_ptr, tl.load(seed_ptr) + rank + (step << 32))
    tl.store(step_ptr, step + 1)


_NEXT_KEY = Launcher(_next_key_kernel)


def next_key(sr_seed: torch.Tensor, sr_step: torch.Tensor, sr_rank: int) -> torch.Tensor:
    """``sr_seed + sr_rank + (sr_step << 32)`` as a new int64 device scalar, and ``sr_step`` advanced
    by one in place, in one launch (the key of ``linear.sr_key`` and the counter's advance, which
    as torch ops take two or three). ``sr_seed``, ``sr_step``: int64 () tensors on one device
    (CUDA, or the CPU under the interpreter)."""
    key = torch.empty((), dtype=torch.int64, device=sr_step.device)
    _NEXT_KEY[(1,)](sr_seed, sr_step, key, sr_rank)
    return key
