"""NVFP4 GEMM in Triton: D = (s_a * s_b) * (A_inner @ B_inner^T) + bias.

Both operands are :class:`NVFP4Operand` s (rows, K) with their 16-element blocks along the reduction
dimension K, as the quantize kernels write them, so fprop (X @ W^T), dgrad (dY @ (W^T)^T) and wgrad
(dY^T @ (X^T)^T) are all this one product and nothing is transposed in memory. An operand comes
either as codes (packed E2M1, E4M3 block scales), which one dequantize pass turns into fp16 inner
values (``kernels.dequantize``: exact), or already as inner values (a quantize kernel wrote them for
this product). The products of inner values are exact; they accumulate in fp32 on tensor cores and
the outer scales and the bias are applied once, in fp32, in an epilogue: the only roundings are the
fp32 accumulation and the final cast to ``out_dtype`` (no bf16 double rounding).

Methods (``scaled_mm(method=...)``; benchmarks/bench_gemm.py measures them against bf16 ``torch.mm``):

- ``"triton"`` (the default on sm90+ when the output has a tile per SM): a persistent Triton GEMM
  reads the inner values through TMA descriptors it makes on the device (wgmma, pipelined) and
  applies the fp32 epilogue to its accumulator.
- ``"cublas"`` (the default before sm90, for small outputs, and under the interpreter): cuBLAS
  ``torch.mm(..., out_dtype=torch.float32)``, then a Triton epilogue pass over the fp32 product.

Under ``TRITON_INTERPRET=1`` (CPU tests) dots run on fp32 operands and 16-bit outputs are cast by
torch, because the interpreter's 16-bit dot and fp32 -> bf16 cast differ from the GPU's. Sources:
the NVFP4 format (OCP Microscaling spec v1.0; NVIDIA, arXiv 2509.25149); Triton's matmul tutorials
(grouped tile order, persistent TMA GEMM, epilogue subtiling).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..operand import NVFP4Operand
from ..spec import Form
from .dequantize import BLOCK, check_codes, check_outer, dequantize_valid
from .runtime import Launcher, capability, cdiv, check_runnable, interpreting, num_sms

METHODS = ("triton", "cublas")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """acc += a @ b with a (BM, BK), b (BK, BN) 16-bit floats; fp32 operands under the interpreter."""
    if INTERP:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def tile_pid(tile_id, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile ``tile_id``, GROUP_M row tiles per sweep over the columns."""
    num_m = tl.cdiv(M, BM)
    width = GROUP_M * tl.cdiv(N, BN)
    first_m = (tile_id // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile_id % width) % size_m, (tile_id % width) // size_m


@triton.jit
def epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_sa, stride_sb,
              stride_o, HAS_BIAS: tl.constexpr):
    """out = (s_a * s_b) * acc (+ bias), all in fp32, cast once to out's dtype; masked to (M, N).

    The outer scales are vectors with stride 1 (per-token) or 0 (per-tensor: one value).
    """
    mask_m = offs_m < M
    mask_n = offs_n < N
    sa = tl.load(sa_ptr + offs_m * stride_sa, mask=mask_m, other=0.0)
    sb = tl.load(sb_ptr + offs_n * stride_sb, mask=mask_n, other=0.0)
    d = (sa[:, None] * sb[None, :]) * acc
    if HAS_BIAS:
        d = d + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    # int64 rows: an output of 2**31 elements or more (a long batch times a wide vocabulary)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(out_ptrs, d.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["stride_sa", "stride_sb"])
