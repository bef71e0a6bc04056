"""A transcription of Quartet II's reference code, the oracle of tests/test_quartet2.py.

Source: IST-DASLab/Quartet-II at commit 8776a90b7aa0c0a400ad858a3c05a66f7ec55b73 (both files last
changed in e7788a477254c0a592eb2bf92aa5e33713a92f8a), arXiv 2601.22813:

- ``src/models/quantization/schemes/quartet_2.py``: ``get_hadamard_matrix``, ``rerotate_hadamard``,
  ``eden_1x16s_fp4_kernel`` (MS-EDEN) and ``Quartet_II_fn.backward`` (which operands it quantizes
  along which dimension, and the two GEMMs);
- ``src/models/quantization/quantizers/nvfp4_triton.py``: ``rtn_1x16s_fp4_kernel`` with
  ``four_over_six=True`` (the forward's 4/6 quantization; ``rtn_fp4``, ``get_scales``,
  ``get_alt_scales``).

The Triton kernels are written here line by line in fp32 torch ops, each on a whole tensor instead
of a program's block (a block of the flattened tensor holds whole rotation groups, so nothing
depends on the block size). Where the Triton source leaves something to the hardware, this file
says what it takes: ``.to(tl.float8e4nv)`` is the GPU's ``cvt.rn.satfinite`` (nearest even,
saturating at 448); ``tl.sum`` over a rotation group, whose order Triton does not fix, sums halves
pairwise (the order ``nvfp4_recipe.reference`` specifies); ``tl.rand(seed, block)`` is replaced by
the caller's uniforms, one per block; ``tl.dot`` by a float64 product rounded once to fp32. It is
written apart from ``nvfp4_recipe.reference`` (threshold chains as in the source, arithmetic on
values rather than codes, a dense Hadamard matrix), so that the tests compare two implementations.
"""

import torch

SCALES_MAX_EDEN = 255.99  # eden_1x16s_fp4_kernel: "Not 448 because eden needs space to rescale up"
BACKWARD_SCALE_OVERRIDE = (17 / 16) * 0.93  # Quartet_II_fn.backward_scale_override
FORWARD_SCALE_OVERRIDE = 1.0  # Quartet_II_fn.forward_scale_override


def f32(c: float) -> torch.Tensor:
    """A Triton constexpr float as the fp32 constant it becomes in the kernel's arithmetic."""
    return torch.tensor(c, dtype=torch.float32)


def hadamard_matrix(d: int) -> torch.Tensor:
    """``get_hadamard_matrix``: scipy's Sylvester ``hadamard(d) * d**-0.5`` in float64, to fp32."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * d ** -0.5).to(torch.float32)


def rerotate(h: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``rerotate_hadamard``: ``h @ diag(signs)`` (signs the reference draws with torch.randint)."""
    return h @ torch.diag(signs.to(h.dtype))


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The kernel's ``tl.dot(x, h.T)`` on groups of d = h.shape[0] along the last dimension, as an
    exact (float64) product rounded once to fp32."""
    d = h.shape[0]
    return (x.double().reshape(-1, d) @ h.double().T).to(torch.float32).reshape(x.shape)


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """``.to(tl.float8e4nv)`` on the GPU: ``cvt.rn.satfinite.e4m3x2.f32``."""
    return torch.clamp(v, -448.0, 448.0).to(torch.float8_e4m3fn)


def rtn_fp4(x: torch.Tensor) -> torch.Tensor:
    """``rtn_fp4``: E2M1 by the source's threshold chain (ties up), sign ``where(x > 0, 1, -1)``."""
    a = x.abs()
    sign = torch.where(x > 0, 1.0, -1.0)
    out = torch.where(a >= 5, 6.0, torch.where(a >= 3.5, 4.0, torch.where(
        a >= 2.5, 3.0, torch.where(a >= 1.75, 2.0, torch.where(a >= 1.25, 1.5, torch.where(
            a >= 0.75, 1.0, torch.where(a >= 0.25, 0.5, 0.0)))))))
    return out * sign


def pairwise_sum(t: torch.Tensor) -> torch.Tensor:
    """``tl.sum(t, axis=-1)`` over a power-of-two axis, halves added pairwise (module docstring)."""
    while t.shape[-1] > 1:
        half = t.shape[-1] // 2
        t = t[..., :half] + t[..., half:]
    return t[..., 0]


