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

import os
import zlib

import pytest
import torch

from nvfp4_recipe import reference as R
from nvfp4_recipe.kernels import gemm as G

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# The small-shape tests run under the interpreter on CPU and compiled on a GPU when there is one.
DEV = "cpu" if INTERPRETING else "cuda"
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
LAYOUTS = ("fprop_2d", "fprop_1d", "dgrad", "wgrad")


def error_bound(a: R.NVFP4Data, b: R.NVFP4Data, a_block: str, b_block: str, ref: torch.Tensor,
                bias, out_dtype) -> torch.Tensor:
    """Elementwise bound on |kernel - reference| (module docstring), float64 (M, N)."""
    a_in = R.dequantize_inner(a.qdata, a.scale, a_block).double()
    b_in = R.dequantize_inner(b.qdata, b.scale, b_block).double()
    s_a = a.outer_scale.double().abs()
    s_b = b.outer_scale.double().abs()
    s = (s_a[:, None] if s_a.dim() else s_a) * (s_b[None, :] if s_b.dim() else s_b)
    k = a_in.shape[1]
    gamma = k * 2.0**-23 / (1 - k * 2.0**-23)
    ref = ref.double().abs()
    bias_abs = bias.double().abs() if bias is not None else 0.0
    delta = 2 * gamma * s * (a_in.abs() @ b_in.abs().t()) + 4 * 2.0**-24 * (ref + bias_abs)
    return delta + HALF_ULP[out_dtype] * (ref + delta) + 1e-30


def assert_matches_reference(out, a, b, a_block="1d", b_block="1d", bias=None,
                             out_dtype=torch.bfloat16):
    ref = R.scaled_mm(a, b, a_block=a_block, b_block=b_block, bias=bias, out_dtype=torch.float32)
    assert out.dtype == out_dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).abs()
    bound = error_bound(a, b, a_block, b_block, ref, bias, out_dtype)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error exceeds the bound by a factor {worst:.3g}"


def run_gemm(a, b, a_block="1d", b_block="1d", **kwargs):
    return G.scaled_mm(*a, *b, a_block=a_block, b_block=b_block, **kwargs)


