"""NVFP4 mixture-of-experts layers (``nvfp4_recipe.moe``, ``backends/grouped.py``).

The grouped layer against a float64 emulation of its GEMMs on operands quantized per group by the
reference (the oracle of tests/test_kernels_grouped.py); the experts modules against per-expert
NVFP4 computations; ``quantize_`` on torchtitan-style and Hugging Face MoE models; the native
Blackwell grouped GEMM's plumbing against an emulation of ``F.scaled_grouped_mm``; the main job's
MoE model.

Tolerance of the emulation tests. The quantized operands are exact in float64, and so is each
product of inner values, so the only differences are the backend's fp32 sums and its roundings:
a sum of K terms is within gamma_K * sum_k |a_k b_k| of the exact one (gamma_K = K u / (1 - K u),
u = 2**-23 to cover tensor cores, Higham eq. 3.4; tests/test_kernels_gemm.py), the epilogue's fp32
scaling rounds once (2**-24 |d|) and the output cast once (half an ulp of the output dtype).
"""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nvfp4_recipe as nr
from nvfp4_recipe import gemms, moe, quantizers
from nvfp4_recipe import reference as R
from nvfp4_recipe.api import skip_reasons
from nvfp4_recipe import backends
from nvfp4_recipe.backends import get_backend, native
from nvfp4_recipe.backends import grouped as BG
from nvfp4_recipe.operand import GroupedOperand
from nvfp4_recipe.recipe import SR_OFFSETS
from nvfp4_recipe.spec import GemmRole, Rounding

from nvfp4_cases import backend_device, rand
from test_kernels_gemm import HALF_ULP, assert_matches_reference
from test_native import unswizzle

BACKENDS = ["reference", "triton"]  # triton: on kernel_device (the interpreter on CPU, or the GPU)


class GroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts`` layout and forward (a per-expert loop), high precision."""

    def __init__(self, dim, hidden_dim, num_experts, generator=None):
        super().__init__()
        self.num_experts = num_experts
        init = lambda *s: nn.Parameter(torch.randn(*s, generator=generator) / s[-1] ** 0.5)
        self.w1 = init(num_experts, hidden_dim, dim)
        self.w2 = init(num_experts, dim, hidden_dim)
        self.w3 = init(num_experts, hidden_dim, dim)

    def forward(self, x, num_tokens_per_expert):
        outs = []
        for g, x_g in enumerate(torch.split(x, num_tokens_per_expert.long().tolist())):
            h = F.silu(x_g @ self.w1[g].t()) * (x_g @ self.w3[g].t())
            outs.append(h @ self.w2[g].t())
        return torch.cat(outs)


class MoELayer(nn.Module):
    """A torchtitan-style MoE block: router.gate, GroupedExperts, shared experts (nn.Linear)."""

    def __init__(self, dim=32, hidden_dim=48, num_experts=4, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.router = nn.Module()
        self.router.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, g)
        self.shared_experts = nn.Sequential(nn.Linear(dim, hidden_dim), nn.SiLU(),
                                            nn.Linear(hidden_dim, dim))


def sr_state(seed=1234):
    return torch.tensor(seed), torch.tensor(0)


# ----------------------------------------------------------------------------------------------
# The grouped layer against a float64 emulation
# ----------------------------------------------------------------------------------------------
def dequantized_groups(op, bounds):
    """float64 dequantized operand of each group (grouped operand) or expert (stacked operand)."""
    if isinstance(op, GroupedOperand):
        return [R.dequantize(BG.group_slice(op, g, s, e)).double()
                for g, (s, e) in enumerate(bounds)]
    return [R.dequantize(BG.expert_slice(op, g)).double() for g in range(len(bounds))]


def assert_within_bound(got, a_groups, b_groups, rows_of, dtype):
    """got (per group rows_of(g) or the whole group output) against float64 A_g @ B_g^T within the
    module docstring's bound."""
    for g, (a, b) in enumerate(zip(a_groups, b_groups)):
        ref = a @ b.t()
        k = a.shape[1]
        gamma = k * 2.0**-23 / (1 - k * 2.0**-23)
        bound = gamma * (a.abs() @ b.abs().t()) + (2.0**-24 + HALF_ULP[dtype]) * ref.abs() + 1e-30
        out = rows_of(g).double()
        assert out.shape == ref.shape
        worst = ((out - ref).abs() / bound).max().item() if ref.numel() else 0.0
        assert worst <= 1.0, f"group {g}: error exceeds the bound by a factor {worst:.3g}"