def _gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, K, stride_sa,
                 stride_sb, stride_o, HAS_BIAS: tl.constexpr, INTERP: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 NUM_PROGRAMS: tl.constexpr, EPI_SPLIT: tl.constexpr):
    """Persistent GEMM over dequantized 16-bit A_inner (M, K) and B_inner (N, K), contiguous and
    16-byte aligned, read through TMA descriptors (blocks [BM, BK] and [BN, BK]; out-of-range reads
    are zero); fp32 epilogue, in two column halves if EPI_SPLIT == 2 (halves the shared memory its
    layout change needs). Program i takes tiles i, i + NUM_PROGRAMS, ... (NUM_PROGRAMS: one or two
    per SM; the grid may be smaller when there are fewer tiles).

    The kernel makes its descriptors itself (device-side TMA, 128 bytes of global scratch each per
    program) rather than taking host-side ones: its arguments are then plain tensors, so
    torch.compile can trace its launch (``wrap_triton`` outside Dynamo drops host descriptors) and
    the host builds no descriptor objects."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BN, BK])
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = tile_pid(tile_id, M, N, BM, BN, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k])
            b = b_desc.load([pid_n * BN, k])
            acc = mma(a, b.T, acc, INTERP)
        offs_m = pid_m * BM + tl.arange(0, BM)
        if EPI_SPLIT == 2:
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            offs_n = pid_n * BN + tl.arange(0, BN // 2)
            epilogue(acc0, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_sa,
                      stride_sb, stride_o, HAS_BIAS)
            epilogue(acc1, offs_m, offs_n + BN // 2, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr,
                      stride_sa, stride_sb, stride_o, HAS_BIAS)
        else:
            epilogue(acc, offs_m, pid_n * BN + tl.arange(0, BN), M, N, sa_ptr, sb_ptr, bias_ptr,
                      out_ptr, stride_sa, stride_sb, stride_o, HAS_BIAS)


@triton.jit(do_not_specialize=["stride_sa", "stride_sb"])
def _epilogue_kernel(c_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, stride_c, stride_sa,
                     stride_sb, stride_o, HAS_BIAS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr):
    """out = (s_a * s_b) * C + bias for an fp32 product C (M, N); out may alias C."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    acc = tl.load(c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :], mask=mask,
                  other=0.0)
    epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, out_ptr, stride_sa, stride_sb,
              stride_o, HAS_BIAS)


# The GEMM's device-side TMA descriptors take global scratch from the allocator.
_GEMM, _EPILOGUE = Launcher(_gemm_kernel, needs_scratch=True), Launcher(_epilogue_kernel)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------
# Tile configs: BM, BN, BK (elements), GROUP_M, num_warps, num_stages. The GPU defaults were picked
# by benchmarks/bench_gemm.py on an H200; the interpreter takes one small config.
_INTERP_GEMM_CONFIG = dict(BM=32, BN=32, BK=64, GROUP_M=2, EPI_SPLIT=2, num_warps=4, num_stages=1)
# EPI_SPLIT is 1 for 16-bit outputs; fp32 outputs take 2 (one tile's fp32 layout change in shared
# memory besides 3 pipeline stages would exceed the 227 KB a block may use). P: programs per SM.
GEMM_CONFIG = dict(BM=128, BN=256, BK=64, GROUP_M=16, EPI_SPLIT=1, num_warps=8, num_stages=3, P=1)
# For K <= SMALL_K (the products of small layers): 128 x 128 tiles, two programs per SM. A tile's
# K loop is short there, and one program's loop overlaps the other's epilogue (measured faster at
# the gpu-preset shapes, slower at K = 4096).
SMALL_K = 2048
SMALL_K_GEMM_CONFIG = dict(BM=128, BN=128, BK=64, GROUP_M=8, EPI_SPLIT=1, num_warps=4,
                           num_stages=3, P=2)
EPILOGUE_CONFIG = dict(BM=64, BN=128, num_warps=8)
# Below this K an output with fewer tiles than SMs still runs the Triton GEMM (default_method).
SPLIT_K_MIN = 4096


def gemm_config(k: int, out_dtype: torch.dtype) -> dict:
    """The tile config of the Triton TMA GEMM for a reduction length ``k`` and output dtype
    (GEMM_CONFIG, SMALL_K_GEMM_CONFIG for k <= SMALL_K; the interpreter's own config)."""
    if interpreting():
        return _INTERP_GEMM_CONFIG
    cfg = SMALL_K_GEMM_CONFIG if k <= SMALL_K else GEMM_CONFIG
    return dict(cfg, EPI_SPLIT=2 if out_dtype == torch.float32 else 1)


def default_method(m: int, n: int, k: int, device: torch.device) -> str:
    """The method ``scaled_mm(method="auto")`` uses for an (m, k) x (n, k) product on ``device``:
    "triton" on sm90+ (TMA; the fastest at every benchmarked shape on an H200) unless the output
    has fewer GEMM_CONFIG tiles than SMs and K >= SPLIT_K_MIN (the wgrad of small layers: a small
    output with a long K, which cuBLAS splits along K and our persistent kernel does not);
    "cublas" there, on older GPUs and under the interpreter. A small output with a short K stays
    on "triton": one launch and no fp32 intermediate, where cuBLAS's product and the epilogue
    take two (on an H200: equal GPU time up to K = 2048, less host time)."""
    if device.type == "cuda" and not interpreting() and capability(device) >= (9, 0):
        tiles = cdiv(m, GEMM_CONFIG["BM"]) * cdiv(n, GEMM_CONFIG["BN"])
        if tiles >= num_sms(device) or k < SPLIT_K_MIN:
            return "triton"
    return "cublas"


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
def kernel_out(m: int, n: int, out_dtype, device) -> torch.Tensor:
    """The output buffer: fp32 under the interpreter (torch casts it), else ``out_dtype``."""
    dtype = torch.float32 if interpreting() else out_dtype
    return torch.empty((m, n), dtype=dtype, device=device)


