"""frozen: an NVFP4 checkpoint as a frozen base (codes and scales only) whose forward is the trained
NVFP4Linear's bit for bit, whose dgrad reaches the input, and beside which PEFT's LoRA trains."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nvfp4_recipe as N
from nvfp4_recipe import reference as R
from nvfp4_recipe.frozen import NVFP4FrozenLinear, load_frozen, lora_config
from nvfp4_recipe.frozen_experts import NVFP4FrozenGroupedExperts, NVFP4FrozenHFExperts
from nvfp4_recipe.layer import layer_seed
from nvfp4_recipe.serving import export, record_amaxes

from nvfp4_cases import assert_same_step, backend_device, tiny_hf_moe

pytest.importorskip("safetensors")
FORMATS = ("compressed-tensors", "modelopt")


def make(dtype=torch.float32):
    return nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48)).to(dtype)


def exported(tmp_path, fmt, recipe, dtype=torch.float32):
    """A model quantized under ``recipe`` with random weights, and its export in layout ``fmt``."""
    model = make(dtype)
    N.quantize_(model, recipe)
    with record_amaxes(model) as amaxes:
        model(torch.randn(16, 64, dtype=dtype))
    return model, export(model, str(tmp_path / fmt), fmt, input_amax=amaxes,
                         allow_per_token=recipe.scaling.value == "per_token")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("recipe", [N.NVFP4Recipe(), N.NVFP4Recipe(weight_2d=False),
                                    N.NVFP4Recipe(scaling="per_token")], ids=["2d", "1d", "per_token"])
def test_frozen_forward_is_the_trained_forward_bit_for_bit(tmp_path, fmt, recipe):
    torch.manual_seed(0)
    model, path = exported(tmp_path, fmt, recipe)
    frozen = load_frozen(make(), path, recipe)
    assert isinstance(frozen[1], NVFP4FrozenLinear) and isinstance(frozen[3], NVFP4FrozenLinear)
    assert frozen[1].block.value == ("2d" if recipe.weight_2d else "1d")
    x = torch.randn(2, 24, 64)
    with torch.no_grad():
        assert torch.equal(frozen(x), model(x))
    assert torch.equal(frozen(x.requires_grad_()), model(x))  # the autograd path too


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_dgrad_is_the_trained_layers_dgrad_and_no_weight_is_kept(tmp_path, backend):
    """Same recipe, same SR stream (the layer seed of its name, as quantize_ gives it): Y and dX
    of the frozen layer are NVFP4Linear's."""
    torch.manual_seed(1)
    dev = backend_device(backend)  # the Triton backend's on kernel_device
    recipe = N.NVFP4Recipe(backend=backend)
    layer = N.NVFP4Linear(64, 128, recipe=recipe, layer_seed=layer_seed("1"))
    model = nn.Sequential(nn.LayerNorm(64), layer).to(dev)
    path = export(model, str(tmp_path / "e"), input_amax={"1": torch.tensor(3.0)})
    frozen = load_frozen(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128)), path,
                         recipe)[1].to(dev)
    x = torch.randn(32, 64).to(dev)
    dy = torch.randn(32, 128).to(dev)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa), frozen(xb)
    assert torch.equal(yb, ya)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(xb.grad, xa.grad)
    assert frozen.sr_step.item() == 1  # each backward advances its SR stream
    floats = [t for t in [*frozen.parameters(), *frozen.buffers()] if t.is_floating_point()]
    assert max(t.numel() for t in floats) < 128 * 64 // 16  # bias, signs, scale: nothing weight-sized
    assert list(frozen.parameters()) == []
    assert frozen.qdata.numel() + frozen.scale.numel() <= 128 * 64 * (0.5 + 1 / 16)


def test_1x16_checkpoint_dgrad_requantizes_w_transpose(tmp_path):
    torch.manual_seed(2)
    model, path = exported(tmp_path, "modelopt", N.NVFP4Recipe(weight_2d=False, stochastic_rounding=False))
    frozen = load_frozen(make(), path, N.NVFP4Recipe(weight_2d=False, stochastic_rounding=False))[3]
    w = frozen.weight.dequantize(torch.float32)
    x = torch.randn(16, 128, requires_grad=True)
    dy = torch.randn(16, 48)
    frozen(x).backward(dy)
    expect = R.scaled_mm(R.quantize(dy, N.QuantSpec("1d")), R.quantize(w.t(), N.QuantSpec("1d")))
    assert torch.equal(x.grad, expect)


