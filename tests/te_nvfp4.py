"""An independent test oracle: TransformerEngine's NVFP4 training quantizer, written from its chain.

TE 2.20, ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py`` (``NVFP4QuantizerRef``;
4/6 from TE main, PR 2972: ``_quantize_blockwise_4over6_reference``),
and the software stochastic rounding of ``transformer_engine/common/util/ptx.cuh``
(``stochastic_round_fp4_e2m1``). Written here separately from ``nvfp4_recipe.reference`` (threshold
table instead of arithmetic encoding, floor-based SR, float64 Hadamard matrix product), so that the
tests compare two implementations of the same published chain. TE's handling of an Inf amax
(``S_enc = 0`` replaced by 1) is kept, so the tests can show the project's one deliberate
difference (non-finite inputs propagate).
"""

import torch

FLT_MAX = torch.finfo(torch.float32).max
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """TE's ``cast_to_fp4x2`` before packing: fp32 values in [-6, 6] -> uint8 codes, by its table of
    intervals (ties to even; -0.0 and NaN give code 0, small negatives code 8)."""
    table = [((0.0, True), (0.25, True), 0), ((0.25, False), (0.75, False), 1),
             ((0.75, True), (1.25, True), 2), ((1.25, False), (1.75, False), 3),
             ((1.75, True), (2.5, True), 4), ((2.5, False), (3.5, False), 5),
             ((3.5, True), (5.0, True), 6)]
    out = torch.zeros_like(x, dtype=torch.uint8)
    for (lo, lo_in), (hi, hi_in), code in table:
        mag_lo = (x >= lo) if lo_in else (x > lo)
        mag_hi = (x <= hi) if hi_in else (x < hi)
        out[mag_lo & mag_hi] = code
        neg_lo = (x <= -lo) if lo_in else (x < -lo)
        neg_hi = (x >= -hi) if hi_in else (x > -hi)
        out[neg_lo & neg_hi & (x < -0.0)] = code + 8
    out[x > 5.0] = 7
    out[x < -5.0] = 15
    return out


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    return grid[codes.long()]


