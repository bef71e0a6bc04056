"""E2M1/E4M3 codes: every code decodes and re-encodes to itself; RN ties go to the even code."""

import torch

from nvfp4_recipe import formats as F


def e2m1_values() -> torch.Tensor:
    """The 16 E2M1 code values, float32 (16,), indexed by code (OCP MX spec v1.0, 5.3.3)."""
    grid = torch.tensor(F.E2M1_GRID, dtype=torch.float32)
    return torch.cat([grid, -grid])


def test_every_e2m1_code_round_trips():
    """Code 8 (-0.0) encodes back to code 0: the sign is set for v < 0 only, as in
    TransformerEngine's reference cast; small negatives still keep it."""
    codes = torch.arange(16, dtype=torch.uint8)
    expect = torch.where(codes == 8, 0, codes).to(torch.uint8)
    assert torch.equal(F.e2m1_encode_rn(F.e2m1_decode(codes)), expect)
    assert F.e2m1_encode_rn(torch.tensor([-0.1, -0.0, float("nan")])).tolist() == [8, 0, 0]


def test_every_e4m3_code_round_trips():
    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F  # 0x7F / 0xFF are NaN in float8_e4m3fn
    values = codes[finite].view(torch.float8_e4m3fn).float()
    assert torch.equal(values.to(torch.float8_e4m3fn).view(torch.uint8), codes[finite])


def test_e2m1_ties_round_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expect = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(F.e2m1_decode(F.e2m1_encode_rn(ties)), expect)
    assert torch.equal(F.e2m1_decode(F.e2m1_encode_rn(-ties)), -expect)


def test_e2m1_decode_is_the_code_table_signed_zero_included():
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    table = e2m1_values()[codes.long()]
    got = F.e2m1_decode(codes)
    assert torch.equal(got, table) and torch.equal(got.signbit(), table.signbit())
    assert F.e2m1_decode(torch.tensor([8], dtype=torch.uint8)).signbit().item()


def test_e2m1_rn_is_nearest():
    v = torch.empty(10_000).uniform_(-6, 6)
    q = F.e2m1_decode(F.e2m1_encode_rn(v))
    grid = e2m1_values()
    nearest = (v[:, None] - grid[None]).abs().min(dim=1).values
    assert torch.equal((v - q).abs(), nearest)


def test_pack_unpack_round_trip_low_nibble_first():
    codes = torch.randint(0, 16, (3, 32), dtype=torch.uint8)
    packed = F.pack_nibbles(codes)
    assert packed.shape == (3, 16)
    assert torch.equal(packed[:, 0], codes[:, 0] | (codes[:, 1] << 4))
    assert torch.equal(F.unpack_nibbles(packed), codes)