def test_bf16_gemms_use_the_dequantized_weight(tmp_path):
    torch.manual_seed(3)
    model, path = exported(tmp_path, "compressed-tensors", N.NVFP4Recipe(), torch.bfloat16)
    frozen = load_frozen(make(torch.bfloat16), path, gemm="bf16")[1]
    w = model[1].quantized_weight().dequantize(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    y = frozen(x)
    assert torch.equal(y, F.linear(x.detach(), w, model[1].bias.detach()))
    assert torch.equal(y, frozen.dequantize()(x.detach()))  # nn.Linear on the dequantized weight
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, dy @ w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_gives_a_linear_holding_the_dequantized_weight(tmp_path, dtype):
    """``dequantize_`` of a frozen base swaps each NVFP4FrozenLinear for a plain nn.Linear in the
    layer's dtype: its weight the trained layer's quantized weight dequantized (exact in
    float32), its bias the checkpoint's, neither requiring grad (the weight was frozen); its
    forward is the frozen layer's gemm="bf16" one up to rounding."""
    torch.manual_seed(5)
    model, path = exported(tmp_path, "modelopt", N.NVFP4Recipe(), dtype)
    frozen = load_frozen(make(dtype), path, gemm="bf16").eval()
    x = torch.randn(8, 64, dtype=dtype)
    with torch.no_grad():
        want = frozen(x)
    back = N.dequantize_(frozen)
    assert [type(m) for m in back] == [nn.LayerNorm, nn.Linear, nn.GELU, nn.Linear]
    for i in (1, 3):
        w = model[i].quantized_weight().dequantize(torch.float32)
        assert back[i].weight.dtype == back[i].bias.dtype == dtype and not back[i].training
        assert torch.equal(back[i].weight, w.to(dtype)) and torch.equal(back[i].bias, model[i].bias.detach())
        assert not back[i].weight.requires_grad and not back[i].bias.requires_grad
    with torch.no_grad():  # up to rounding: nn.Linear adds the bias inside its GEMM
        ulp = torch.finfo(dtype).eps
        torch.testing.assert_close(back(x), want, rtol=ulp, atol=ulp * want.abs().max().item())


def test_lora_adapters_train_on_the_frozen_base(tmp_path):
    pytest.importorskip("peft")
    from peft import get_peft_model
    torch.manual_seed(4)
    _, path = exported(tmp_path, "compressed-tensors", N.NVFP4Recipe())
    peft_model = get_peft_model(load_frozen(make(), path),
                                lora_config(r=4, target_modules=["1", "3"], init_lora_weights=False))
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    x = torch.randn(32, 64, requires_grad=True)
    before = peft_model(x).detach()
    peft_model(x).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert x.grad.abs().sum() > 0
    with torch.no_grad():
        for p in trainable.values():
            p -= 0.1 * p.grad
    assert not torch.equal(peft_model(x).detach(), before)


@pytest.mark.parametrize("gemm", ["nvfp4", "bf16"])
@pytest.mark.parametrize("recipe", [N.NVFP4Recipe(), N.NVFP4Recipe(weight_2d=False)],
                         ids=["2d", "1d"])
def test_a_compiled_frozen_base_trains_as_in_eager_mode(tmp_path, gemm, recipe):
    """A frozen base with LoRA-like trainable neighbours under torch.compile (fullgraph, the
    traced graph): the outputs and dX of eager mode, bit for bit, with dgrad's SR stream advancing
    alike; fresh random inputs."""
    torch.manual_seed(int(torch.randint(1 << 30, ())))
    _, path = exported(tmp_path, "compressed-tensors", recipe)
    model = load_frozen(make(), path, gemm=gemm)
    compiled = torch.compile(copy.deepcopy(model), backend="aot_eager", fullgraph=True)
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    for _ in range(2):  # the second step draws other SR bits in both
        assert_same_step((model, compiled), x, dy)
    torch._dynamo.reset()


def test_load_errors_name_the_problem(tmp_path):
    _, path = exported(tmp_path, "compressed-tensors", N.NVFP4Recipe())
    with pytest.raises(ValueError, match="checkpoint layer '1'.*not an nn.Linear of that shape"):
        load_frozen(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(), nn.Linear(128, 48)), path)
    with pytest.raises(ValueError, match="unexpected"):
        load_frozen(nn.Sequential(nn.Identity(), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48)), path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no NVFP4 checkpoint config"):
        load_frozen(make(), str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="gemm must be one of"):
        NVFP4FrozenLinear(torch.zeros(16, 8, dtype=torch.uint8),
                          torch.zeros(16, 1, dtype=torch.float8_e4m3fn), torch.ones(()), gemm="fp8")


