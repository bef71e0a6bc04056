"""The Triton NVFP4 GEMM (nvfp4_recipe.kernels.gemm) against the reference emulated GEMM.

CPU runs go through the Triton interpreter on small shapes; tests marked ``cuda`` run the compiled
kernels (all methods, the PTX dequantization, wgmma on sm90) on larger and ragged shapes.

Tolerance (``assert_matches_reference``). The inner values a_k, b_k (codes x block scales) are exact
in fp16/bf16/fp32 and so is every product a_k * b_k (at most 6 + 6 significant bits), so the only
errors are in the sums, the epilogue and the final cast:

1. fp32 accumulation. A sum of K exact terms in any order, with rounding to nearest, is within
   gamma_K * sum_k |a_k b_k| of the exact sum, gamma_K = K u / (1 - K u), u = 2**-24 (Higham,
   Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.4). Tensor cores may truncate and
   add in groups rather than round each addition; taking u = 2**-23 (one ulp per step instead of
   half an ulp) covers that. The kernel and the reference each make this error, in different
   orders, so they differ by at most 2 gamma_K S sum_k |a_k b_k| with S = |s_a s_b| (the outer
   scale product, computed by both as the same single fp32 multiply).
2. Epilogue: S * acc and + bias each round once in each implementation (or once, fused):
   at most 4 * 2**-24 * (|d| + |bias|).
3. Output cast: the kernel rounds once to out_dtype (round to nearest), comparing it with the fp32
   reference costs half an ulp: 2**-8 |d| for bf16 (8 significant bits), 2**-11 for fp16, 0 for fp32.

So |out - ref| <= 2 gamma_K S (|A| @ |B|^T) + 4 * 2**-24 (|ref| + |bias|) + half_ulp (|ref| + delta)
elementwise, where delta is the sum of the first two terms; |A| @ |B|^T is computed in float64.
"""

import zlib
from unittest import mock

import pytest
import torch

from nvfp4_recipe import reference as R
from nvfp4_recipe.kernels import gemm
from nvfp4_recipe.kernels.dequantize import dequantize_inner
from nvfp4_recipe.operand import NVFP4Operand
from nvfp4_recipe.spec import Block, QuantSpec

from nvfp4_cases import INTERPRETING, KERNEL_DEVICE

# The small-shape tests run under the interpreter on CPU and compiled on a GPU when there is one.
DEV = KERNEL_DEVICE
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
LAYOUTS = ("fprop_2d", "fprop_1d", "dgrad", "wgrad")


def error_bound(a: NVFP4Operand, b: NVFP4Operand, ref: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    """Elementwise bound on |kernel - reference| (module docstring), float64 (M, N)."""
    a_in = R.dequantize_inner(_cpu(a)).double()
    b_in = R.dequantize_inner(_cpu(b)).double()
    s_a = a.outer_scale.double().abs().cpu()
    s_b = b.outer_scale.double().abs().cpu()
    s = (s_a[:, None] if s_a.dim() else s_a) * (s_b[None, :] if s_b.dim() else s_b)
    k = a_in.shape[1]
    gamma = k * 2.0**-23 / (1 - k * 2.0**-23)
    ref = ref.double().abs()
    bias_abs = bias.double().abs().cpu() if bias is not None else 0.0
    delta = 2 * gamma * s * (a_in.abs() @ b_in.abs().t()) + 4 * 2.0**-24 * (ref + bias_abs)
    return delta + HALF_ULP[out_dtype] * (ref + delta) + 1e-30


def _cpu(op: NVFP4Operand) -> NVFP4Operand:
    return op._replace(qdata=op.qdata.cpu(), scale=op.scale.cpu(), outer_scale=op.outer_scale.cpu())


def assert_matches_reference(out, a, b, bias=None, out_dtype=torch.bfloat16):
    bias_cpu = None if bias is None else bias.cpu()
    ref = R.scaled_mm(_cpu(a), _cpu(b), bias=bias_cpu, out_dtype=torch.float32)
    out = out.cpu()
    assert out.dtype == out_dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).abs()
    bound = error_bound(a, b, ref, bias_cpu, out_dtype)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error exceeds the bound by a factor {worst:.3g}"