def sr_codes(v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """TE's software stochastic rounding: t = |v| + (r / 256) * step(|v|) (fp32), q = floor(t / step(t))
    * step(t), saturated at 6, with the sign of v (a negative v that rounds to 0 gives -0, code 8)."""
    def step(a):
        return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    a = v.abs()
    t = a + (r.to(torch.float32) / 256) * step(a)
    q = torch.clamp(torch.floor(t / step(t)) * step(t), max=6.0)
    return fp4_codes(q) | ((v < 0).to(torch.uint8) << 3)


def rht(x: torch.Tensor, signs=TE_SIGNS) -> torch.Tensor:
    """``x @ diag(signs) @ H16 / 4`` on blocks of 16 along the last dim, as one float64 matrix
    product (exact for bf16 inputs) rounded once to x's dtype."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    m = torch.tensor(signs, dtype=torch.float64)[:, None] * h * 0.25
    return (x.double().reshape(-1, 16) @ m).reshape(x.shape).to(x.dtype)


def quantize(x: torch.Tensor, tile=(1, 16), row_scaled: bool = False, amax=None, sr_bits=None):
    """TE's chain on a 2-D (M, K) tensor (already RHT-transformed if wanted).

    Returns (codes (M, K) uint8, block scales float8_e4m3fn (M, K/16) or (M/16, K/16), S_dec):
    S_enc = min(2688 / amax, FLT_MAX), replaced by 1 where it is 0 (an Inf amax), S_dec = 1 / S_enc;
    sf = e4m3(clamp(min(block_amax * (S_enc * reciprocal(6)), FLT_MAX), -448, 448)); values
    clamp(x * min(1 / (sf * S_dec), FLT_MAX), -6, 6) cast to E2M1 (RN, or SR with ``sr_bits``).
    """
    m, k = x.shape
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax(dim=1) if row_scaled else xf.abs().amax()
    amax = amax.float()
    s_enc = torch.minimum(torch.tensor(2688.0) / amax, torch.tensor(FLT_MAX))
    s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)
    s_dec = torch.tensor(1.0) / s_enc
    if row_scaled:
        s_enc_b, s_dec_b = s_enc.reshape(m, 1, 1), s_dec.reshape(m, 1, 1)
    else:
        s_enc_b, s_dec_b = s_enc, s_dec
    blocks = xf.reshape(m, k // 16, 16)
    if tile == (16, 16):
        tiles = xf.reshape(m // 16, 16, k // 16, 16).abs().amax(dim=(1, 3))
        vec_max = tiles.repeat_interleave(16, dim=0)[:, :, None]
    else:
        vec_max = blocks.abs().amax(dim=-1, keepdim=True)
    sf = vec_max * (s_enc_b * torch.reciprocal(torch.tensor(6.0)))
    sf = torch.minimum(sf, torch.tensor(FLT_MAX))
    sf = torch.clamp(sf, -448.0, 448.0).to(torch.float8_e4m3fn)
    enc = torch.minimum(torch.tensor(1.0) / (sf.float() * s_dec_b), torch.tensor(FLT_MAX))
    if sr_bits is None:
        codes = fp4_codes(torch.clamp(blocks * enc, -6.0, 6.0).reshape(m, k))
    else:
        codes = sr_codes((blocks * enc).reshape(m, k), sr_bits)
    scale = sf[:, :, 0]
    if tile == (16, 16):
        scale = scale[::16]
    return codes, scale, s_dec


def dequantize(codes, scale, s_dec, tile=(1, 16)):
    """codes * block scale * S_dec in fp32 (M, K)."""
    s = scale.float()
    if tile == (16, 16):
        s = s.repeat_interleave(16, dim=0)
    s_dec = s_dec.reshape(-1, 1) if s_dec.dim() else s_dec
    v = fp4_values(codes).reshape(codes.shape[0], -1, 16) * s[:, :, None]
    return v.reshape(codes.shape) * s_dec


def fp16_product(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """TE's fast-math 4/6 candidate (``_ref_nvfp4_4over6_fp16_candidate``): the E2M1 value q times
    the E4M3 scale sf as the fp16 bits its kernel builds from the integer significands, decoded."""
    q_sign = (q < 0).to(torch.int32)
    q_sig = (q.abs() * 2).to(torch.int32)
    code = sf.contiguous().view(torch.uint8).to(torch.int32)
    exp_field, mant = (code >> 3) & 0xF, code & 0x7
    s_sig = torch.where(exp_field == 0, mant, mant + 8)
    s_exp2 = torch.where(exp_field == 0, exp_field - 9, exp_field - 10)
    sig, exp2 = q_sig * s_sig, s_exp2 - 1
    log2 = sum((sig >= t).to(torch.int32) for t in (2, 4, 8, 16, 32, 64, 128, 256))
    floor_exp = log2 + exp2
    normal = ((floor_exp + 15) << 10) | (torch.bitwise_left_shift(sig, 10 - log2) - 1024)
    bits = torch.where(floor_exp < -14, torch.bitwise_left_shift(sig, exp2 + 24), normal)
    bits = torch.where(sig == 0, torch.zeros_like(bits), bits) | ((q_sign ^ (code >> 7)) << 15)
    bits = torch.where((code & 0x7F) == 0x7F, torch.full_like(bits, 0x7E00), bits)
    return bits.to(torch.int16).view(torch.float16).float()


def quantize_4over6(x: torch.Tensor, tile=(1, 16), row_scaled: bool = False, amax=None,
                    err_mode: str = "MAE", fast_math: bool = False, e4m3_max: int = 448,
                    sr_bits=None):
    """TE's 4/6 chain on a 2-D (M, K) tensor; returns (codes, block scales, S_dec) as :func:`quantize`.

    S_enc = min(6 * e4m3_max / amax, FLT_MAX) (0 -> 1), S_dec = 1 / S_enc; base = (vec_max / 6) *
    S_enc; candidates e4m3(clamp(1.5 base)) (map to 4) and e4m3(clamp(base)) (map to 6), clamp at
    448; per candidate the RN codes of clamp(x * min(1 / (sf * S_dec), FLT_MAX), -6, 6) and the
    error, summed element by element: |.| or squared of (q * sf) * amax / (6 * e4m3_max) - x, or
    with fast math fp16(q * sf) - x * S_enc; 16x16 tiles add their 16 row errors in the warp
    tree; map to 4 where its error is strictly smaller. With ``sr_bits``, the chosen candidate's
    values are then rounded stochastically (the project's extension; TE refuses 4/6 with SR).
    """
    m, k = x.shape
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax(dim=1) if row_scaled else xf.abs().amax()
    amax = amax.float()
    s_enc = torch.minimum(torch.tensor(6.0 * e4m3_max) / amax, torch.tensor(FLT_MAX))
    s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)
    s_dec = torch.tensor(1.0) / s_enc
    if row_scaled:
        s_enc, s_dec, amax = s_enc.reshape(m, 1, 1), s_dec.reshape(m, 1, 1), amax.reshape(m, 1)
    blocks = xf.reshape(m, k // 16, 16)
    if tile == (16, 16):
        vec_max = xf.reshape(m // 16, 16, k // 16, 16).abs().amax(dim=(1, 3)).repeat_interleave(16, 0)
    else:
        vec_max = blocks.abs().amax(dim=-1)
    base = (vec_max[:, :, None] / torch.tensor(6.0)) * s_enc
    cands = []
    for d in (base * 1.5, base):
        sf = torch.clamp(d, -448.0, 448.0).to(torch.float8_e4m3fn)
        enc = torch.minimum(torch.tensor(1.0) / (sf.float() * s_dec), torch.tensor(FLT_MAX))
        codes = fp4_codes(torch.clamp(blocks * enc, -6.0, 6.0))
        q = fp4_values(codes)
        err = torch.zeros(m, k // 16)
        for i in range(16):
            if fast_math:
                diff = fp16_product(q[:, :, i], sf[:, :, 0]) - (blocks * s_enc)[:, :, i]
            else:
                val = q[:, :, i] * sf[:, :, 0].float()
                diff = val * amax / torch.tensor(6.0 * e4m3_max) - blocks[:, :, i]
            err = err + (diff * diff if err_mode == "MSE" else diff.abs())
        cands.append((sf[:, :, 0], enc, codes, err))
    (sf4, enc4, c4, err4), (sf6, enc6, c6, err6) = cands
    if tile == (16, 16):
        def tree(e):
            r = e.reshape(m // 16, 16, k // 16)
            r = r[:, 0:8] + r[:, 8:16]
            r = r[:, 0:4] + r[:, 4:8]
            r = r[:, 0:2] + r[:, 2:4]
            return (r[:, 0] + r[:, 1]).repeat_interleave(16, 0)
        pick = tree(err4) < tree(err6)
    else:
        pick = err4 < err6
    scale = torch.where(pick, sf4.view(torch.uint8), sf6.view(torch.uint8)).view(torch.float8_e4m3fn)
    if sr_bits is None:
        codes = torch.where(pick[:, :, None], c4, c6).reshape(m, k)
    else:
        enc = torch.where(pick[:, :, None], enc4, enc6)
        codes = sr_codes((blocks * enc).reshape(m, k), sr_bits)
    if tile == (16, 16):
        scale = scale[::16]
    return codes, scale, s_dec.reshape(-1) if row_scaled else s_dec
