"""The GEMMs a recipe takes out of NVFP4 (``forward_override``, ``backward_override``), for one
group (a dense layer, ``offs`` None) or many (experts: tokens sorted by group, ``offs`` the int32
(G,) group ends, weights (G, N, K), as ``torch._grouped_mm`` takes them).

Each GEMM runs in the dtype of its first operand (the autocast dtype or the input's) with fp32
accumulation, as ``nn.Linear`` under autocast; rows past the last group are zero. Grouped GEMMs
in bf16 are ``torch._grouped_mm``; in other dtypes (which it does not take) one GEMM per group. Also what the
autograd Functions save for an overridden backward: the unquantized X (the weight is the
Parameter itself) or the forward's NVFP4 X and W, dequantized in backward.
"""

from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from . import reference as R
from .operand import NVFP4Operand
from .spec import Override


def _group_masks(offs: torch.Tensor, rows: int):
    """(rows, 1) bool masks of the rows of each group, on the device (no host sync)."""
    group = torch.searchsorted(offs, torch.arange(rows, device=offs.device), right=True)
    return [(group == g)[:, None] for g in range(offs.shape[0])]


def _rows_in_groups(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``y`` with the rows past the last group (``offs[-1]``) set to zero."""
    inside = torch.arange(y.shape[0], device=y.device)[:, None] < offs[-1]
    return torch.where(inside, y, torch.zeros((), dtype=y.dtype, device=y.device))


def _grouped_rows(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of group g of ``a`` (T, K) times ``b[g]`` (G, K, N): ``torch._grouped_mm`` in bf16,
    else one matmul per group, its rows selected (other dtypes; exact, G times the FLOPs)."""
    if a.dtype == torch.bfloat16:
        return _rows_in_groups(torch._grouped_mm(a, b, offs=offs), offs)
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
    for g, rows in enumerate(_group_masks(offs, a.shape[0])):
        out = torch.where(rows, a @ b[g], out)
    return out


def fprop(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
          offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y = X W^T (+ bias): x (M, K), w (N, K) or (G, N, K) -> (M, N) in x's dtype."""
    if offs is None:
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return _grouped_rows(x, w.to(x.dtype).transpose(-2, -1), offs)


def dgrad(dy: torch.Tensor, w: torch.Tensor, offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dX = dY W: dy (M, N), w (N, K) or (G, N, K) -> (M, K) in dy's dtype."""
    if offs is None:
        return dy @ w.to(dy.dtype)
    return _grouped_rows(dy, w.to(dy.dtype), offs)


def wgrad(dy: torch.Tensor, x: torch.Tensor, offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dW = dY^T X: dy (M, N), x (M, K) -> (N, K), or (G, N, K) per group, in dy's dtype."""
    x = x.to(dy.dtype)
    if offs is None:
        return dy.t() @ x
    if dy.dtype == torch.bfloat16:
        return torch._grouped_mm(dy.t(), x, offs=offs)
    zero = torch.zeros((), dtype=dy.dtype, device=dy.device)
    return torch.stack([torch.where(rows, dy, zero).t() @ torch.where(rows, x, zero)
                        for rows in _group_masks(offs, dy.shape[0])])


def saved(override: Override, x: torch.Tensor, kept: Optional[Tuple[NVFP4Operand, NVFP4Operand]],
          wgrad: bool = True) -> Dict[str, Union[None, torch.Tensor, NVFP4Operand]]:
    """What an overridden backward keeps besides the weight Parameter, by name: X itself
    (HIGH_PRECISION; None without ``wgrad``, which alone reads it), or the forward's NVFP4 X
    and W (DEQUANTIZED; X as codes), ``kept``."""
    if override is Override.HIGH_PRECISION:
        return {"x": x if wgrad else None}
    xq, wq = kept
    return {"xq": xq, "wq": wq}


def restored(override: Override, weight: torch.Tensor,
             kept: Dict[str, Union[torch.Tensor, NVFP4Operand]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(X, W) for the overridden backward from what :func:`saved` kept: the unquantized ones, or
    the forward's dequantized (float32)."""
    if override is Override.HIGH_PRECISION:
        return kept["x"], weight
    return R.dequantize(kept["xq"]), R.dequantize(kept["wq"])


def grads(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, need_dx: bool, need_dw: bool,
          x_dtype: torch.dtype, w_dtype: torch.dtype, offs: Optional[torch.Tensor] = None,
          ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(dX of ``x_dtype`` or None, dW of ``w_dtype`` or None) in dY's precision."""
    dx = dgrad(dy, w, offs).to(x_dtype) if need_dx else None
    dw = wgrad(dy, x, offs).to(w_dtype) if need_dw else None
    return dx, dw