def inner(op: NVFP4Operand) -> NVFP4Operand:
    """The operand as inner values (what the quantize kernels write for a GEMM that uses it at once)."""
    return op._replace(qdata=None, scale=None, values=dequantize_inner(op, torch.float16))


def random_operand(rows, k, block="1d", per_token=False, device="cpu", gen=None, outer=1e-3):
    """Random NVFP4 operand: every byte value, E4M3 scales over 2**-9 .. 448 (normals and
    subnormals), random outer scales near ``outer`` (small enough that fp16 outputs stay finite).
    Not what the quantizer makes, but every valid encoding."""
    q = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=gen)
    srows = rows // 16 if block == "2d" else rows
    s = torch.exp2(torch.rand(srows, k // 16, generator=gen) * 17.8 - 9).to(torch.float8_e4m3fn)
    outer = (torch.rand(rows if per_token else (), generator=gen) + 0.5) * outer
    return NVFP4Operand(q.to(device), s.to(device), outer.float().to(device),
                        QuantSpec(block, "per_token" if per_token else "per_tensor"))


def layout_operands(layout: str, m: int, n: int, k: int, scaling: str, device="cpu", gen=None):
    """(A, B) of one training GEMM of a linear layer X (m, k) -> Y (m, n), from random data
    quantized by the reference, in the layouts the quantize kernels write.

    fprop D = X W^T: A = X (m, k), B = W (n, k), 2d or 1d. dgrad D = dY W: A = dY (m, n),
    B = W^T (k, n) packed along n (the exact transpose of the 2d W). wgrad D = dY^T X:
    A = dY^T (n, m) and B = X^T (k, m), the columnwise copies, packed along the tokens.
    """
    x = torch.randn(m, k, generator=gen).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device)
    dy = (torch.randn(m, n, generator=gen) * 1e-3).to(device)
    q = lambda t, block="1d": R.quantize(t, QuantSpec(block, "per_tensor" if block == "2d" else scaling))
    if layout == "fprop_2d":
        return q(x), q(w, "2d")
    if layout == "fprop_1d":
        return q(x), q(w)
    if layout == "dgrad":
        return q(dy), R.transpose_2d(q(w, "2d"))
    if layout == "wgrad":
        return q(dy.t()), q(x.t())
    raise ValueError(layout)


# ------------------------------------------------------------------------------------------------
# Small shapes: the kernel logic under the interpreter on CPU (compiled on a GPU machine)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", gemm.METHODS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
@pytest.mark.parametrize("form", ["codes", "inner"])
def test_training_layouts_match_reference(method, layout, scaling, form):
    """Each GEMM of a linear, from codes (one dequantize pass each) and from inner values."""
    gen = torch.Generator().manual_seed(2)
    a, b = layout_operands(layout, 48, 80, 96, scaling, device=DEV, gen=gen)
    bias = torch.randn(b.rows, generator=gen).to(DEV) if layout == "fprop_2d" else None
    ga, gb = (inner(a), inner(b)) if form == "inner" else (a, b)
    out = gemm.scaled_mm(ga, gb, bias=bias, out_dtype=torch.float32, method=method)
    assert_matches_reference(out, a, b, bias, torch.float32)
    if form == "inner":  # the same bits as from codes
        assert torch.equal(out, gemm.scaled_mm(a, b, bias=bias, out_dtype=torch.float32,
                                               method=method))


@pytest.mark.parametrize("method", gemm.METHODS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_random_encodings_ragged_shape_with_bias(method, out_dtype):
    gen = torch.Generator().manual_seed(3)
    a = random_operand(40, 160, per_token=True, device=DEV, gen=gen)  # M, N not tile multiples
    b = random_operand(48, 160, "2d", device=DEV, gen=gen)
    bias = torch.randn(48, generator=gen).to(DEV, torch.bfloat16)
    out = gemm.scaled_mm(a, b, bias=bias, out_dtype=out_dtype, method=method)
    assert_matches_reference(out, a, b, bias, out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bound_rejects_a_missing_block(out_dtype):
    """The tolerance is tight enough to catch one dropped 16-element block out of K = 1024."""
    gen = torch.Generator().manual_seed(8)
    a, b = layout_operands("fprop_2d", 64, 64, 1024, "per_tensor", gen=gen)
    a_cut = a._replace(qdata=a.qdata.clone())
    a_cut.qdata[:, -8:] = 0
    wrong = R.scaled_mm(a_cut, b, out_dtype=out_dtype)
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_matches_reference(wrong, a, b, None, out_dtype)


def test_default_method_rule():
    """On sm90+ the Triton GEMM, except for outputs with fewer tiles than SMs and K >= SPLIT_K_MIN
    (cuBLAS splits that K); cuBLAS before sm90. Evaluated with a stand-in 132-SM sm90 GPU."""
    cuda = torch.device("cuda")
    small = (256, 512)  # 2 x 2 tiles of 128 x 256
    with mock.patch.object(gemm, "interpreting", lambda: False), \
            mock.patch.object(gemm, "num_sms", lambda d: 132):
        with mock.patch.object(gemm, "capability", lambda d: (9, 0)):
            assert gemm.default_method(*small, gemm.SPLIT_K_MIN - 16, cuda) == "triton"
            assert gemm.default_method(*small, gemm.SPLIT_K_MIN, cuda) == "cublas"
            assert gemm.default_method(16384, 4096, 32768, cuda) == "triton"  # 512 tiles
        with mock.patch.object(gemm, "capability", lambda d: (8, 9)):
            assert gemm.default_method(16384, 4096, 1024, cuda) == "cublas"
    assert gemm.default_method(16384, 4096, 1024, torch.device("cpu")) == "cublas"


def test_default_method_and_float4_dtype():
    gen = torch.Generator().manual_seed(4)
    a = random_operand(32, 64, device=DEV, gen=gen)
    b = random_operand(16, 64, device=DEV, gen=gen)
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    qa = a._replace(qdata=a.qdata.view(fp4)) if fp4 is not None else a
    assert_matches_reference(gemm.scaled_mm(qa, b), a, b)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("method", gemm.METHODS)
def test_non_finite_outer_scale_propagates(method):
    gen = torch.Generator().manual_seed(5)
    a = random_operand(32, 64, per_token=True, device=DEV, gen=gen)
    b = random_operand(32, 64, device=DEV, gen=gen)
    outer = a.outer_scale.clone()
    outer[3] = float("nan")
    outer[7] = float("inf")
    out = gemm.scaled_mm(a._replace(outer_scale=outer), b, method=method, out_dtype=torch.float32)
    assert torch.isnan(out[3]).all()
    assert not torch.isfinite(out[7]).any()
    mask = torch.ones(32, dtype=torch.bool, device=DEV)
    mask[[3, 7]] = False
    assert torch.isfinite(out[mask]).all()


def test_empty_dimensions():
    gen = torch.Generator().manual_seed(6)
    a = random_operand(0, 64, device=DEV, gen=gen)
    b = random_operand(16, 64, device=DEV, gen=gen)
    assert gemm.scaled_mm(a, b).shape == (0, 16)
    a = random_operand(16, 0, device=DEV, gen=gen)
    b = random_operand(8, 0, device=DEV, gen=gen)
    bias = torch.randn(8, generator=gen).to(DEV)
    out = gemm.scaled_mm(a, b, bias=bias, out_dtype=torch.float32)
    assert torch.equal(out, bias.expand(16, 8))


def _ops():
    gen = torch.Generator().manual_seed(7)
    return random_operand(32, 64, gen=gen), random_operand(16, 64, gen=gen)


_A, _B = _ops()
_META = dict(device="meta")


@pytest.mark.parametrize("a, b, error, match", [
    (_A, NVFP4Operand(torch.zeros(16, 40, dtype=torch.uint8), torch.zeros(16, 5).to(torch.float8_e4m3fn),
                      _B.outer_scale), ValueError, "K mismatch"),
    (_A._replace(qdata=torch.zeros(32, 32)), _B, TypeError, "uint8"),
    (_A._replace(scale=torch.zeros(32, 4, dtype=torch.uint8)), _B, TypeError, "float8_e4m3fn"),
    (_A._replace(outer_scale=torch.ones((), dtype=torch.float64)), _B, TypeError, "float32"),
    (_A._replace(outer_scale=torch.ones(5)), _B, ValueError, "outer scale"),
    (_A._replace(qdata=torch.zeros(32, 4, dtype=torch.uint8), scale=torch.zeros(32, 0).to(torch.float8_e4m3fn)),
     _B, ValueError, "multiple of 16"),
    (_A._replace(scale=torch.zeros(32, 3).to(torch.float8_e4m3fn)), _B, ValueError, "shape"),
    (_A._replace(qdata=torch.zeros(64, 32, dtype=torch.uint8).t(), scale=torch.zeros(32, 8).to(torch.float8_e4m3fn)),
     _B, ValueError, "contiguous along K"),
    (_A._replace(outer_scale=torch.ones((), **_META)), _B, ValueError, "meta"),
    (_A, NVFP4Operand(torch.zeros(16, 32, dtype=torch.uint8, **_META),
                      torch.zeros(16, 4, **_META).to(torch.float8_e4m3fn), torch.ones((), **_META)),
     ValueError, "B on meta"),
    (_A._replace(qdata=torch.zeros(8, 32, dtype=torch.uint8), scale=torch.zeros(0, 4).to(torch.float8_e4m3fn),
                 spec=QuantSpec(Block.D2)), _B, ValueError, "2d blocks need rows"),
    (_A, _B._replace(spec="3d"), ValueError, "spec must be a QuantSpec"),
    (_A._replace(qdata=None, scale=None), _B, ValueError, "no codes"),
    (_A._replace(values=torch.zeros(32, 64, dtype=torch.bfloat16)), _B, TypeError, "float16"),
    (_A._replace(values=torch.zeros(64, 32, dtype=torch.float16).t()), _B, ValueError, "contiguous"),
    (_A._replace(values=torch.zeros(32, 40, dtype=torch.float16)), _B, ValueError, "multiple of 16"),
])
def test_bad_input_raises(a, b, error, match):
    with pytest.raises(error, match=match):
        gemm.scaled_mm(a, b)


def test_bad_options_raise():
    a, b = _ops()
    with pytest.raises(ValueError, match="bias"):
        gemm.scaled_mm(a, b, bias=torch.zeros(15))
    with pytest.raises(TypeError, match="out_dtype"):
        gemm.scaled_mm(a, b, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="method"):
        gemm.scaled_mm(a, b, method="fused")


# ------------------------------------------------------------------------------------------------
# GPU: compiled kernels, larger and ragged shapes
# ------------------------------------------------------------------------------------------------
GPU_SHAPES = [(272, 208, 400), (1024, 768, 2048)]  # (tokens, out features, in features)


@pytest.mark.cuda
@pytest.mark.parametrize("method", gemm.METHODS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_training_layouts(device, method, layout, scaling, shape):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((method, layout, scaling, shape)).encode()))
    a, b = layout_operands(layout, *shape, scaling, device=device, gen=gen)
    bias = torch.randn(b.rows, generator=gen).to(device, torch.bfloat16)
    out_dtype = torch.bfloat16 if scaling == "per_tensor" else torch.float32
    out = gemm.scaled_mm(a, b, bias=bias, out_dtype=out_dtype, method=method)
    assert_matches_reference(out, a, b, bias, out_dtype)
    assert torch.equal(out, gemm.scaled_mm(inner(a), inner(b), bias=bias, out_dtype=out_dtype,
                                           method=method))


@pytest.mark.cuda
@pytest.mark.parametrize("method", gemm.METHODS)
def test_gpu_random_encodings(device, method):
    gen = torch.Generator().manual_seed(11)
    a = random_operand(1040, 1552, per_token=True, device=device, gen=gen)
    b = random_operand(784, 1552, "2d", device=device, gen=gen)
    out = gemm.scaled_mm(a, b, method=method, out_dtype=torch.float16)
    assert_matches_reference(out, a, b, None, torch.float16)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [gemm.SMALL_K, gemm.SMALL_K + 16])
def test_gpu_tile_config_by_k(device, k):
    """K <= SMALL_K takes the 128 x 128, two-programs-per-SM config, a longer K the 128 x 256 one;
    both against the reference at ragged M and N, per-token A, fp32 and bf16 outputs."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("the TMA GEMM is sm90+")
    assert gemm.gemm_config(k, torch.bfloat16)["P"] == (2 if k <= gemm.SMALL_K else 1)
    gen = torch.Generator().manual_seed(k)
    a = random_operand(1040, k, per_token=True, device=device, gen=gen)
    b = random_operand(784, k, device=device, gen=gen)
    for out_dtype in (torch.bfloat16, torch.float32):
        out = gemm.scaled_mm(a, b, method="triton", out_dtype=out_dtype)
        assert_matches_reference(out, a, b, None, out_dtype)


@pytest.mark.cuda
def test_gpu_machine_refuses_cpu_tensors_outside_the_interpreter():
    if INTERPRETING:
        pytest.skip("the interpreter runs CPU tensors")
    with pytest.raises(ValueError, match="CUDA tensors"):
        gemm.scaled_mm(*_ops())


@pytest.mark.cuda
def test_gpu_gemm_uses_wgmma_on_sm90(device):
    if torch.cuda.get_device_capability(device) != (9, 0):
        pytest.skip("wgmma is an sm90 instruction")
    gen = torch.Generator().manual_seed(13)
    a = random_operand(256, 256, device=device, gen=gen)
    b = random_operand(256, 256, device=device, gen=gen)
    a16, b16 = gemm.inner_values(a), gemm.inner_values(b)
    gemm.triton_mm(a16, a.outer_scale, b16, b.outer_scale, None, torch.bfloat16)
    _, _, args, kwargs = gemm._gemm_launch(a16, a.outer_scale, b16, b.outer_scale, None,
                                           torch.bfloat16, None)
    compiled = gemm._GEMM.compiled(*args, **kwargs)  # the binary the launch above compiled
    assert "wgmma.mma_async" in compiled.asm["ptx"]


@pytest.mark.cuda
def test_gpu_auto_method_splits_small_outputs_to_cublas(device):
    """A wgrad-like product (small output, long K) goes to cuBLAS, which splits K; a large output
    stays on the persistent Triton GEMM (sm90+). Both give the reference's numbers."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("the TMA GEMM is sm90+")
    assert gemm.default_method(16384, 4096, 4096, torch.device(device)) == "triton"
    assert gemm.default_method(512, 512, 32768, torch.device(device)) == "cublas"
    gen = torch.Generator().manual_seed(14)
    a = random_operand(256, 8192, device=device, gen=gen)
    b = random_operand(128, 8192, device=device, gen=gen)
    out = gemm.scaled_mm(a, b, out_dtype=torch.float32)
    assert_matches_reference(out, a, b, None, torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("method", gemm.METHODS)
def test_gpu_output_beyond_2_31_elements(device, method):
    """An output of more than 2**31 elements (131072 tokens x 16400, a long batch times a wide
    vocabulary): row offsets are int64 in the epilogues, so the last rows land where they belong
    (with int32 offsets they wrapped and wrote out of bounds). Small-integer inner values make
    every product and sum exact, so the rows must equal an fp32 matmul's bit for bit."""
    m, n, k = 131072, 16400, 16
    if torch.cuda.mem_get_info(device)[0] < 3 * m * n * 2:
        pytest.skip("needs about 13 GB of free GPU memory")
    gen = torch.Generator(device=device).manual_seed(15)
    a = torch.randint(-6, 7, (m, k), device=device, generator=gen).half()
    b = torch.randint(-6, 7, (n, k), device=device, generator=gen).half()
    one = torch.ones((), device=device)
    y = gemm.scaled_mm(NVFP4Operand(None, None, one, values=a),
                       NVFP4Operand(None, None, one, values=b), out_dtype=torch.bfloat16,
                       method=method)
    assert y.numel() > 2**31
    for rows in (slice(0, 256), slice(m - 256, m)):
        assert torch.equal(y[rows], (a[rows].float() @ b.float().t()).bfloat16())
