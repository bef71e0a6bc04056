"""Fused projection groups (q/k/v, gate/up; torchtitan's wq/wk/wv, w1/w3) quantize their weights
with one shared per-tensor amax while NVFP4Recipe.shared_weight_amax is on, in every path a layer
runs (training, fprop only, cached weights, torch.compile), and as before when it is off."""

import copy

import torch
from torch import nn

import nvfp4_recipe as N
from nvfp4_recipe import reference as R
from nvfp4_recipe.fused import fused_groups
from nvfp4_recipe.spec import GemmRole


class Attention(nn.Module):
    """torchtitan's names: wq/wk/wv/wo, and a feed-forward's w1/w2/w3."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(64, 64, bias=False) for _ in range(4))
        self.w1, self.w3, self.w2 = nn.Linear(64, 128), nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        h = self.wo(self.wq(x) * self.wk(x).sigmoid() + self.wv(x))
        return self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


def model_with_spread_amaxes(recipe, seed=0):
    torch.manual_seed(seed)
    model = Attention()
    with torch.no_grad():  # amaxes far apart, so that sharing one changes the bits
        for i, layer in enumerate((model.wq, model.wk, model.wv, model.w1, model.w3)):
            layer.weight *= 1 + i
    return N.quantize_(model, recipe)


def expected_y(layer, x, amax):
    """fprop by the reference: Q(X) @ Q(W with amax)^T + bias, in fp64."""
    spec = layer.recipe.spec
    w = R.dequantize(R.quantize(layer.weight.detach(), spec(GemmRole.W_FPROP), amax_=amax)).double()
    y = R.dequantize(R.quantize(x, spec(GemmRole.X_FPROP))).double() @ w.t()
    return y if layer.bias is None else y + layer.bias.double()


def test_torchtitan_and_hugging_face_names_are_grouped():
    model = model_with_spread_amaxes(N.NVFP4Recipe())
    assert fused_groups(model, lambda m: isinstance(m, N.NVFP4Linear)) == [("wq", "wk", "wv"), ("w1", "w3")]
    assert model.wq.weight_group is model.wv.weight_group and model.wo.weight_group is None
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2))
    N.quantize_(llama, N.NVFP4Recipe(keep_bf16=("lm_head",)))
    assert [g for g in fused_groups(llama, lambda m: getattr(m, "weight_group", None))] == [
        ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
         "model.layers.0.self_attn.v_proj"), ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")]


def test_members_share_the_largest_amax_in_training_and_in_fprop():
    model = model_with_spread_amaxes(N.NVFP4Recipe(backend="reference"), 1)
    x = torch.randn(32, 64)
    for group in ((model.wq, model.wk, model.wv), (model.w1, model.w3)):
        amax = torch.stack([m.weight.detach().abs().max() for m in group]).max()
        scales = {m.quantized_weight().outer_scale.item() for m in group}
        assert scales == {R.decode_scale(R.encode_scale(amax)).item()}
        for m in group:
            want = expected_y(m, x, amax)
            with torch.no_grad():
                assert torch.allclose(m(x).double(), want, rtol=1e-6, atol=1e-6)  # fprop only
            assert torch.allclose(m(x.requires_grad_()).double(), want, rtol=1e-6, atol=1e-6)


def test_off_gives_each_layer_its_own_amax_as_before():
    on = model_with_spread_amaxes(N.NVFP4Recipe(backend="reference"), 2)
    off = model_with_spread_amaxes(N.NVFP4Recipe(backend="reference", shared_weight_amax=False), 2)
    x = torch.randn(32, 64)
    for name in ("wq", "wk", "w1"):
        layer = getattr(off, name)
        own = layer.weight.detach().abs().max()
        with torch.no_grad():
            assert torch.allclose(layer(x).double(), expected_y(layer, x, own), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert not torch.equal(on.wq(x), off.wq(x))  # wq's amax is the smallest of its group
        assert torch.equal(on.wv(x), off.wv(x))  # wv's is the largest: the same bits
    N.set_recipe(on, shared_weight_amax=False)
    with torch.no_grad():
        assert torch.equal(on(x), off(x))


def test_cached_weights_follow_the_other_members():
    model = model_with_spread_amaxes(N.NVFP4Recipe(backend="reference"), 3)
    x = torch.randn(8, 64)
    with torch.no_grad(), N.cached_weights():
        before = model.wq(x)
        model.wv.weight.mul_(3)  # raises the group's amax (not by a power of 2): wq's bits change
        after = model.wq(x)
        assert torch.allclose(after.double(), expected_y(model.wq, x, model.wv.weight.abs().max()),
                              rtol=1e-6, atol=1e-6)
    assert not torch.equal(before, after)


def test_compiled_training_step_is_the_eager_one():
    model = model_with_spread_amaxes(N.NVFP4Recipe(backend="reference"), 4)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, 64)
    for m in (compiled, eager):
        m(x).square().mean().backward()
    with torch.no_grad():
        assert torch.equal(compiled(x), eager(x))
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad)