def _epilogue_args(a_outer: torch.Tensor, b_outer: torch.Tensor, bias: Optional[torch.Tensor]):
    """(s_a, s_b, bias pointer), the outer scales' strides (1 per-token, 0 per-tensor), flags."""
    bias_arg = bias if bias is not None else a_outer  # a dummy pointer when HAS_BIAS is False
    return (a_outer, b_outer, bias_arg), (int(a_outer.dim() == 1), int(b_outer.dim() == 1)), \
        dict(HAS_BIAS=bias is not None)


def _gemm_launch(a_inner: torch.Tensor, a_outer: torch.Tensor, b_inner: torch.Tensor,
                 b_outer: torch.Tensor, bias, out_dtype, cfg: Optional[dict]):
    """(output buffer, grid, positional arguments, keyword arguments) of the TMA GEMM's launch."""
    (m, k), n = a_inner.shape, b_inner.shape[0]
    cfg = dict(cfg or gemm_config(k, out_dtype))
    programs = num_sms(a_inner.device) * cfg.pop("P", 1)
    out = kernel_out(m, n, out_dtype, a_inner.device)
    scales, strides, flags = _epilogue_args(a_outer, b_outer, bias)
    tiles = cdiv(m, cfg["BM"]) * cdiv(n, cfg["BN"])
    args = (a_inner, b_inner, *scales, out, m, n, k, *strides, out.stride(0))
    kwargs = dict(INTERP=interpreting(), NUM_PROGRAMS=programs, **flags, **cfg)
    return out, (min(programs, tiles),), args, kwargs


def triton_mm(a_inner: torch.Tensor, a_outer: torch.Tensor, b_inner: torch.Tensor,
              b_outer: torch.Tensor, bias, out_dtype, cfg: Optional[dict] = None) -> torch.Tensor:
    """The "triton" method on contiguous 16-bit inner values: the persistent TMA GEMM with its
    fp32 epilogue (sm90+, or the interpreter). ``cfg``: a tile config (benchmarks)."""
    out, grid, args, kwargs = _gemm_launch(a_inner, a_outer, b_inner, b_outer, bias, out_dtype, cfg)
    _GEMM[grid](*args, **kwargs)
    return out.to(out_dtype)


def mm_f32(a_inner: torch.Tensor, b_inner: torch.Tensor) -> torch.Tensor:
    """A_inner @ B_inner^T in fp32 from 16-bit operands (cuBLAS on CUDA; an fp32 matmul on CPU)."""
    if a_inner.is_cuda:
        return torch.mm(a_inner, b_inner.t(), out_dtype=torch.float32)
    return torch.mm(a_inner.float(), b_inner.float().t())


def apply_epilogue(c: torch.Tensor, a_outer: torch.Tensor, b_outer: torch.Tensor, bias, out_dtype,
                   cfg: Optional[dict] = None) -> torch.Tensor:
    """(s_a * s_b) * C + bias for an fp32 (M, N) product C, one fp32 pass; in place for fp32 out."""
    cfg = dict(cfg or EPILOGUE_CONFIG)
    m, n = c.shape
    out = c if out_dtype == torch.float32 else kernel_out(m, n, out_dtype, c.device)
    scales, strides, flags = _epilogue_args(a_outer, b_outer, bias)
    grid = (cdiv(m, cfg["BM"]), cdiv(n, cfg["BN"]))
    _EPILOGUE[grid](c, *scales, out, m, n, c.stride(0), *strides, out.stride(0), **flags, **cfg)
    return out.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------
