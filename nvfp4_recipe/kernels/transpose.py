"""The exact transpose of a 2d-blocked NVFP4 operand: codes and 16x16 tile scales moved, nothing
requantized (``reference.transpose_2d``).

With 16x16 blocks, W^T's tiles are W's tiles transposed and share their E4M3 scales, so dgrad's
W^T (K, N) packed along N is a relayout of W's (N, K) codes packed along K. This is how a weight
gathered as NVFP4 (FSDP2's FP4 all-gather, ``fsdp.py``) or loaded as codes gets its columnwise
copy locally, as TransformerEngine rebuilds the columnwise copy of a gathered 2D-quantized
weight. One read of the (N, K/2) codes and the (N/16, K/16) scales, one write of each transposed.
"""

import torch
import triton
import triton.language as tl

from ..operand import NVFP4Operand
from ..spec import Block, Form
from .runtime import Launcher, cdiv, check_runnable, interpreting


@triton.jit
def _transpose_2d_kernel(q_ptr, s_ptr, qt_ptr, st_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """One (BN, BK) tile of W (N, K) per program: q_ptr (N, K/2) uint8 codes packed along K
    (element 2j in the low nibble of byte j), s_ptr (N/16, K/16) uint8 scales; writes qt_ptr
    (K, N/2) packed along N and st_ptr (K/16, N/16). N and K are multiples of 16; tiles past the
    edges are masked."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    kb = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)  # byte columns of W
    ok = (n[:, None] < N) & (kb[None, :] < K // 2)
    q = tl.load(q_ptr + n[:, None].to(tl.int64) * (K // 2) + kb[None, :], mask=ok, other=0)
    codes = tl.reshape(tl.join(q & 0xF, q >> 4), (BN, BK))  # [n, k]
    pairs = tl.reshape(tl.trans(codes), (BK, BN // 2, 2))  # [k, n // 2, n % 2]
    lo, hi = tl.split(pairs)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    nb = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)  # byte columns of W^T
    tl.store(qt_ptr + k[:, None].to(tl.int64) * (N // 2) + nb[None, :], lo | (hi << 4),
             mask=(k[:, None] < K) & (nb[None, :] < N // 2))
    r = tl.program_id(0) * (BN // 16) + tl.arange(0, BN // 16)  # tile rows of W
    c = tl.program_id(1) * (BK // 16) + tl.arange(0, BK // 16)  # tile columns of W
    tiles = (r[:, None] < N // 16) & (c[None, :] < K // 16)
    s = tl.load(s_ptr + r[:, None] * (K // 16) + c[None, :], mask=tiles)
    tl.store(st_ptr + c[None, :] * (N // 16) + r[:, None], s, mask=tiles)


_TRANSPOSE_2D = Launcher(_transpose_2d_kernel)


def transpose_2d(op: NVFP4Operand) -> NVFP4Operand:
    """``reference.transpose_2d`` in one launch: the (K, N) operand, packed along N, whose
    dequantization is ``dequantize(op).t()``, of a 2d-blocked (N, K) operand ``op`` in codes
    (uint8 (N, K/2) codes, E4M3 (N/16, K/16) tile scales); the outer scale and spec are op's.

    Raises:
        ValueError: ``op`` does not have 2d blocks, is not in codes or not contiguous, or its
            device cannot run the kernels.
    """
    if op.form is not Form.CODES or op.qdata.dim() != 2 or op.block is not Block.D2:
        raise ValueError(f"transpose_2d takes a 2-D operand of codes with 2d blocks, got "
                         f"{op.spec.block.value} blocks, form {op.form.value}")
    if not (op.qdata.is_contiguous() and op.scale.is_contiguous()):
        raise ValueError("transpose_2d takes contiguous codes and scales")
    check_runnable(op.qdata.device)
    n, k = op.qdata.shape[0], 2 * op.qdata.shape[1]
    qt = torch.empty(k, n // 2, dtype=torch.uint8, device=op.qdata.device)
    st = torch.empty(k // 16, n // 16, dtype=op.scale.dtype, device=op.qdata.device)
    bn, bk = (32, 32) if interpreting() else (64, 64)
    _TRANSPOSE_2D[(cdiv(n, bn), cdiv(k, bk))](op.qdata, op.scale.view(torch.uint8), qt,
                                              st.view(torch.uint8), n, k, BN=bn, BK=bk,
                                              num_warps=4)
    return NVFP4Operand(qt, st, op.outer_scale, op.spec)