def eden_kernel(x_had: torch.Tensor, hadamard_dim: int, amax: torch.Tensor,
                uniforms: torch.Tensor, scale_override: float = BACKWARD_SCALE_OVERRIDE,
                group_size: int = 16):
    """``eden_1x16s_fp4_kernel`` from its ``x_had`` on: the rotated operand (rows, L) in fp32, its
    amax (``current_amax``) and one uniform per block of 16 in place of ``tl.rand(seed, block)``.

    Returns:
        (x_fp4 (rows, L) E2M1 values, scales (rows, L / 16) the rounded E4M3 block scales as fp32,
        s_dec 0-d, x_dequantized (rows, L) = x_fp4 * scales * s_dec before the store's cast).
    """
    rows, n = x_had.shape
    x_grouped = x_had.reshape(-1, group_size)
    scales_max, val_max = f32(SCALES_MAX_EDEN), f32(6.0 / scale_override)
    s_dec = torch.where(amax == 0.0, f32(1.0), amax / scales_max / val_max)
    s_dec_b = x_grouped.abs().amax(dim=-1, keepdim=True) / val_max
    s_dec_b_e4m3 = to_e4m3(s_dec_b / s_dec).to(torch.float32)
    s_dec_b_e4m3 = torch.where(s_dec_b_e4m3 == 0, f32(1.0), s_dec_b_e4m3)
    x_scaled = x_grouped / (s_dec_b_e4m3 * s_dec)
    x_fp4 = rtn_fp4(x_scaled)
    # Calculate EDEN scale
    x_scaled = x_scaled.reshape(-1, hadamard_dim)
    x_fp4 = x_fp4.reshape(-1, hadamard_dim)
    num = pairwise_sum(x_scaled * x_scaled)[:, None]
    denom = pairwise_sum(x_scaled * x_fp4)[:, None]
    correction = torch.where(denom == 0.0, f32(1.0), num / denom)
    # Apply EDEN scale
    scales = s_dec_b_e4m3.reshape(-1, hadamard_dim // group_size)
    corrected_scales = (scales * correction).reshape(-1, 1)
    bitscales = to_e4m3(corrected_scales).view(torch.uint8)
    prevscale = (bitscales - 1).view(torch.float8_e4m3fn).to(torch.float32)
    currscale = bitscales.view(torch.float8_e4m3fn).to(torch.float32)
    nextscale = (bitscales + 1).view(torch.float8_e4m3fn).to(torch.float32)
    up = torch.where(currscale > corrected_scales, currscale, nextscale)
    down = torch.where(currscale > corrected_scales, prevscale, currscale)
    prob_up = (corrected_scales - down) / (up - down)
    sampled_prob = uniforms.reshape(-1, 1)
    scales = torch.where(sampled_prob < prob_up, up, down)
    x_fp4 = x_fp4.reshape(-1, group_size)
    x_dequantized = x_fp4 * scales * s_dec
    return (x_fp4.reshape(rows, n), scales.reshape(rows, n // group_size), s_dec,
            x_dequantized.reshape(rows, n))


def four_over_six_kernel(x: torch.Tensor, scale_override: float = FORWARD_SCALE_OVERRIDE,
                         group_size: int = 16):
    """``rtn_1x16s_fp4_kernel`` with ``four_over_six=True`` (amax ``x.abs().max()``, its wrapper's).

    Returns:
        (x_fp4 (rows, K) E2M1 values of the chosen candidate, its E4M3 block scales as fp32
        (rows, K / 16), s_dec 0-d, best_x_dequantized (rows, K)).
    """
    rows, k = x.shape
    x_grouped = x.float().reshape(-1, group_size)
    scales_max, val_max = f32(256.0), f32(6.0 / scale_override)
    amax = x.float().abs().max()
    # get_scales
    s_dec = torch.where(amax == 0.0, f32(1.0), amax / scales_max / val_max)
    s_dec_b = x_grouped.abs().amax(dim=-1, keepdim=True) / val_max
    s_dec_b_e4m3 = to_e4m3(s_dec_b / s_dec).to(torch.float32)
    s_dec_b_e4m3 = torch.where(s_dec_b_e4m3 == 0, f32(1.0), s_dec_b_e4m3)
    x_fp4 = rtn_fp4(x_grouped / (s_dec_b_e4m3 * s_dec))
    x_dequantized = x_fp4 * (s_dec_b_e4m3 * s_dec)
    # get_alt_scales
    alt_s_dec_b_e4m3 = to_e4m3(s_dec_b * f32(6 / 4) / s_dec).to(torch.float32)
    alt_s_dec_b_e4m3 = torch.where(alt_s_dec_b_e4m3 == 0, f32(1.0), alt_s_dec_b_e4m3)
    alt_x_fp4 = rtn_fp4(x_grouped / (alt_s_dec_b_e4m3 * s_dec))
    alt_x_dequantized = alt_x_fp4 * (alt_s_dec_b_e4m3 * s_dec)
    error_six = ((x_grouped - x_dequantized) ** 2).sum(dim=-1, keepdim=True)
    error_four = ((x_grouped - alt_x_dequantized) ** 2).sum(dim=-1, keepdim=True)
    six = error_six <= error_four
    return (torch.where(six, x_fp4, alt_x_fp4).reshape(rows, k),
            torch.where(six, s_dec_b_e4m3, alt_s_dec_b_e4m3).reshape(rows, k // group_size), s_dec,
            torch.where(six, x_dequantized, alt_x_dequantized).reshape(rows, k))


def backward(input_fp4: torch.Tensor, weight_fp4: torch.Tensor, grad_output: torch.Tensor,
             quantize):
    """``Quartet_II_fn.backward`` past its re-rotation: (grad_input, grad_weight) from the saved
    forward operands X (M, K), W (N, K) and dY (M, N), where ``quantize(t, name)`` is the
    dequantized MS-EDEN copy of a (rows, L) operand rotated along L (``rotate`` then
    ``eden_kernel``, with the caller's rotation and uniforms), name one of "dy", "wt", "dyt", "xt"
    (the reference's e_ht, weight_tht, e_tht, input_tht)."""
    e_ht_fp4 = quantize(grad_output, "dy")
    weight_tht_fp4 = quantize(weight_fp4.T, "wt")
    grad_input = e_ht_fp4 @ weight_tht_fp4.T  # F.linear(e_ht_fp4, weight_tht_fp4)
    e_tht_fp4 = quantize(grad_output.T, "dyt")
    input_tht_fp4 = quantize(input_fp4.T, "xt")
    grad_weight = e_tht_fp4 @ input_tht_fp4.T  # F.linear(e_tht_fp4, input_tht_fp4)
    return grad_input, grad_weight