def test_casting_the_model_keeps_the_quantized_weight():
    """``model.to(torch.bfloat16)`` (as PEFT users do) casts floating-point buffers: the E4M3
    scales and the fp32 outer scale keep their dtypes and bits, and the layer its output."""
    g = torch.Generator().manual_seed(3)
    op = R.quantize(torch.randn(48, 64, generator=g), N.QuantSpec())  # a checkpoint's 1x16 scales
    layer = NVFP4FrozenLinear(op.qdata, op.scale, op.outer_scale, recipe=N.NVFP4Recipe(backend="reference"))
    x = torch.randn(16, 64, generator=g).bfloat16()
    with torch.no_grad():
        before = layer(x)
        layer.to(torch.bfloat16)
        assert (layer.qdata.dtype, layer.scale.dtype, layer.outer_scale.dtype) == (
            torch.uint8, torch.float8_e4m3fn, torch.float32)
        assert torch.equal(layer.scale.view(torch.uint8), op.scale.view(torch.uint8))
        assert torch.equal(layer.outer_scale, op.outer_scale) and torch.equal(layer(x), before)


def test_overrides_that_need_the_high_precision_weight_are_refused():
    op = R.quantize(torch.randn(48, 64), N.QuantSpec())
    for fields in (dict(forward_override="high_precision"), dict(backward_override="dequantized")):
        with pytest.raises(ValueError, match="keeps no high-precision weight"):
            NVFP4FrozenLinear(op.qdata, op.scale, op.outer_scale, recipe=N.NVFP4Recipe(**fields))


def test_set_recipe_asks_the_frozen_base_first():
    op = R.quantize(torch.randn(48, 64), N.QuantSpec())
    model = nn.Sequential(NVFP4FrozenLinear(op.qdata, op.scale, op.outer_scale,
                                            recipe=N.NVFP4Recipe(backend="reference")))
    with pytest.raises(ValueError, match="keeps no high-precision weight"):
        N.set_recipe(model, backward_override="high_precision")
    assert model[0].recipe.backward_override is None


def test_a_meta_built_hugging_face_model_gets_every_buffer(tmp_path):
    """The rotary inv_freq (non-persistent, in no checkpoint) is set by the model's own init, as
    from_pretrained does: the loaded model's logits are the trained model's."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = N.quantize_(LlamaForCausalLM(config).to(torch.bfloat16), N.NVFP4Recipe(keep_bf16=("lm_head",)))
    with record_amaxes(model) as amaxes:
        model(torch.randint(0, 128, (2, 16)))
    path = export(model, str(tmp_path / "e"), input_amax=amaxes)
    with torch.device("meta"):
        loaded = LlamaForCausalLM(config).to(torch.bfloat16)
    load_frozen(loaded, path)
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    assert torch.equal(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


class WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(64), nn.Linear(64, 128)
        self.register_buffer("table", torch.randn(64), persistent=False)

    def forward(self, x):
        return self.proj(self.norm(x + self.table))


def test_a_buffer_nothing_sets_is_refused_by_name(tmp_path):
    model = N.quantize_(WithTable(), N.NVFP4Recipe())
    path = export(model, str(tmp_path / "e"), input_amax={"proj": 3.0})
    with torch.device("meta"):
        loaded = WithTable()
    with pytest.raises(ValueError, match=r"neither in the checkpoint.*\['table'\]"):
        load_frozen(loaded, path)


def test_each_frozen_layer_has_its_own_sr_stream_and_counts_in_summary(tmp_path):
    torch.manual_seed(3)
    model, path = exported(tmp_path, "compressed-tensors", N.NVFP4Recipe())
    frozen = load_frozen(make(), path)
    assert int(frozen[1].sr_seed) == layer_seed("1") and int(frozen[3].sr_seed) == layer_seed("3")
    table = N.summary(frozen)
    assert "2 of 2 linear layers in NVFP4 (2 frozen)" in table and "frozen (2d scales" in table


def test_merging_lora_into_the_frozen_base_says_it_is_not_supported(tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(4)
    _, path = exported(tmp_path, "compressed-tensors", N.NVFP4Recipe())
    model = peft.get_peft_model(load_frozen(make(), path), lora_config(r=4, target_modules=["1", "3"]))
    with pytest.raises(NotImplementedError, match="merging LoRA adapters into an NVFP4 frozen base"):
        model.merge_and_unload()


# ---------------------------------------------------------------------------------------------
# MoE experts: an export's per-expert linears read back as frozen experts modules
# ---------------------------------------------------------------------------------------------
def sgd_step(model, loss):
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad / p.grad.abs().max()
                p.grad = None


def exported_moe(tmp_path, arch, recipe, fmt="compressed-tensors", seed=0):
    """A tiny Hugging Face MoE quantized under ``recipe`` after one SGD step, and its export."""
    torch.manual_seed(seed)
    model = N.quantize_(tiny_hf_moe(arch), recipe)
    sgd_step(model, model(torch.randint(0, 128, (2, 32))).logits.float().square().mean())
    with record_amaxes(model) as amaxes, torch.no_grad():
        model(torch.randint(0, 128, (2, 32)))
    return model, export(model, str(tmp_path / fmt), fmt, input_amax=amaxes)


def routing(tokens, seed):
    """Random inputs of Hugging Face experts of 4: hidden states (tokens, 64) bf16, each token's 2
    distinct experts and their weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g).bfloat16()
    top_k = torch.rand(tokens, 4, generator=g).topk(2).indices
    return x, top_k, torch.rand(tokens, 2, generator=g).bfloat16()


