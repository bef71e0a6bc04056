"""frozen: an NVFP4 checkpoint as a frozen base (codes and scales only) whose forward is the trained
NVFP4Linear's bit for bit, whose dgrad reaches the input, and beside which PEFT's LoRA trains."""

import pytest
import torch
from torch import nn

import nvfp4_recipe as N
from nvfp4_recipe import reference as R
from nvfp4_recipe.frozen import NVFP4FrozenLinear, load_frozen, lora_config
from nvfp4_recipe.layer import layer_seed
from nvfp4_recipe.serving import export, record_amaxes

from nvfp4_cases import backend_device

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
    assert torch.equal(y, x.detach() @ w.t() + model[1].bias.detach())
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