def check_operand(name: str, op: NVFP4Operand) -> NVFP4Operand:
    """Validate a GEMM operand: its inner values (float16 (rows, K), contiguous, K a multiple of
    16) when it has them, else its codes (``dequantize.check_codes``); and its outer scale.

    Raises:
        TypeError: values not float16 (or the codes' dtypes, see ``check_codes``), outer not fp32.
        ValueError: shapes, strides, devices as above.
    """
    if op.form is Form.CODES:
        return check_codes(name, op)
    v = op.values
    if v.dtype != torch.float16:
        raise TypeError(f"{name}: inner values must be float16, got {v.dtype}")
    if v.dim() != 2 or v.shape[1] % BLOCK:
        raise ValueError(f"{name}: inner values must be (rows, K) with K a multiple of {BLOCK}, got "
                         f"{tuple(v.shape)}")
    if not v.is_contiguous():
        raise ValueError(f"{name}: inner values must be contiguous, got strides {v.stride()}")
    return op._replace(outer_scale=check_outer(name, op.outer_scale, v.shape[0], v.device))


def _check_gemm(a: NVFP4Operand, b: NVFP4Operand, bias: Optional[torch.Tensor], out_dtype) -> None:
    """Checks across two validated operands."""
    if a.k != b.k:
        raise ValueError(f"K mismatch: A is ({a.rows}, {a.k}), B is ({b.rows}, {b.k})")
    if a.device != b.device:
        raise ValueError(f"A is on {a.device}, B on {b.device}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if bias is not None:
        if tuple(bias.shape) != (b.rows,) or not bias.is_floating_point():
            raise ValueError(f"bias must be a floating ({b.rows},) tensor, got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device}, the operands on {a.device}")


def _empty_product(a_outer, b_outer, m: int, n: int, bias, out_dtype) -> torch.Tensor:
    """The result when M, N or K is 0 (no kernel launch): the epilogue applied to zeros."""
    s_a = a_outer[:, None] if a_outer.dim() else a_outer
    s_b = b_outer[None, :] if b_outer.dim() else b_outer
    d = (s_a * s_b) * torch.zeros((m, n), device=a_outer.device)
    return (d if bias is None else d + bias.float()).to(out_dtype)


def inner_values(op: NVFP4Operand) -> torch.Tensor:
    """The fp16 inner values of a validated operand: its own, or one dequantize pass of its codes."""
    return op.values if op.form is Form.VALUES else dequantize_valid(op, torch.float16)


def scaled_mm(a: NVFP4Operand, b: NVFP4Operand, *, bias: Optional[torch.Tensor] = None,
              out_dtype: torch.dtype = torch.bfloat16, method: str = "auto") -> torch.Tensor:
    """NVFP4 GEMM D = (s_a * s_b) * (A_inner @ B_inner^T) + bias, the semantics of
    ``reference.scaled_mm``.

    Args:
        a: A (M, K) with codes (qdata (M, K/2) uint8 or float4_e2m1fn_x2, scale float8_e4m3fn
            (M, K/16) for Block.D1 or (M/16, K/16) for Block.D2) or with float16 inner values
            (M, K); outer scale float32 () or (M,).
        b: B (N, K), likewise; outer scale () or (N,).
        bias: optional (N,) floating tensor, added in fp32 after the outer scales.
        out_dtype: bfloat16, float16 or float32.
        method: "auto" (:func:`default_method`), "triton" or "cublas".
    Returns:
        (M, N) tensor of ``out_dtype`` on the operands' device. Products are exact, the sum is fp32
        (its order differs from the reference's), the outer scales and bias are applied in fp32 and
        the result is rounded once to ``out_dtype``.
    Raises:
        TypeError: wrong dtypes (see :func:`check_operand`) or an unsupported ``out_dtype``.
        ValueError: bad shapes, K mismatch, K not a multiple of 16, tensors on different devices
            or off CUDA (outside the interpreter), an unknown method.
    """
    a, b = check_operand("A", a), check_operand("B", b)
    _check_gemm(a, b, bias, out_dtype)
    if method == "auto":
        method = default_method(a.rows, b.rows, a.k, a.device)
    if method not in METHODS:
        raise ValueError(f"method must be 'auto' or one of {METHODS}, got {method!r}")
    check_runnable(a.device)
    if a.rows == 0 or b.rows == 0 or a.k == 0:
        return _empty_product(a.outer_scale, b.outer_scale, a.rows, b.rows, bias, out_dtype)
    a_in, b_in = inner_values(a), inner_values(b)
    if method == "triton":
        return triton_mm(a_in, a.outer_scale, b_in, b.outer_scale, bias, out_dtype)
    return apply_epilogue(mm_f32(a_in, b_in), a.outer_scale, b.outer_scale, bias, out_dtype)