def check_grouped_linear(backend, scaling, x_dtype, ends, k, n, device="cpu"):
    """Y, dX and dW of ``grouped_linear`` against float64 products of the operands the recipe
    prescribes, each quantized per group by the reference (on ``device``)."""
    recipe = nr.NVFP4Recipe(scaling=scaling, backend=backend)
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    t, g = ends[-1], len(ends)
    x = rand((t, k), x_dtype, device, seed=1).requires_grad_()
    w = (rand((g, n, k), torch.float32, device, seed=2) * 1e-3).requires_grad_()
    dy = rand((t, n), x_dtype, device, seed=3)
    signs = recipe.signs().to(device)
    y = moe.grouped_linear(x, w, offs, recipe, signs, *(s.to(device) for s in sr_state(1234)))
    y.backward(dy)
    assert y.dtype == x_dtype and x.grad.dtype == x_dtype and w.grad.dtype == torch.float32

    oracle, bounds = get_backend("reference", "cpu"), BG.group_bounds(offs)
    spec = recipe.spec
    xq, xt, _ = oracle.quantize_groups(x.detach(), offs, spec(GemmRole.X_FPROP), spec(GemmRole.X_WGRAD),
                             signs=signs)
    wq, wt = oracle.quantize_experts(w.detach(), spec(GemmRole.W_FPROP), need_t=True)
    dyq, dyt, _ = oracle.quantize_groups(dy, offs, spec(GemmRole.DY_DGRAD), spec(GemmRole.DY_WGRAD),
                               seed=1234, row_offset=SR_OFFSETS[GemmRole.DY_DGRAD],
                               col_offset=SR_OFFSETS[GemmRole.DY_WGRAD], signs=signs)
    d = lambda op: dequantized_groups(op, bounds)
    assert_within_bound(y, d(xq), d(wq), lambda g: y[slice(*bounds[g])], x_dtype)
    assert_within_bound(x.grad, d(dyq), d(wt), lambda g: x.grad[slice(*bounds[g])], x_dtype)
    assert_within_bound(w.grad, d(dyt), d(xt), lambda g: w.grad[g], torch.float32)
    for g, (s, e) in enumerate(bounds):
        assert e > s or (w.grad[g] == 0).all()  # an empty group


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scaling,x_dtype", [("per_tensor", torch.bfloat16),
                                             ("per_token", torch.float32)])
def test_grouped_linear_matches_float64_emulation(backend, scaling, x_dtype):
    """Y, dX and dW of ``grouped_linear`` equal float64 products of the operands the recipe
    prescribes (X and W for fprop, dY with SR stream ``sr_seed`` at offset 0 and W^T for dgrad,
    RHT'd dY^T at offset 2**31 and X^T for wgrad), each quantized per group by the reference."""
    check_grouped_linear(backend, scaling, x_dtype, (16, 16, 64, 96), 48, 32,
                         backend_device(backend))


@pytest.mark.cuda
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
def test_grouped_linear_matches_float64_emulation_cuda(device, scaling):
    check_grouped_linear("auto", scaling, torch.bfloat16, (512, 512, 1536, 2048, 2064, 3072),
                         768, 1024, device)


def test_grouped_linear_rejects_bad_offsets():
    recipe, x, w = nr.NVFP4Recipe(), torch.randn(48, 32), torch.randn(2, 16, 32)
    with pytest.raises(ValueError, match="group 0 has 24 tokens"):
        moe.grouped_linear(x, w, torch.tensor([24, 48], dtype=torch.int32), recipe,
                           recipe.signs(), *sr_state())
    with pytest.raises(TypeError, match="int32"):
        moe.grouped_linear(x, w, torch.tensor([16, 48]), recipe, recipe.signs(), *sr_state())