EXPERTS = "model.layers.0.mlp.experts"
MOE_RECIPE = N.NVFP4Recipe(keep_bf16=("lm_head",))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch,weight_2d", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_a_frozen_moe_computes_the_trained_logits_bit_for_bit(tmp_path, fmt, arch, weight_2d):
    """Each experts module of a meta-built model becomes an NVFP4FrozenHFExperts holding, per
    Parameter, the export's per-expert linears stacked back (an expert's gate and up rows, one
    decode scale per expert; Mixtral's block_sparse_moe names read into its mlp): the weights the
    trained grouped fprop used, so the loaded model's logits are the trained model's bit for bit,
    in evaluation and with autograd."""
    recipe = N.NVFP4Recipe(weight_2d=weight_2d, keep_bf16=("lm_head",))
    model, path = exported_moe(tmp_path, arch, recipe, fmt, seed=len(fmt) + weight_2d)
    loaded = load_frozen(tiny_hf_moe(arch, meta=True), path, recipe)
    frozen, trained = loaded.get_submodule(EXPERTS), model.get_submodule(EXPERTS)
    assert isinstance(frozen, NVFP4FrozenHFExperts) and list(frozen.parameters()) == []
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    spec = recipe.spec(N.GemmRole.W_FPROP)
    for p in ("gate_up_proj", "down_proj"):
        assert frozen.specs[p].block is spec.block
        for e in range(4):
            used = R.quantize(getattr(trained, p)[e].detach(), spec)  # each W_e alone, as fprop
            assert torch.equal(frozen.dequantized(p)[e], R.dequantize(used))
    tokens = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    assert torch.equal(loaded(tokens).logits, model(tokens).logits)  # the autograd path too


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_frozen_experts_are_the_trained_experts_given_their_codes(backend):
    """Built from the codes NVFP4GroupedExperts' fprop uses (each W_e quantized alone, 2d blocks,
    written as an export writes them: 1x16): Y and dX are the trained module's bit for bit under
    the same SR streams, nothing weight-sized in floating point is kept, and Module.to(dtype)
    leaves the codes and scales as they are."""
    from nvfp4_recipe.train.model import GroupedExperts
    dev = backend_device(backend)
    torch.manual_seed(9)
    hp = GroupedExperts(32, 48, 4)
    for w in hp.parameters():
        nn.init.normal_(w, std=0.1)
    recipe = N.NVFP4Recipe(backend=backend)
    trained = N.NVFP4GroupedExperts.from_module(hp, recipe, layer_seed=7).to(dev)
    spec = recipe.spec(N.GemmRole.W_FPROP)
    weights = {}
    for p in ("w1", "w3", "w2"):
        ops = [R.quantize(w.detach(), spec) for w in getattr(hp, p)]
        rows = [op.scale.view(torch.uint8).repeat_interleave(16, 0).view(torch.float8_e4m3fn) for op in ops]
        weights[p] = (torch.stack([op.qdata for op in ops]), torch.stack(rows),
                      torch.stack([op.outer_scale for op in ops]))
    frozen = NVFP4FrozenGroupedExperts(weights, recipe, torch.float32, layer_seed=7).to(dev)
    assert [frozen.specs[p].block.value for p in frozen.STREAMS] == ["2d"] * 3
    x, counts = torch.randn(64, 32).to(dev), torch.tensor([16, 0, 40, 8]).to(dev)
    dy = torch.randn(64, 32).to(dev)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = trained(xa, counts), frozen(xb, counts)
    assert torch.equal(yb, ya)
    ya.backward(dy)
    yb.backward(dy)
    assert xb.grad.abs().sum() > 0 and torch.equal(xb.grad, xa.grad)
    assert frozen.sr_step.tolist() == [1, 1, 1]  # each projection's stream advanced once
    assert max(t.numel() for t in frozen.buffers() if t.is_floating_point()) < 4 * 48 * 32 // 16
    with torch.no_grad():
        before = frozen(x, counts)
        frozen.to(torch.bfloat16)
        assert (frozen.w1_qdata.dtype, frozen.w1_scale.dtype, frozen.w1_outer_scale.dtype) == (
            torch.uint8, torch.float8_e4m3fn, torch.float32)
        assert torch.equal(frozen(x, counts), before)
    with pytest.raises(ValueError, match=r"NVFP4FrozenGroupedExperts: weights .* are not"):
        NVFP4FrozenGroupedExperts({**weights, "w2": weights["w1"]})