def random_operand(rows, k, block="1d", per_token=False, device="cpu", gen=None, outer=1e-3):
    """Random NVFP4 operand: every byte value, E4M3 scales over 2**-9 .. 448 (normals and
    subnormals), random outer scales near ``outer`` (small enough that fp16 outputs stay finite).
    Not what the quantizer makes, but every valid encoding."""
    q = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=gen)
    srows = rows // 16 if block == "2d" else rows
    s = torch.exp2(torch.rand(srows, k // 16, generator=gen) * 17.8 - 9).to(torch.float8_e4m3fn)
    outer = (torch.rand(rows if per_token else (), generator=gen) + 0.5) * outer
    return R.NVFP4Data(q.to(device), s.to(device), outer.float().to(device))


def layout_operands(layout: str, m: int, n: int, k: int, scaling: str, device="cpu", gen=None):
    """(A, a_block, B, b_block) of one training GEMM of a linear layer X (m, k) -> Y (m, n), from
    random data quantized by the reference, in the layouts the quantize kernels write.

    fprop D = X W^T: A = X (m, k), B = W (n, k), 2d or 1d. dgrad D = dY W: A = dY (m, n),
    B = W^T (k, n) packed along n (the exact transpose of the 2d W). wgrad D = dY^T X:
    A = dY^T (n, m) and B = X^T (k, m), the columnwise copies, packed along the tokens.
    """
    x = torch.randn(m, k, generator=gen).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device)
    dy = (torch.randn(m, n, generator=gen) * 1e-3).to(device)
    q = lambda t, block="1d": R.quantize(t, block=block, scaling="per_tensor" if block == "2d" else scaling)
    if layout == "fprop_2d":
        return q(x), "1d", q(w, "2d"), "2d"
    if layout == "fprop_1d":
        return q(x), "1d", q(w), "1d"
    if layout == "dgrad":
        return q(dy), "1d", R.transpose_2d(q(w, "2d")), "2d"
    if layout == "wgrad":
        return q(dy.t()), "1d", q(x.t()), "1d"
    raise ValueError(layout)


# ------------------------------------------------------------------------------------------------
# Small shapes: the kernel logic under the interpreter on CPU (compiled on a GPU machine)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", ["1d", "2d"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_inner_is_exact(block, out_dtype):
    gen = torch.Generator().manual_seed(1)
    op = random_operand(48, 160, block, device=DEV, gen=gen)  # 80 bytes a row: a partial tile
    out = G.dequantize_inner(op.qdata, op.scale, block, out_dtype=out_dtype)
    ref = R.dequantize_inner(op.qdata, op.scale, block)
    assert out.dtype == out_dtype
    assert torch.equal(out.float(), ref.to(out.device))


@pytest.mark.parametrize("method", G.METHODS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
def test_training_layouts_match_reference(method, layout, scaling):
    gen = torch.Generator().manual_seed(2)
    a, a_block, b, b_block = layout_operands(layout, 48, 80, 96, scaling, device=DEV, gen=gen)
    bias = torch.randn(b.qdata.shape[0], generator=gen).to(DEV) if layout == "fprop_2d" else None
    out = run_gemm(a, b, a_block, b_block, bias=bias, out_dtype=torch.float32, method=method)
    assert_matches_reference(out, a, b, a_block, b_block, bias, torch.float32)


@pytest.mark.parametrize("method", G.METHODS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_random_encodings_ragged_shape_with_bias(method, out_dtype):
    gen = torch.Generator().manual_seed(3)
    a = random_operand(40, 160, per_token=True, device=DEV, gen=gen)  # M, N not tile multiples
    b = random_operand(48, 160, "2d", device=DEV, gen=gen)
    bias = torch.randn(48, generator=gen).to(DEV, torch.bfloat16)
    out = run_gemm(a, b, "1d", "2d", bias=bias, out_dtype=out_dtype, method=method)
    assert_matches_reference(out, a, b, "1d", "2d", bias, out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bound_rejects_a_missing_block(out_dtype):
    """The tolerance is tight enough to catch one dropped 16-element block out of K = 1024."""
    gen = torch.Generator().manual_seed(8)
    a, a_block, b, b_block = layout_operands("fprop_2d", 64, 64, 1024, "per_tensor", gen=gen)
    a_cut = a._replace(qdata=a.qdata.clone())
    a_cut.qdata[:, -8:] = 0
    wrong = R.scaled_mm(a_cut, b, a_block=a_block, b_block=b_block, out_dtype=out_dtype)
    with pytest.raises(AssertionError, match="exceeds the bound"):
        assert_matches_reference(wrong, a, b, a_block, b_block, None, out_dtype)


def test_default_method_and_float4_dtype():
    gen = torch.Generator().manual_seed(4)
    a = random_operand(32, 64, device=DEV, gen=gen)
    b = random_operand(16, 64, device=DEV, gen=gen)
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    qa = a.qdata.view(fp4) if fp4 is not None else a.qdata
    out = G.scaled_mm(qa, a.scale, a.outer_scale, *b)
    assert_matches_reference(out, a, b)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("method", G.METHODS)
def test_non_finite_outer_scale_propagates(method):
    gen = torch.Generator().manual_seed(5)
    a = random_operand(32, 64, per_token=True, device=DEV, gen=gen)
    b = random_operand(32, 64, device=DEV, gen=gen)
    outer = a.outer_scale.clone()
    outer[3] = float("nan")
    outer[7] = float("inf")
    out = G.scaled_mm(a.qdata, a.scale, outer, *b, method=method, out_dtype=torch.float32)
    assert torch.isnan(out[3]).all()
    assert not torch.isfinite(out[7]).any()
    mask = torch.ones(32, dtype=torch.bool, device=DEV)
    mask[[3, 7]] = False
    assert torch.isfinite(out[mask]).all()


def test_empty_dimensions():
    gen = torch.Generator().manual_seed(6)
    a = random_operand(0, 64, device=DEV, gen=gen)
    b = random_operand(16, 64, device=DEV, gen=gen)
    assert G.scaled_mm(*a, *b).shape == (0, 16)
    a = random_operand(16, 0, device=DEV, gen=gen)
    b = random_operand(8, 0, device=DEV, gen=gen)
    bias = torch.randn(8, generator=gen).to(DEV)
    out = G.scaled_mm(*a, *b, bias=bias, out_dtype=torch.float32)
    assert torch.equal(out, bias.expand(16, 8))


def _ops(**overrides):
    gen = torch.Generator().manual_seed(7)
    a = random_operand(32, 64, gen=gen)
    b = random_operand(16, 64, gen=gen)
    args = dict(a_qdata=a.qdata, a_scale=a.scale, a_outer=a.outer_scale, b_qdata=b.qdata,
                b_scale=b.scale, b_outer=b.outer_scale)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides, error, match", [
    (dict(b_qdata=torch.zeros(16, 40, dtype=torch.uint8), b_scale=torch.zeros(16, 5).to(torch.float8_e4m3fn)),
     ValueError, "K mismatch"),
    (dict(a_qdata=torch.zeros(32, 32)), TypeError, "uint8"),
    (dict(a_scale=torch.zeros(32, 4, dtype=torch.uint8)), TypeError, "float8_e4m3fn"),
    (dict(a_outer=torch.ones((), dtype=torch.float64)), TypeError, "float32"),
    (dict(a_outer=torch.ones(5)), ValueError, "outer scale"),
    (dict(a_qdata=torch.zeros(32, 4, dtype=torch.uint8), a_scale=torch.zeros(32, 0).to(torch.float8_e4m3fn)),
     ValueError, "multiple of 16"),
    (dict(a_scale=torch.zeros(32, 3).to(torch.float8_e4m3fn)), ValueError, "shape"),
    (dict(a_qdata=torch.zeros(64, 32, dtype=torch.uint8).t(),
          a_scale=torch.zeros(32, 8).to(torch.float8_e4m3fn)), ValueError, "contiguous along K"),
    (dict(a_outer=torch.ones((), device="meta")), ValueError, "meta"),
    (dict(b_qdata=torch.zeros(16, 32, dtype=torch.uint8, device="meta"),
          b_scale=torch.zeros(16, 4, device="meta").to(torch.float8_e4m3fn),
          b_outer=torch.ones((), device="meta")), ValueError, "B on meta"),
])
def test_bad_input_raises(overrides, error, match):
    with pytest.raises(error, match=match):
        G.scaled_mm(**_ops(**overrides))


@pytest.mark.parametrize("method", G.METHODS[1:])
def test_inner_mm_equals_scaled_mm(method):
    """inner_mm on dequantized operands is the second pass of the two-pass methods: the same bits."""
    gen = torch.Generator().manual_seed(15)
    a = random_operand(48, 96, per_token=True, device=DEV, gen=gen)
    b = random_operand(32, 96, "2d", device=DEV, gen=gen)
    bias = torch.randn(32, generator=gen).to(DEV)
    a16 = G.dequantize_inner(a.qdata, a.scale, "1d", torch.float16)
    b16 = G.dequantize_inner(b.qdata, b.scale, "2d", torch.float16)
    out = G.inner_mm(a16, a.outer_scale, b16, b.outer_scale, bias=bias, method=method)
    assert torch.equal(out, run_gemm(a, b, "1d", "2d", bias=bias, method=method))


def test_inner_mm_bad_input_raises():
    v, o = torch.zeros(32, 64, dtype=torch.float16), torch.ones(())
    with pytest.raises(TypeError, match="float16"):
        G.inner_mm(v.bfloat16(), o, v, o)
    with pytest.raises(ValueError, match="contiguous"):
        G.inner_mm(torch.zeros(64, 32, dtype=torch.float16).t(), o, v, o)
    with pytest.raises(ValueError, match="multiple of 16"):
        G.inner_mm(v[:, :40], o, v[:, :40], o)
    with pytest.raises(ValueError, match="K mismatch"):
        G.inner_mm(v, o, v[:, :48].contiguous(), o)
    with pytest.raises(ValueError, match="method"):
        G.inner_mm(v, o, v, o, method="fused")


def test_bad_options_raise():
    with pytest.raises(ValueError, match="2d blocks need rows"):
        G.scaled_mm(**_ops(a_qdata=torch.zeros(8, 32, dtype=torch.uint8),
                           a_scale=torch.zeros(0, 4).to(torch.float8_e4m3fn)), a_block="2d")
    with pytest.raises(ValueError, match="block must be"):
        G.scaled_mm(**_ops(), b_block="3d")
    with pytest.raises(ValueError, match="bias"):
        G.scaled_mm(**_ops(), bias=torch.zeros(15))
    with pytest.raises(TypeError, match="out_dtype"):
        G.scaled_mm(**_ops(), out_dtype=torch.int32)
    with pytest.raises(ValueError, match="method"):
        G.scaled_mm(**_ops(), method="magic")


# ------------------------------------------------------------------------------------------------
# GPU: compiled kernels, larger and ragged shapes
# ------------------------------------------------------------------------------------------------
GPU_SHAPES = [(272, 208, 400), (1024, 768, 2048)]  # (tokens, out features, in features)


@pytest.mark.cuda
@pytest.mark.parametrize("method", G.METHODS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_training_layouts(device, method, layout, scaling, shape):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((method, layout, scaling, shape)).encode()))
    a, a_block, b, b_block = layout_operands(layout, *shape, scaling, device=device, gen=gen)
    bias = torch.randn(b.qdata.shape[0], generator=gen).to(device, torch.bfloat16)
    out_dtype = torch.bfloat16 if scaling == "per_tensor" else torch.float32
    out = run_gemm(a, b, a_block, b_block, bias=bias, out_dtype=out_dtype, method=method)
    assert_matches_reference(out, a, b, a_block, b_block, bias, out_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("method", G.METHODS)
def test_gpu_random_encodings(device, method):
    gen = torch.Generator().manual_seed(11)
    a = random_operand(1040, 1552, per_token=True, device=device, gen=gen)
    b = random_operand(784, 1552, "2d", device=device, gen=gen)
    out = run_gemm(a, b, "1d", "2d", method=method, out_dtype=torch.float16)
    assert_matches_reference(out, a, b, "1d", "2d", None, torch.float16)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [G.SMALL_K, G.SMALL_K + 16])
def test_gpu_tile_config_by_k(device, k):
    """K <= SMALL_K takes the 128 x 128, two-programs-per-SM config, a longer K the 128 x 256 one;
    both against the reference at ragged M and N, per-token A, fp32 and bf16 outputs."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("the TMA GEMM is sm90+")
    assert G.gemm_config(k, torch.bfloat16)["P"] == (2 if k <= G.SMALL_K else 1)
    gen = torch.Generator().manual_seed(k)
    a = random_operand(1040, k, per_token=True, device=device, gen=gen)
    b = random_operand(784, k, device=device, gen=gen)
    for out_dtype in (torch.bfloat16, torch.float32):
        out = run_gemm(a, b, method="dequant_triton", out_dtype=out_dtype)
        assert_matches_reference(out, a, b, "1d", "1d", None, out_dtype)


@pytest.mark.cuda
def test_gpu_machine_refuses_cpu_tensors_outside_the_interpreter():
    if INTERPRETING:
        pytest.skip("the interpreter runs CPU tensors")
    with pytest.raises(ValueError, match="CUDA tensors"):
        G.scaled_mm(**_ops())


@pytest.mark.cuda
@pytest.mark.parametrize("block", ["1d", "2d"])
def test_gpu_dequantize_exact(device, block):
    gen = torch.Generator().manual_seed(12)
    op = random_operand(528, 1040, block, device=device, gen=gen)
    ref = R.dequantize_inner(op.qdata, op.scale, block)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(G.dequantize_inner(op.qdata, op.scale, block, dtype).float(), ref)


@pytest.mark.cuda
def test_gpu_fused_kernel_uses_wgmma_on_sm90(device):
    if torch.cuda.get_device_capability(device) != (9, 0):
        pytest.skip("wgmma is an sm90 instruction")
    gen = torch.Generator().manual_seed(13)
    a = random_operand(256, 256, device=device, gen=gen)
    b = random_operand(256, 256, device=device, gen=gen)
    for method in ("fused", "dequant_triton"):
        run_gemm(a, b, method=method)
        assert "wgmma.mma_async" in G.LAST_KERNEL[method].asm["ptx"]


@pytest.mark.cuda
def test_gpu_auto_method_splits_small_outputs_to_cublas(device):
    """A wgrad-like product (small output, long K) goes to cuBLAS, which splits K; a large output
    stays on the persistent Triton GEMM (sm90+). Both give the reference's numbers."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("the TMA GEMM is sm90+")
    assert G.default_method(16384, 4096, 4096, torch.device(device)) == "dequant_triton"
    assert G.default_method(512, 512, 32768, torch.device(device)) == "dequant_cublas"
    gen = torch.Generator().manual_seed(14)
    a = random_operand(256, 8192, device=device, gen=gen)
    b = random_operand(128, 8192, device=device, gen=gen)
    out = G.scaled_mm(*a, *b, out_dtype=torch.float32)
    assert_matches_reference(out, a, b, "1d", "1d", None, torch.float32)
