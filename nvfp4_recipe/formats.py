"""E2M1 and E4M3 constants, E2M1 encode/decode and nibble packing (pure torch).

NVFP4 stores each value as a 4-bit E2M1 code (1 sign, 2 exponent, 1 mantissa bit; OCP Microscaling
spec v1.0, section 5.3.3) and one E4M3 (``torch.float8_e4m3fn``) scale per block of 16 values.
Codes 0-7 are the magnitudes ``E2M1_GRID`` and code ``c | 8`` is the negative of code ``c``.
"""

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding thresholds between neighbouring magnitudes; a value exactly on a threshold rounds to the
# even code (the one with mantissa bit 0), so some thresholds are inclusive and some are not.
_RN_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                  (2.5, False), (3.5, True), (5.0, False))


def _check_float(x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"expected a float32 tensor, got {x.dtype}")


def e2m1_encode_rn(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [-6, 6] to E2M1 codes, round-to-nearest-even.

    Args:
        v: float32 tensor, any shape, already scaled and clamped to [-6, 6].
    Returns:
        uint8 tensor of the same shape holding codes 0-15. The sign bit is set for ``v < 0``, so
        small negatives that round to zero give code 8 (negative zero) while -0.0 and NaN give
        code 0, as TransformerEngine's reference quantizer (``cast_to_fp4x2``) does.
    Raises:
        TypeError: if ``v`` is not float32.
    """
    _check_float(v)
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t, inclusive in _RN_THRESHOLDS:
        code += (a >= t) if inclusive else (a > t)
    return code | ((v < 0).to(torch.uint8) << 3)


def e2m1_floor_code(a: torch.Tensor) -> torch.Tensor:
    """Code of the largest E2M1 magnitude <= ``a`` for float32 ``a`` in [0, 6] (uint8, same shape)."""
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for g in E2M1_GRID[1:]:
        code += a >= g
    return code


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode uint8 E2M1 codes (0-15, any shape) to float32 values of the same shape.

    Arithmetic on the code's fields (sign bit 3, exponent bits 1-2, mantissa bit 0; exponent 0 is
    the subnormal 0 / 0.5), not a table lookup: no host-to-device copy, so it runs inside a CUDA
    graph capture (``inspect.QuantStats``)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"E2M1 codes must be uint8, got {codes.dtype}")
    c = codes.to(torch.int32)
    exp, man = (c >> 1) & 3, (c & 1).to(torch.float32)
    mag = torch.where(exp == 0, 0.5 * man, torch.exp2((exp - 1).to(torch.float32)) * (1 + 0.5 * man))
    return torch.where(c >= 8, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes (..., K) into bytes (..., K // 2): even element in the low nibble.

    Raises:
        ValueError: if the last dimension is odd.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension ({codes.shape[-1]}) into nibbles")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 (..., K // 2) -> uint8 codes (..., K)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed E2M1 data must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1],
                                                                    2 * packed.shape[-1])
