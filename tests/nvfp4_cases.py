"""Shared test inputs and assertions: random operands over many magnitudes, bit-exact comparison of
two quantizations, the recipe's operand pairs, short test ids; where the tests run the Triton
kernels (``KERNEL_DEVICE``, ``interpreter_only``: docs/testing.md)."""

import pytest
import torch

from nvfp4_recipe import reference as R
from nvfp4_recipe.backends import get_backend
from nvfp4_recipe.kernels.runtime import interpreting
from nvfp4_recipe.operand import NVFP4Operand
from nvfp4_recipe.recipe import NVFP4Recipe
from nvfp4_recipe.spec import GemmRole, QuantSpec

# Whether the Triton kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on a
# machine without a CUDA GPU), and the device of the tests that run them (directly, through the
# triton backend, or in layers with backend="triton"): CPU tensors under the interpreter, the GPU
# (compiled kernels) on a GPU machine. Tests take it as the ``kernel_device`` fixture; module-level
# code (parametrizations, helpers) reads it here.
INTERPRETING = interpreting()
KERNEL_DEVICE = torch.device("cpu" if INTERPRETING else "cuda")


def interpreter_only(why: str):
    """Marks a test (or a parametrization) that runs only under the Triton interpreter: skipped on a
    GPU machine, with ``why`` (what runs instead there) as the reason."""
    return pytest.mark.skipif(not INTERPRETING,
                              reason=f"runs under the Triton interpreter only: {why}")


def backend_device(backend: str) -> torch.device:
    """Where a test parametrized by backend runs: KERNEL_DEVICE for "triton", the CPU otherwise."""
    return KERNEL_DEVICE if backend == "triton" else torch.device("cpu")


def assert_same_step(modules, x: torch.Tensor, dy: torch.Tensor):
    """One forward and backward of each module on a copy of ``x`` with output gradient ``dy``:
    the outputs and the input gradients are equal bit for bit, and the gradient is not zero.
    Returns the (output, input gradient) of the first."""
    steps = []
    for module in modules:
        xi = x.clone().requires_grad_()
        y = module(xi)
        y.backward(dy)
        steps.append((y.detach(), xi.grad))
    for y, dx in steps[1:]:
        assert torch.equal(y, steps[0][0]) and torch.equal(dx, steps[0][1])
    assert steps[0][1].abs().sum() > 0
    return steps[0]


def rand(shape, dtype=torch.bfloat16, device="cpu", seed=0):
    """Random values over many magnitudes (per row and per element), with exact zeros,
    a zero 16x16 tile and values that hit E2M1 grid points exactly: E4M3 subnormal and zero block
    scales occur (rows span 2**+-12)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x * torch.exp2(torch.randint(-12, 12, shape[:-1] + (1,), generator=g).float())
    x = x * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
    x[torch.rand(shape, generator=g) < 0.02] = 0.0
    x[..., :16, 16:32] = 0.0
    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0])
    x.view(-1, 16)[3, :8] = grid  # a block whose values are exactly on the E2M1 grid
    return x.to(dtype).to(device)


def assert_fp32_products(got, pairs):
    """``got`` (fp32 rows, concatenated) against the float64 products ``a @ b`` of ``pairs``, within
    the error of fp32 accumulation in any order: gamma_K * (|a| @ |b|), gamma_K = K u / (1 - K u),
    u = 2**-23 (Higham, eq. 3.4, with one ulp per addition for blocked or tensor-core sums;
    tests/test_kernels_gemm.py). Rows no pair covers must be exact zeros."""
    a64 = [(a.double(), b.double()) for a, b in pairs]
    ref = torch.cat([a @ b for a, b in a64])
    gamma = [a.shape[1] * 2.0**-23 / (1 - a.shape[1] * 2.0**-23) for a, _ in a64]
    bound = torch.cat([g * (a.abs() @ b.abs()) for g, (a, b) in zip(gamma, a64)])
    err = got.double()
    err = torch.cat([err[:len(ref)] - ref, err[len(ref):]]).abs()
    bound = torch.cat([bound, bound.new_zeros(err.shape[0] - len(ref), *bound.shape[1:])])
    worst = (err / (bound + 1e-300)).max().item()
    assert worst <= 1.0, f"error exceeds the fp32 accumulation bound by a factor {worst:.3g}"


def tiny_hf_moe(arch: str, seed=None, meta: bool = False):
    """A one-layer Hugging Face Qwen3-MoE (``arch="qwen3_moe"``) or Mixtral of 4 experts
    (intermediate size 32), bfloat16; initialized after ``torch.manual_seed(seed)`` when a seed is
    given, built on the meta device with ``meta``."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    if seed is not None:
        torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
    with torch.device("meta" if meta else "cpu"):
        if arch == "qwen3_moe":
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                                       head_dim=16, num_experts=4, **common))
        else:
            model = MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=4, **common))
    return model.to(torch.bfloat16)