def tiny_lm_moe(seed=0, device="cpu"):
    from nvfp4_recipe.train.model import ModelConfig, TinyLM
    torch.manual_seed(seed)
    with torch.device(device):
        return TinyLM(ModelConfig(d_model=64, n_layers=1, n_heads=4, d_ff=64, seq_len=32, n_experts=4, top_k=2))


def test_frozen_torchtitan_experts_hold_the_exported_weights(tmp_path):
    """The main job's --moe TinyLM (torchtitan's w1 / w3 / w2): each expert's w1 and w3, quantized
    apart in training, are exported with one global scale (the larger amax's), and the frozen
    experts hold the export's weights. Where training's w1 and w3 amaxes agree (made so here for
    every expert) the export is exact and the loaded model's logits are the trained model's bit
    for bit."""
    model = N.quantize_(tiny_lm_moe(5), MOE_RECIPE)
    tokens = torch.randint(0, 256, (2, 32))
    sgd_step(model, model(tokens).float().square().mean())
    experts = model.blocks[0].mlp.experts
    spec = MOE_RECIPE.spec(N.GemmRole.W_FPROP)
    with record_amaxes(model) as amaxes, torch.no_grad():
        model(tokens)
    frozen = load_frozen(tiny_lm_moe(device="meta"), export(model, str(tmp_path / "a"), input_amax=amaxes),
                         MOE_RECIPE).blocks[0].mlp.experts
    assert isinstance(frozen, NVFP4FrozenGroupedExperts) and frozen.num_experts == 4
    differ = 0
    for g in range(4):
        w1, w3, w2 = experts.w1[g].detach(), experts.w3[g].detach(), experts.w2[g].detach()
        shared = torch.maximum(w1.abs().amax(), w3.abs().amax())
        differ += not torch.equal(w1.abs().amax(), w3.abs().amax())
        for p, w, amax in (("w1", w1, shared), ("w3", w3, shared), ("w2", w2, w2.abs().amax())):
            assert torch.equal(frozen.dequantized(p)[g], R.dequantize(R.quantize(w, spec, amax_=amax)))
    assert differ  # random weights: the requantized case was read
    with torch.no_grad():  # one amax for each expert's w1 and w3: the export is exact
        for g in range(4):
            amax = torch.maximum(experts.w1[g].abs().max(), experts.w3[g].abs().max())
            experts.w1[g, 0, 0], experts.w3[g, 0, 0] = amax, amax
    loaded = load_frozen(tiny_lm_moe(device="meta"), export(model, str(tmp_path / "b"), input_amax=amaxes),
                         MOE_RECIPE)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert torch.equal(loaded(tokens), model(tokens))