def test_pad_groups():
    """Each group's rows land at its padded start, groups padded to multiples of 16."""
    counts = torch.tensor([5.0, 0.0, 16.0, 17.0])  # torchtitan's counts are floats (histc)
    offs, dest, rows = moe.pad_groups(counts, 38)
    assert offs.dtype == torch.int32 and offs.tolist() == [16, 16, 32, 64]
    want = list(range(5)) + list(range(16, 32)) + list(range(32, 49))
    assert dest.tolist() == want
    assert rows % 16 == 0 and rows >= offs[-1].item()


# ----------------------------------------------------------------------------------------------
# Experts modules against per-expert NVFP4 computations
# ----------------------------------------------------------------------------------------------
def one_group_linear(x, w_g, recipe, signs):
    """x (n, K) times one expert's (1, N, K) weight through a one-group NVFP4 grouped linear,
    its tokens padded to a multiple of 16 (RN: no SR stream involved)."""
    offs, dest, rows = moe.pad_groups(torch.tensor([x.shape[0]]), x.shape[0])
    xp = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x)
    return moe.grouped_linear(xp, w_g, offs, recipe, signs, *sr_state()).index_select(0, dest)


def assert_grads_close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def test_torchtitan_experts_equal_per_expert_linears():
    """NVFP4GroupedExperts (padded groups, one grouped GEMM a projection) gives each expert's
    SwiGLU of one-group NVFP4 linears, forward and backward (round to nearest everywhere, so the
    SR streams play no part; RHT on the wgrad copies as in the recipe)."""
    recipe = nr.NVFP4Recipe(stochastic_rounding=False, backend="reference")
    hp = GroupedExperts(32, 48, 4, torch.Generator().manual_seed(0))
    ex = moe.NVFP4GroupedExperts.from_module(hp, recipe)
    counts = torch.tensor([7, 0, 20, 21])
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    dy = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    out = ex(x, counts)
    grads = torch.autograd.grad(out, (x, hp.w1, hp.w2, hp.w3), dy)
    signs = ex.rht_signs
    parts = []
    for g, x_g in enumerate(torch.split(x, counts.tolist())):
        w = lambda p: p[g:g + 1]
        h = F.silu(one_group_linear(x_g, w(hp.w1), recipe, signs)) * \
            one_group_linear(x_g, w(hp.w3), recipe, signs)
        parts.append(one_group_linear(h, w(hp.w2), recipe, signs))
    want = torch.cat(parts)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    assert_grads_close(grads, torch.autograd.grad(want, (x, hp.w1, hp.w2, hp.w3), dy))
    assert ex.sr_step.tolist() == [1, 1, 1]  # each projection's stream advanced once


def test_experts_sr_rank_is_added_to_the_key_and_set_sr_rank_reaches_them():
    """The experts' SR streams are keyed as NVFP4Linear's (``layer.sr_key``): an experts module
    with sr_rank r gives the gradients of a rank-0 one whose sr_seed is larger by r, and other
    gradients than rank 0; ``distributed.set_sr_rank`` sets the experts' rank too."""
    from nvfp4_recipe.distributed import set_sr_rank

    recipe = nr.NVFP4Recipe(backend="reference")
    hp = GroupedExperts(32, 48, 4, torch.Generator().manual_seed(0))
    counts = torch.tensor([7, 0, 20, 21])
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))

    def grads(ex):
        return torch.autograd.grad(ex(x, counts), (ex.w1, ex.w2, ex.w3), dy)

    base, ranked, shifted = (moe.NVFP4GroupedExperts.from_module(copy.deepcopy(hp), recipe)
                             for _ in range(3))
    ranked.sr_rank = 3
    with torch.no_grad():
        shifted.sr_seed += 3
    got, want = grads(ranked), grads(shifted)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(got, grads(base), strict=True))
    model = nn.ModuleDict({"experts": base})
    assert set_sr_rank(model) == 0 and base.sr_rank == 0  # an experts-only model has NVFP4 layers


def tiny_qwen3_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
                            moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=64)
    return Qwen3MoeForCausalLM(config)