def random_signs(generator=None) -> torch.Tensor:
    """A random +-1 float32 vector of 16 RHT signs (CPU)."""
    bits = torch.randint(0, 2, (16,), generator=generator, device="cpu")
    return (1 - 2 * bits).to(torch.float32)


def signs_for(seed=3):
    return random_signs(torch.Generator().manual_seed(seed))


def assert_same(out: NVFP4Operand, ref: NVFP4Operand):
    """Bit-exact equality of two quantizations with codes (a NaN outer scale equals a NaN)."""
    assert out.qdata.dtype == torch.uint8 and out.scale.dtype == torch.float8_e4m3fn
    assert out.outer_scale.dtype == torch.float32 and out.block == ref.block
    assert out.qdata.shape == ref.qdata.shape and out.scale.shape == ref.scale.shape
    assert out.outer_scale.shape == ref.outer_scale.shape
    q, rq = out.qdata.cpu(), ref.qdata.cpu()
    assert torch.equal(q, rq), (q != rq).nonzero()[:5]
    assert torch.equal(out.scale.view(torch.uint8).cpu(), ref.scale.view(torch.uint8).cpu())
    o, ro = out.outer_scale.cpu(), ref.outer_scale.cpu()
    nan = ro.isnan()
    assert torch.equal(o.isnan(), nan) and torch.equal(o[~nan], ro[~nan])


def assert_inner_equals(out: NVFP4Operand, ref: NVFP4Operand):
    """An operand written as inner values equals the dequantized codes of ``ref``, bit for bit."""
    assert out.qdata is None and out.values.dtype == torch.float16
    want = R.dequantize_inner(ref).cpu()
    got = out.values.float().cpu()
    assert torch.equal(got, want), (got != want).nonzero()[:5]
    assert torch.equal(out.outer_scale.cpu(), ref.outer_scale.cpu())


def spec(block="1d", scaling="per_tensor", rounding="rn", rht=False, amax_scale=None):
    return QuantSpec(block, scaling, rounding, rht, amax_scale)


def recipe_pairs():
    """(name, rowwise spec, columnwise spec) of the operand pairs a linear quantizes in one pass."""
    r = NVFP4Recipe()
    est = NVFP4Recipe(amax_estimation=(2.0, 1.0))
    tok = NVFP4Recipe(scaling="per_token", stochastic_rounding=False)
    return [("x", r.spec(GemmRole.X_FPROP), r.spec(GemmRole.X_WGRAD)),
            ("dy", r.spec(GemmRole.DY_DGRAD), r.spec(GemmRole.DY_WGRAD)),
            ("x_estimated", est.spec(GemmRole.X_FPROP), est.spec(GemmRole.X_WGRAD)),
            ("per_token_rht", tok.spec(GemmRole.DY_DGRAD), tok.spec(GemmRole.DY_WGRAD))]


PAIR_IDS = [p[0] for p in recipe_pairs()]


def triton_backend(device):
    return get_backend("triton", torch.device(device))


def idfn(v):
    """Short test ids without spaces (GPU runs split tests by id)."""
    if isinstance(v, QuantSpec):
        return "-".join(str(getattr(f, "value", f)) for f in
                        (v.block, v.scaling, v.rounding, int(v.rht), v.amax_scale or ""))
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, tuple):
        return "x".join(map(str, v))
    return str(v)