def test_frozen_experts_dgrad_is_the_trained_experts_dgrad(tmp_path):
    """Same recipe, same SR streams (the experts module's name, one per projection): a frozen
    Qwen3-MoE experts module's output and input gradient are the trained NVFP4HFExperts'."""
    model, path = exported_moe(tmp_path, "qwen3_moe", MOE_RECIPE, seed=3)
    loaded = load_frozen(tiny_hf_moe("qwen3_moe", meta=True), path, MOE_RECIPE)
    frozen, trained = loaded.get_submodule(EXPERTS), model.get_submodule(EXPERTS)
    assert int(frozen.sr_seed[0]) == int(trained.sr_seed[0])
    trained.reset_recipe_buffers()  # its training step advanced its SR streams
    x, top_k, weights = routing(40, 4)
    dy = torch.randn(40, 64).bfloat16()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = trained(xa, top_k, weights), frozen(xb, top_k, weights)
    assert torch.equal(yb, ya)
    ya.backward(dy)
    yb.backward(dy)
    assert xb.grad.abs().sum() > 0 and torch.equal(xb.grad, xa.grad)
    assert frozen.sr_step.tolist() == [1, 1]


def test_dequantize_gives_the_replaced_experts_module_holding_the_dequantized_weights(tmp_path):
    """``dequantize_`` of a frozen MoE swaps each frozen experts module for the experts module it
    replaced (transformers' Qwen3MoeExperts), its Parameters the frozen weights dequantized in
    the module's dtype, not requiring grad, off the meta device; its forward is the frozen
    module's gemm="bf16" one up to rounding."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    _, path = exported_moe(tmp_path, "qwen3_moe", MOE_RECIPE, seed=6)
    loaded = load_frozen(tiny_hf_moe("qwen3_moe", meta=True), path, MOE_RECIPE, gemm="bf16").eval()
    frozen = loaded.get_submodule(EXPERTS)
    x, top_k, weights = routing(48, 7)
    with torch.no_grad():
        want = frozen(x, top_k, weights)
    N.dequantize_(loaded)
    back = loaded.get_submodule(EXPERTS)
    assert type(back) is Qwen3MoeExperts and not back.training
    for p in ("gate_up_proj", "down_proj"):
        w = getattr(back, p)
        assert w.dtype == torch.bfloat16 and not w.requires_grad and not w.is_meta
        assert torch.equal(w, frozen.dequantized(p).bfloat16())
    with torch.no_grad():
        got = back(x, top_k, weights)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())


def test_lora_adapters_train_beside_frozen_experts(tmp_path):
    """PEFT's LoRA on the attention of a frozen MoE: the adapters train, the gradient passing
    back through the frozen experts (their dgrad ran: each stream advanced). The frozen experts
    have no Parameters, so LoRA does not target them."""
    peft = pytest.importorskip("peft")
    _, path = exported_moe(tmp_path, "qwen3_moe", MOE_RECIPE, seed=8)
    loaded = load_frozen(tiny_hf_moe("qwen3_moe", meta=True), path, MOE_RECIPE)
    model = peft.get_peft_model(loaded, lora_config(r=4, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    model(torch.randint(0, 128, (2, 32))).logits.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert loaded.get_submodule(EXPERTS).sr_step.tolist() == [1, 1]


def test_expert_checkpoints_that_do_not_fit_are_refused_by_name(tmp_path):
    """An expert's gate and up with different global scales (the grouped GEMM takes one per
    expert), or an experts module with a projection missing, is refused naming the linears."""
    from safetensors.torch import load_file, save_file
    _, path = exported_moe(tmp_path, "qwen3_moe", MOE_RECIPE, seed=10)
    file = str(tmp_path / "compressed-tensors" / "model.safetensors")
    tensors = load_file(file)
    tensors[f"{EXPERTS}.1.up_proj.weight_global_scale"] *= 2
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.1\.gate_proj, .*experts\.1\.up_proj have different global scales"):
        load_frozen(tiny_hf_moe("qwen3_moe", meta=True), path)
    tensors[f"{EXPERTS}.1.up_proj.weight_global_scale"] /= 2
    tensors = {k: v for k, v in tensors.items() if not k.startswith(f"{EXPERTS}.3.down_proj.")}
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds 11 of the 12 NVFP4 projections of the experts of "
                                         r"model\.layers\.0\.mlp\.experts \(missing \['model\.layers\.0\.mlp\.experts\.3\.down_proj'\]\)"):
        load_frozen(tiny_hf_moe("qwen3_moe", meta=True), path)
