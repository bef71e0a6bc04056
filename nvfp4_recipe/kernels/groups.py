"""Token groups of the grouped (mixture-of-experts) kernels: the offsets that delimit them, and
the kernels' lookups of the group a row belongs to.

The tokens of all experts form one (T, K) matrix whose rows are split into G contiguous groups by
``offs`` (int32 (G,), cumulative group ends, ``torch._grouped_mm``'s convention; docs/moe.md):
group g is expert g's tokens, rows ``offs[g - 1]`` (0 for g = 0) to ``offs[g]``. Every group's
length must be a multiple of 16 (the wgrad copies have blocks of 16 tokens, which must not straddle
two experts; callers pad each group, as TransformerEngine and torchao require). Rows past
``offs[-1]`` belong to no group: their group index is G.
"""

import torch
import triton
import triton.language as tl

# Groups a kernel takes per step of a loop over the groups (their ends, amaxes or outer scales).
GROUPS_PER_STEP = tl.constexpr(16)


def check_offsets(offs: torch.Tensor, device: torch.device) -> None:
    """Raise TypeError unless ``offs`` is a 1-D int32 tensor, ValueError unless it is on
    ``device``. Its values (nondecreasing multiples of 16 ending at most at the number of rows)
    are the caller's contract: checking them would synchronise with the host
    (``backends.grouped.check_offsets`` does)."""
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        raise TypeError(f"offs must be a 1-D int32 tensor of cumulative group ends, got "
                        f"{getattr(offs, 'dtype', type(offs).__name__)} "
                        f"{tuple(getattr(offs, 'shape', ()))}")
    if offs.device != device:
        raise ValueError(f"offs is on {offs.device}, the data on {device}")


@triton.jit
def group_of(rows, offs_ptr, G):
    """Group of each row index in ``rows`` (int32 tensor): the number of group ends <= the row, so
    G for rows past the last group."""
    g = tl.zeros_like(rows)
    for j0 in range(0, G, GROUPS_PER_STEP):
        j = j0 + tl.arange(0, GROUPS_PER_STEP)
        ends = tl.load(offs_ptr + j, mask=j < G, other=2147483647)
        g += tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
    return g


@triton.jit
def group_start(g, offs_ptr, G):
    """First row of groups ``g`` (0 for g = 0 and for g >= G)."""
    return tl.load(offs_ptr + g - 1, mask=(g > 0) & (g < G), other=0)