def test_hf_experts_equal_per_expert_linears():
    """NVFP4HFExperts sorts, pads and groups the routed tokens: its output and gradients equal
    Hugging Face's per-expert loop with each projection a one-group NVFP4 linear."""
    experts = tiny_qwen3_moe().model.layers[0].mlp.experts
    recipe = nr.NVFP4Recipe(stochastic_rounding=False, backend="reference")
    ex = moe.NVFP4HFExperts.from_module(experts, recipe)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 64, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])
    index[:, 0] = torch.where(index[:, 0] == 1, 0, index[:, 0])  # a lightly used expert
    weights = torch.rand(24, 2, generator=g)
    dy = torch.randn(24, 64, generator=g)
    params = (x, experts.gate_up_proj, experts.down_proj)
    out = ex(x, index, weights)
    grads = torch.autograd.grad(out, params, dy)
    want = torch.zeros(24, 64)
    for e in range(4):
        tok, slot = torch.where(index == e)
        order = torch.argsort(tok * 2 + slot)  # the sorted order of the flat (token, slot) index
        tok, slot = tok[order], slot[order]
        gate, up = one_group_linear(x[tok], experts.gate_up_proj[e:e + 1], recipe,
                                    ex.rht_signs).chunk(2, dim=-1)
        h = one_group_linear(experts.act_fn(gate) * up, experts.down_proj[e:e + 1], recipe,
                             ex.rht_signs)
        want = want.index_add(0, tok, h * weights[tok, slot, None])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    assert_grads_close(grads, torch.autograd.grad(want, params, dy))


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_inference_is_the_training_forward(backend):
    """Under torch.no_grad the module runs fprop only, with the training forward's numbers."""
    hp = GroupedExperts(32, 48, 4, torch.Generator().manual_seed(0))
    dev = backend_device(backend)
    ex = moe.NVFP4GroupedExperts.from_module(hp, nr.NVFP4Recipe(backend=backend)).to(dev)
    x, counts = torch.randn(40, 32).to(dev), torch.tensor([10, 10, 0, 20], device=dev)
    with torch.no_grad():
        y = ex(x, counts)
    torch.testing.assert_close(ex(x.requires_grad_(), counts), y, rtol=0, atol=0)
    assert ex.sr_step.tolist() == [0, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_inference_takes_any_token_count(backend):
    """Inference with odd token counts (a decode step: 1 or 3 tokens, groups of any length) gives
    each token the output it gets among the others: the per-token rows of a larger batch."""
    hp = GroupedExperts(32, 48, 4, torch.Generator().manual_seed(0))
    dev = backend_device(backend)
    ex = moe.NVFP4GroupedExperts.from_module(hp, nr.NVFP4Recipe(backend=backend, scaling="per_token"))
    ex = ex.to(dev)
    x = torch.randn(21, 32, generator=torch.Generator().manual_seed(1)).to(dev)
    counts = torch.tensor([5, 0, 13, 3], device=dev)
    with torch.no_grad():
        y = ex(x, counts)
        assert y.shape == (21, 32) and torch.isfinite(y).all()
        one = ex(x[5:6], torch.tensor([0, 0, 1, 0], device=dev))  # one token, expert 2
    torch.testing.assert_close(one, y[5:6], rtol=0, atol=0)  # per-token scales: no batch coupling


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_cached_weights_quantize_once_with_the_same_outputs(monkeypatch, backend):
    """Inside cached_weights() the experts quantize each projection's weights once per weight
    version (three projections: three calls), with the outputs of uncached forwards."""
    hp = GroupedExperts(32, 48, 4, torch.Generator().manual_seed(0))
    dev = backend_device(backend)
    ex = moe.NVFP4GroupedExperts.from_module(hp, nr.NVFP4Recipe(backend=backend)).to(dev)
    x, counts = torch.randn(40, 32).to(dev), torch.tensor([10, 10, 0, 20], device=dev)
    be = get_backend(backend, dev)
    calls, quantize = [], type(be).quantize_experts

    def spy(self, w, *args, **kwargs):
        calls.append(w.shape)
        return quantize(self, w, *args, **kwargs)

    monkeypatch.setattr(type(be), "quantize_experts", spy)
    with torch.no_grad():
        uncached = ex(x, counts)
        assert len(calls) == 3
        with nr.cached_weights():
            outs = [ex(x, counts) for _ in range(3)]
            assert len(calls) == 6  # once per projection
            ex.w2.mul_(2)  # a new version of one weight
            updated = ex(x, counts)
            assert len(calls) == 7
        assert ex._weight_cache == {}
    for out in outs:
        assert torch.equal(out, uncached)
    assert not torch.equal(updated, uncached)


def test_experts_capture_records_the_operands_the_gemms_used():
    """``capture`` records each projection's operands per expert / token group; their
    dequantizations multiply to the projection's output (X_g W_g^T, fprop) and the recorded dY
    group and W_g^T give dX (dgrad), up to the fp32 sum order."""
    hp = GroupedExperts(32, 48, 4, torch.Generator().manual_seed(0))
    recipe = nr.NVFP4Recipe(backend="reference")
    model = nn.ModuleDict({"experts": moe.NVFP4GroupedExperts.from_module(hp, recipe)})
    x, counts = torch.randn(48, 32), torch.tensor([16, 0, 16, 16])
    with nr.capture(model) as ops:
        model["experts"](x, counts).square().sum().backward()
    rec = ops["experts"]
    assert set(rec) == {"w1", "w3", "w2"}
    w1 = rec["w1"]
    assert set(w1) == {"w", "x", "xt", "dy", "dyt"}
    assert len(w1["w"]) == 4 and len(w1["x"]) == 4
    assert w1["w"][0].shape == (48, 32) and w1["x"][2].shape == (16, 32)
    assert w1["xt"][2].shape == (32, 16) and w1["dyt"][2].shape == (48, 16)
    assert w1["x"][1].shape == (0, 32)  # an empty group
    # fprop of w1 on expert 2's tokens: the recorded X_g and W_g give h1 = X_g W_g^T
    x_g = x[16:32]  # expert 2's tokens (groups are padded to 16: none here)
    with torch.no_grad():
        seed, step, rank = model["experts"].sr_state(0)
        h1 = moe.grouped_linear(x_g, hp.w1[2:3].detach(), torch.tensor([16], dtype=torch.int32),
                                recipe, model["experts"].rht_signs, seed, step, "reference", rank)
    got = w1["x"][2].dequantize().double() @ w1["w"][2].dequantize().double().t()
    torch.testing.assert_close(got, h1.double(), rtol=1e-5, atol=1e-6 * h1.abs().max().item())
    for name in ("dy", "dyt"):
        assert all(t.rounding == Rounding.SR.value for t in w1[name])


# ----------------------------------------------------------------------------------------------
# quantize_ on MoE models
# ----------------------------------------------------------------------------------------------
def test_quantize_swaps_torchtitan_experts(caplog):
    """Experts become NVFP4GroupedExperts sharing their Parameters (an optimizer built before the
    swap trains them), the router stays high precision (logged), the shared experts are NVFP4
    linears; a second quantize_ changes nothing; dequantize_ gives the original module back."""
    model = MoELayer()
    hp_experts = model.experts
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w1 = model.experts.w1.detach().clone()
    with caplog.at_level(logging.INFO, logger="nvfp4_recipe"):
        nr.quantize_(model, nr.NVFP4Recipe(backend="reference"))
    assert isinstance(model.experts, moe.NVFP4GroupedExperts)
    assert model.experts.w1 is hp_experts.w1 and model.experts.w2 is hp_experts.w2
    assert type(model.router.gate) is nn.Linear
    assert "router.gate" in caplog.text and "router of an MoE layer" in caplog.text
    assert all(isinstance(m, nr.NVFP4Linear) for m in model.shared_experts if isinstance(m, nn.Linear))
    model.experts(torch.randn(32, 32), torch.tensor([16, 0, 8, 8])).square().sum().backward()
    opt.step()
    assert not torch.equal(model.experts.w1, w1)
    ex = model.experts
    nr.quantize_(model, nr.NVFP4Recipe(backend="reference"))
    assert model.experts is ex
    with pytest.raises(ValueError, match="NVFP4GroupedExperts.*under another recipe"):
        nr.quantize_(model.experts, nr.NVFP4Recipe(backend="reference", rht=False))
    nr.dequantize_(model)
    assert model.experts is hp_experts and type(model.shared_experts[0]) is nn.Linear


def test_quantize_keeps_experts_that_cannot_be_converted():
    """keep_bf16 patterns match experts modules by name; dims not multiples of 16 keep them too."""
    model = nn.ModuleDict({"a": MoELayer(), "b": MoELayer(dim=24)})
    recipe = nr.NVFP4Recipe(keep_bf16=("a.experts",))
    reasons = skip_reasons(model, recipe)
    assert "keep_bf16" in reasons["a.experts"] and "dim=24" in reasons["b.experts"]
    nr.quantize_(model, recipe)
    assert isinstance(model["a"].experts, GroupedExperts)
    assert isinstance(model["b"].experts, GroupedExperts)


def test_experts_state_dict():
    """The SR steps are saved and restored; a high-precision checkpoint loads into the NVFP4
    module, which keeps its own recipe buffers."""
    model = MoELayer()
    nr.quantize_(model, nr.NVFP4Recipe(backend="reference"))
    model.experts(torch.randn(16, 32), torch.tensor([16, 0, 0, 0])).sum().backward()
    sd = model.state_dict()
    assert sd["experts.sr_step"].tolist() == [1, 1, 1]
    fresh = MoELayer()
    fresh.load_state_dict(MoELayer(seed=1).state_dict())
    nr.quantize_(fresh, nr.NVFP4Recipe(backend="reference"))
    seeds = fresh.experts.sr_seed.clone()
    fresh.load_state_dict({k: v for k, v in sd.items() if "sr_" not in k and "rht" not in k},
                          strict=False)
    assert torch.equal(fresh.experts.sr_seed, seeds)
    fresh.load_state_dict(sd)
    assert fresh.experts.sr_step.tolist() == [1, 1, 1]
    assert len(set(seeds.tolist())) == 3  # one stream per projection


def test_quantize_hf_qwen3_moe_trains():
    """A tiny Qwen3-MoE: its experts become NVFP4HFExperts (the router, a Parameter, and lm_head
    kept), a training step gives finite gradients to the experts and lowers nothing to NaN."""
    model = tiny_qwen3_moe()
    nr.quantize_(model, nr.NVFP4Recipe(keep_bf16=("lm_head",), backend="reference"))
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.experts, moe.NVFP4HFExperts)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nr.NVFP4Linear)
    assert type(model.lm_head) is nn.Linear
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for p in (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    assert mlp.experts.sr_step.tolist() == [1, 1]


def test_hf_experts_with_another_layout_are_kept():
    experts = tiny_qwen3_moe().model.layers[0].mlp.experts
    experts.has_bias = True
    assert "has_bias=True" in moe.hf_experts_problem(experts)


# ----------------------------------------------------------------------------------------------
# Native Blackwell grouped GEMM: plumbing against an emulation of F.scaled_grouped_mm
# ----------------------------------------------------------------------------------------------
def emulated_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
                               swizzle_a=None, swizzle_b=None, bias=None, offs=None,
                               output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False):
    """F.scaled_grouped_mm for NVFP4 2d x 3d as documented (torch's GroupedBlas.cpp checks, MSLK's
    f4f4bf16_grouped_mm): A (T, K/2) and B (G, K/2, N) column-major float4_e2m1fn_x2; A's block
    scales per group padded to 128-row tiles in the swizzled layout, groups one after another
    (torchao's M-groups layout), B's per expert; the global scales' product scales each group;
    bf16 out."""
    F_ = torch.nn.functional
    assert mat_a.dtype == mat_b.dtype == torch.float4_e2m1fn_x2 and mat_b.stride(-2) == 1
    assert list(scale_recipe_a) == list(scale_recipe_b) == [F_.ScalingType.BlockWise1x16,
                                                           F_.ScalingType.TensorWise]
    assert swizzle_a[0] == swizzle_b[0] == F_.SwizzleType.SWIZZLE_32_4_4
    assert output_dtype == torch.bfloat16 and bias is None
    qa = mat_a.view(torch.uint8)
    kb = 2 * qa.shape[1] // 16
    blocks_a = scale_a[0].view(torch.uint8).flatten()
    out = torch.zeros(qa.shape[0], mat_b.shape[2], dtype=torch.bfloat16, device=qa.device)
    start, padded_start = 0, 0
    for g, end in enumerate(offs.tolist()):
        rows = -(-(end - start) // 128) * 128
        flat = blocks_a[padded_start * (-(-kb // 4) * 4):]
        sa = unswizzle(flat, end - start, kb) if end > start else None
        qb = mat_b[g].t().view(torch.uint8)  # (N, K/2)
        sb = unswizzle(scale_b[0][g], qb.shape[0], kb)
        if end > start:
            one = torch.ones((), device=qa.device)
            a_in = R.dequantize_inner(nr.NVFP4Operand(qa[start:end], sa, one))
            b_in = R.dequantize_inner(nr.NVFP4Operand(qb, sb, one))
            acc = a_in @ b_in.t()
            out[start:end] = (acc * (scale_a[1][g] * scale_b[1][g])).to(torch.bfloat16)
        start, padded_start = end, padded_start + rows
    return out


def native_backend() -> native.NativeBackend:
    """The native backend as ``get_backend`` registers it: with the Triton backend, on which its
    grouped primitives run (``get_backend`` refuses it off sm100, so it is registered here)."""
    backends._load("native")
    return native.NativeBackend()


def test_native_grouped_plumbing(monkeypatch, caplog, kernel_device):
    """fprop and dgrad on the native path (emulated) match each group's reference GEMM; per-token
    operands fall back to the Triton grouped GEMM (on ``kernel_device``), logged once."""
    monkeypatch.setattr(torch.nn.functional, "scaled_grouped_mm", emulated_scaled_grouped_mm)
    monkeypatch.setattr(native, "fp4_tensor_cores", lambda device: True)
    monkeypatch.setattr(native, "warn_once", lambda msg, key=None: logging.getLogger(
        "nvfp4_recipe").warning(msg))
    nb, oracle = native_backend(), get_backend("reference", "cpu")
    offs = torch.tensor([160, 160, 192, 320], dtype=torch.int32)  # 160 tokens: two 128-row tiles
    r = nr.NVFP4Recipe()
    x, w = rand((320, 64), seed=4), rand((4, 48, 64), torch.float32, seed=5)
    xq, _, _ = oracle.quantize_groups(x, offs, r.spec(GemmRole.X_FPROP), None)
    wq, _ = oracle.quantize_experts(w, r.spec(GemmRole.W_FPROP), need_t=False)
    y = nb.grouped_mm(xq, wq, out_dtype=torch.bfloat16)
    for g, (s, e) in enumerate(BG.group_bounds(offs)):
        if e > s:
            assert_matches_reference(y[s:e], BG.group_slice(xq, g, s, e), BG.expert_slice(wq, g))
    tok = nr.NVFP4Recipe(scaling="per_token")
    dev = kernel_device  # the fallback runs the Triton grouped GEMM
    dyq, _, _ = oracle.quantize_groups(rand((320, 48), device=dev, seed=6), offs.to(dev),
                                       tok.spec(GemmRole.DY_DGRAD), None, seed=1)
    _, wt = oracle.quantize_experts(w.to(dev), r.spec(GemmRole.W_FPROP), need_t=True)
    with caplog.at_level(logging.WARNING, logger="nvfp4_recipe"):
        dx = nb.grouped_mm(dyq, wt, out_dtype=torch.float32)
    assert "per-token" in caplog.text
    for g, (s, e) in enumerate(BG.group_bounds(offs)):
        if e > s:
            assert_matches_reference(dx[s:e], BG.group_slice(dyq, g, s, e), BG.expert_slice(wt, g),
                                     out_dtype=torch.float32)


def test_native_grouped_layer_reaches_scaled_grouped_mm(monkeypatch, kernel_device):
    """Through the layer's algorithm (``gemms.fprop``, X a transient copy) the native backend
    hands X to ``F.scaled_grouped_mm`` as codes, and gets the Triton grouped GEMM's result up to
    the fp32 summation order (one bf16 rounding each). On ``kernel_device``: the native backend
    quantizes the groups with the Triton kernels."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return emulated_scaled_grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_grouped_mm", counted)
    monkeypatch.setattr(native, "fp4_tensor_cores", lambda device: True)
    dev = kernel_device
    offs = torch.tensor([32, 32, 64], dtype=torch.int32, device=dev)
    r = nr.NVFP4Recipe()
    x, w = rand((64, 64), device=dev, seed=4), rand((3, 32, 64), torch.float32, dev, seed=5)
    signs = r.signs().to(dev)
    q = quantizers.build(r, signs, quantizers.FPROP_ONLY)

    def fprop(be):
        return gemms.fprop(gemms.Grouped(offs), be, x, w, None, q, torch.bfloat16)[0]
    y = fprop(native_backend())
    assert calls == [1]
    want = fprop(get_backend("triton", dev))
    torch.testing.assert_close(y.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def test_native_grouped_refuses_without_fp4_tensor_cores():
    offs = torch.tensor([32], dtype=torch.int32)
    oracle, r = get_backend("reference", "cpu"), nr.NVFP4Recipe()
    xq, _, _ = oracle.quantize_groups(rand((32, 64)), offs, r.spec(GemmRole.X_FPROP), None)
    wq, _ = oracle.quantize_experts(rand((1, 32, 64)), r.spec(GemmRole.W_FPROP), need_t=False)
    with pytest.raises(ValueError, match="sm100"):
        native.native_grouped_mm(xq, wq)


@pytest.mark.cuda
def test_native_grouped_on_blackwell(device):
    if not native.fp4_tensor_cores(device):
        pytest.skip("needs an sm100+ GPU")
    offs = torch.tensor([256, 256, 640, 1024], dtype=torch.int32, device=device)
    oracle, r = get_backend("reference", "cpu"), nr.NVFP4Recipe()
    xq, _, _ = oracle.quantize_groups(rand((1024, 512), device=device), offs, r.spec(GemmRole.X_FPROP), None)
    wq, _ = oracle.quantize_experts(rand((4, 768, 512), device=device), r.spec(GemmRole.W_FPROP),
                                    need_t=False)
    y = native.native_grouped_mm(xq, wq)
    for g, (s, e) in enumerate(BG.group_bounds(offs)):
        if e > s:
            assert_matches_reference(y[s:e], BG.group_slice(xq, g, s, e), BG.expert_slice(wq, g))


def test_blocked_group_scales_layout():
    """Each group's scales start at a 128-row tile boundary of the padded layout, as torchao's
    ``torch_to_blocked_2d_M_groups`` lays them out (computed here on the host)."""
    from torchao.prototype.mx_formats.utils import to_blocked
    g = torch.Generator().manual_seed(7)
    scale = torch.randint(1, 0x7F, (208, 5), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    offs = torch.tensor([0, 144, 160, 208], dtype=torch.int32)
    got = native.blocked_group_scales(scale, offs).view(torch.uint8)
    start, row = 0, 0
    for end in offs.tolist():
        if end > start:
            block = to_blocked(scale[start:end].view(torch.uint8)).view(-1, 8)
            assert torch.equal(got[row:row + block.shape[0]], block)
            row += block.shape[0]
        start = end
    assert (got[row:] == 0).all()


# ----------------------------------------------------------------------------------------------
# The main job's MoE model
# ----------------------------------------------------------------------------------------------
def test_tiny_moe_training_learns(tmp_path):
    """``nvfp4-recipe train --preset tiny --moe``: a top-2 MoE of 8 experts under bf16 and NVFP4
    learns on real text; the experts run in NVFP4, the router in high precision."""
    import json
    from nvfp4_recipe import cli
    out = tmp_path / "out"
    status = cli.main(["train", "--preset", "tiny", "--moe", "--recipes", "bf16", "nvfp4",
                       "--steps", "40", "--no-progress", "--out", str(out)])
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["n_experts"] == 8 and results["config"]["top_k"] == 2
    runs = {r["recipe"]: r for r in results["runs"]}
    assert "1/1 experts layers" in runs["nvfp4"]["quantized"]
    for run in runs.values():
        assert run["status"] == "ok"
        losses = [v for _, v in run["val_curve"]]
        assert losses[-1] < losses[0] - 1.0, losses
