"""serving.export: the NVFP4 weights training used, read back by the real readers (compressed-tensors,
Hugging Face from_pretrained) and checked against ModelOpt's documented layout; MoE experts as
the per-expert linears serving engines load; the main job's --export round trip."""

import dataclasses
import json
import os

import pytest
import torch
from torch import nn

import nvfp4_recipe as N
from nvfp4_recipe import cli
from nvfp4_recipe import reference as R
from nvfp4_recipe.formats import e2m1_decode, unpack_nibbles
from nvfp4_recipe.frozen_experts import NVFP4FrozenGroupedExperts
from nvfp4_recipe.serving import export, record_amaxes
from nvfp4_recipe.train import job
from nvfp4_recipe.train.recipes import make_recipe

from nvfp4_cases import tiny_hf_moe

safetensors = pytest.importorskip("safetensors.torch")
ct = pytest.importorskip("compressed_tensors")


def trained_model(recipe=None, dtype=torch.float32, seed=0):
    """LayerNorm + two NVFP4Linears after one SGD step on random data, and its recorded amaxes."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48)).to(dtype)
    N.quantize_(model, recipe or N.NVFP4Recipe())
    x = torch.randn(32, 64, dtype=dtype)
    model(x).float().square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
    with record_amaxes(model) as amaxes:
        model(x)
        model(3 * torch.randn(16, 64, dtype=dtype))
    return model, amaxes


def layers(model):
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, N.NVFP4Linear)}


def read(path):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return config, safetensors.load_file(os.path.join(path, "model.safetensors"))


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("weight_2d", [True, False])
def test_compressed_tensors_decompresses_the_weight_training_used(tmp_path, weight_2d):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    model, amaxes = trained_model(N.NVFP4Recipe(weight_2d=weight_2d), torch.bfloat16)
    export(model, str(tmp_path / "ct"), input_amax=amaxes)
    config, tensors = read(tmp_path / "ct")
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    for fqn, layer in layers(model).items():
        used = layer.quantized_weight()
        state = {k[len(fqn) + 1:]: v for k, v in tensors.items() if k.startswith(fqn + ".")}
        weight = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight.view(torch.int16), used.dequantize(torch.bfloat16).view(torch.int16))
        assert torch.equal(state["weight_packed"], used.qdata)
        # the encode-scale convention: 1 / weight_global_scale is training's outer scale, bit for bit
        assert torch.equal(torch.ones(1) / state["weight_global_scale"], used.outer_scale.reshape(1))
        assert torch.equal(state["input_global_scale"], R.encode_scale(amaxes[fqn]).reshape(1))
        assert amaxes[fqn] > 0


def test_hugging_face_loads_the_compressed_tensors_export(tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    N.quantize_(model, N.NVFP4Recipe(keep_bf16=("lm_head",)))
    with record_amaxes(model) as amaxes:
        model(torch.randint(0, 128, (2, 16)))
    path = export(model, str(tmp_path / "llama"), input_amax=amaxes)
    assert read(path)[0]["quantization_config"]["ignore"] == ["lm_head"]
    dense = AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True))
    packed = dict(AutoModelForCausalLM.from_pretrained(path).named_buffers())
    packed.update(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    hf = dict(dense.named_parameters())
    for fqn, layer in layers(model).items():
        used = layer.quantized_weight()
        assert torch.equal(hf[fqn + ".weight"].view(torch.int16), used.dequantize().view(torch.int16))
        assert torch.equal(packed[fqn + ".weight_packed"], used.qdata)
    assert torch.equal(hf["lm_head.weight"], model.lm_head.weight)
    assert torch.equal(hf["model.norm.weight"], model.model.norm.weight)


def test_modelopt_layout_is_the_documented_one(tmp_path):
    """ModelOpt's HF NVFP4 export: weight uint8 (N, K/2) low nibble first, weight_scale E4M3 (N, K/16),
    weight_scale_2 = amax / 2688 and input_scale = input amax / 2688 (fp32 scalars), a value being
    code * (weight_scale * weight_scale_2) (NVFP4QTensor.dequantize); hf_quant_config.json."""
    model, amaxes = trained_model(N.NVFP4Recipe(), torch.bfloat16, seed=2)
    export(model, str(tmp_path / "mo"), "modelopt", input_amax=amaxes)
    config, tensors = read(tmp_path / "mo")
    with open(tmp_path / "mo" / "hf_quant_config.json") as f:
        hf_quant = json.load(f)
    assert hf_quant["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                        "group_size": 16, "exclude_modules": []}
    assert config["quantization_config"]["quant_method"] == "modelopt"
    for fqn, layer in layers(model).items():
        used = layer.quantized_weight()
        w, scale, scale_2 = (tensors[f"{fqn}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2"))
        assert (w.dtype, scale.dtype, scale_2.dtype) == (torch.uint8, torch.float8_e4m3fn, torch.float32)
        assert w.shape == (layer.out_features, layer.in_features // 2)
        assert scale.shape == (layer.out_features, layer.in_features // 16) and scale_2.shape == ()
        assert torch.equal(scale_2, used.outer_scale)
        assert torch.equal(tensors[f"{fqn}.input_scale"], R.decode_scale(R.encode_scale(amaxes[fqn])))
        codes = torch.stack([w & 0x0F, w >> 4], dim=-1).reshape(w.shape[0], -1)
        per_block = scale.float() * scale_2
        deq = (e2m1_decode(codes).unflatten(-1, (-1, 16)) * per_block[..., None]).flatten(-2)
        assert torch.equal(deq.bfloat16().view(torch.int16), used.dequantize().view(torch.int16))
        assert torch.equal(unpack_nibbles(w), unpack_nibbles(used.qdata))
    assert torch.equal(tensors["0.weight"], model[0].weight) and "1.sr_seed" not in tensors


def test_without_amaxes_compressed_tensors_activations_are_dynamic(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    model, _ = trained_model()
    config, tensors = read(export(model, str(tmp_path / "dyn")))
    group = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    assert group.input_activations.dynamic is True
    assert not any(k.endswith("input_global_scale") for k in tensors)


def test_bad_input_is_named(tmp_path):
    model, amaxes = trained_model()
    with pytest.raises(ValueError, match="unknown format 'gguf'"):
        export(model, str(tmp_path / "a"), "gguf")
    with pytest.raises(ValueError, match="no NVFP4 layer"):
        export(nn.Sequential(nn.Linear(16, 16)), str(tmp_path / "b"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        export(model, str(tmp_path / "full"))
    with pytest.raises(ValueError, match="modelopt layout needs static input scales"):
        export(model, str(tmp_path / "c"), "modelopt")
    with pytest.raises(ValueError, match="no entry for 1 NVFP4 layers, e.g. '3'"):
        export(model, str(tmp_path / "d"), input_amax={"1": amaxes["1"]})
    with pytest.raises(TypeError, match="nn.Module"):
        export("model", str(tmp_path / "e"))


def test_per_token_recipes_are_refused_unless_converted(tmp_path):
    model, amaxes = trained_model(N.NVFP4Recipe(scaling="per_token"))
    with pytest.raises(ValueError, match="per-token activation scales.*allow_per_token=True"):
        export(model, str(tmp_path / "a"), input_amax=amaxes)
    _, tensors = read(export(model, str(tmp_path / "b"), input_amax=amaxes, allow_per_token=True))
    assert torch.equal(tensors["1.input_global_scale"], R.encode_scale(amaxes["1"]).reshape(1))


def _train_exported(tmp_path, monkeypatch, *options):
    """``nvfp4-recipe train --preset tiny ... --export tmp_path/export`` on the CPU in fp32:
    (exit status, {"model": the last trained model export_trained was given})."""
    trained = {}
    real_export = job.export_trained

    def keep(model, *args):
        trained["model"] = model
        return real_export(model, *args)

    monkeypatch.setattr(job, "export_trained", keep)
    status = cli.main(["train", "--preset", "tiny", *options, "--device", "cpu", "--precision", "fp32",
                       "--no-progress", "--out", str(tmp_path / "out"),
                       "--export", str(tmp_path / "export")])
    return status, trained


def test_train_export_round_trip_gives_the_trained_logits(tmp_path, monkeypatch):
    status, trained = _train_exported(tmp_path, monkeypatch, "--recipes", "bf16", "nvfp4", "--steps", "3")
    assert status == 0
    assert os.listdir(tmp_path / "export") == ["nvfp4"]  # the baseline has nothing in NVFP4
    loaded = job.load_exported(str(tmp_path / "export" / "nvfp4"), make_recipe("nvfp4", 0, "auto"), "cpu")
    assert not any(isinstance(m, N.NVFP4Linear) for m in loaded.modules())
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), trained["model"](tokens))


def test_train_moe_export_round_trip_loads_the_exported_experts(tmp_path, monkeypatch):
    """train --moe --export, then load_exported: each TinyLM experts module comes back frozen,
    holding the exported weights: w2[e] as the grouped fprop used it, w1[e] and w3[e] quantized
    with their larger amax (served with one global scale; quantized apart in training, so the
    logits are the trained model's up to that requantization, not bit for bit; the exact case is
    tests/test_frozen.py's)."""
    status, trained = _train_exported(tmp_path, monkeypatch, "--moe", "--recipes", "nvfp4", "--steps", "2")
    assert status == 0
    recipe = make_recipe("nvfp4", 0, "auto")
    loaded = job.load_exported(str(tmp_path / "export" / "nvfp4"), recipe, "cpu")
    model = trained["model"]
    spec = recipe.spec(N.GemmRole.W_FPROP)
    for block, frozen in zip(model.blocks, (b.mlp.experts for b in loaded.blocks)):
        assert isinstance(frozen, NVFP4FrozenGroupedExperts) and not list(frozen.parameters())
        experts = block.mlp.experts
        for e in range(frozen.num_experts):
            w1, w3, w2 = (getattr(experts, p)[e].detach() for p in ("w1", "w3", "w2"))
            shared = torch.maximum(w1.abs().amax(), w3.abs().amax())
            for p, w, amax in (("w1", w1, shared), ("w3", w3, shared), ("w2", w2, w2.abs().amax())):
                want = R.dequantize(R.quantize(w, spec, amax_=amax))
                assert torch.equal(frozen.dequantized(p)[e], want)
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        got, want = loaded(tokens), model(tokens)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())  # ~0.004 seen


def test_export_directory_is_checked_before_training(tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    status = cli.main(["train", "--preset", "tiny", "--out", str(tmp_path / "out"),
                       "--export", str(tmp_path / "busy")])
    assert status == cli.EXIT_USAGE
    assert "--export" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Serving reads what training computed: every recipe, both layouts, the real readers
# ---------------------------------------------------------------------------------------------
RECIPES = {
    "2d": N.NVFP4Recipe(),
    "1d": N.NVFP4Recipe(weight_2d=False),
    "4over6-w256": N.NVFP4Recipe(four_over_six="weights"),
    "4over6-act448": N.NVFP4Recipe(four_over_six="activations", four_over_six_e4m3_max=448),
    "4over6-all-mse-1d": N.NVFP4Recipe(four_over_six="all", four_over_six_error="mse", weight_2d=False),
    "per_token": N.NVFP4Recipe(scaling="per_token"),
}


def ct_read(tensors, fqn, config):
    """compressed-tensors' own decompressor on one layer: the bf16 weight."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    state = {k[len(fqn) + 1:]: v for k, v in tensors.items() if k.startswith(fqn + ".")}
    return NVFP4PackedCompressor.decompress(state, scheme)["weight"]


def modelopt_read(tensors, fqn, scale_2=None):
    """ModelOpt's NVFP4QTensor.dequantize formula: code * (weight_scale * weight_scale_2), fp32."""
    w, scale = tensors[f"{fqn}.weight"], tensors[f"{fqn}.weight_scale"]
    scale_2 = tensors[f"{fqn}.weight_scale_2"] if scale_2 is None else scale_2
    codes = torch.stack([w & 0x0F, w >> 4], dim=-1).reshape(w.shape[0], -1)
    return (e2m1_decode(codes).unflatten(-1, (-1, 16)) * (scale.float() * scale_2)[..., None]).flatten(-2)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_exports_the_trained_weights_and_logits(tmp_path, fmt, name):
    recipe = RECIPES[name]
    model, amaxes = trained_model(recipe, torch.bfloat16, seed=len(name))
    path = export(model, str(tmp_path / "e"), fmt, input_amax=amaxes, allow_per_token=True)
    config, tensors = read(path)
    for fqn, layer in layers(model).items():
        used = layer.quantized_weight()
        codes = tensors[f"{fqn}.weight_packed" if fmt == "compressed-tensors" else f"{fqn}.weight"]
        assert torch.equal(codes, used.qdata)
        scale = bits(tensors[f"{fqn}.weight_scale"])
        assert torch.equal(scale if recipe.weight_2d is False else scale[::16], bits(used.scale))
        if fmt == "compressed-tensors":
            g = tensors[f"{fqn}.weight_global_scale"]
            assert torch.equal(torch.ones(1) / g, used.outer_scale.reshape(1))  # 4/6 bound included
            assert torch.equal(ct_read(tensors, fqn, config).view(torch.int16),
                               used.dequantize(torch.bfloat16).view(torch.int16))
        else:
            assert torch.equal(tensors[f"{fqn}.weight_scale_2"], used.outer_scale)
            assert torch.equal(modelopt_read(tensors, fqn).bfloat16().view(torch.int16),
                               used.dequantize(torch.bfloat16).view(torch.int16))
    frozen = N.load_frozen(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(),
                                         nn.Linear(128, 48)).to(torch.bfloat16), path, recipe)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(frozen(x), model(x))


def test_four_over_six_global_scale_uses_the_recipes_bound(tmp_path):
    """The 4/6 bound 256 gives S_enc = 1536 / amax (not 2688 / amax): the served weight is not
    scaled by 256 / 448."""
    model, amaxes = trained_model(N.NVFP4Recipe(four_over_six="weights"))
    _, tensors = read(export(model, str(tmp_path / "e"), input_amax=amaxes))
    w = model[1].weight.detach()
    assert torch.equal(tensors["1.weight_global_scale"],
                       R.encode_scale(w.abs().amax(), 256).reshape(1))


def tiny_llama(seed=0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         **kw)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def trained_llama(recipe, seed=0, **kw):
    return stepped_and_recorded(N.quantize_(tiny_llama(seed, **kw), recipe), (2, 16))


def stepped_and_recorded(model, shape):
    """An NVFP4 language model after one SGD step on random tokens of ``shape``, and the amaxes
    one more batch gives."""
    tokens = torch.randint(0, 128, shape)
    model(tokens).logits.float().square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad / p.grad.abs().max()
    with record_amaxes(model) as amaxes:
        model(torch.randint(0, 128, shape))
    return model, amaxes


GROUPS = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_a_vllm_style_fused_read_gives_the_trained_weights(tmp_path, fmt):
    """vLLM dequantizes a fused QKV / gate-up GEMM with one weight global scale, the max over its
    shards (CompressedTensorsW4A4Fp4, ModelOpt NVFP4): each shard is still the trained weight."""
    model, amaxes = trained_llama(N.NVFP4Recipe(keep_bf16=("lm_head",)))
    config, tensors = read(export(model, str(tmp_path / "e"), fmt, input_amax=amaxes))
    for group in GROUPS:
        fqns = [f"model.layers.0.{name}" for name in group]
        if fmt == "compressed-tensors":
            g = torch.stack([tensors[f"{f}.weight_global_scale"] for f in fqns]).max()
            inputs = {tensors[f"{f}.input_global_scale"].item() for f in fqns}
        else:
            g = torch.stack([tensors[f"{f}.weight_scale_2"] for f in fqns]).max()
            inputs = {tensors[f"{f}.input_scale"].item() for f in fqns}
        assert len(inputs) == 1  # one input scale per fused GEMM
        for f in fqns:
            used = model.get_submodule(f).quantized_weight()
            codes = tensors[f"{f}.weight_packed" if fmt == "compressed-tensors" else f"{f}.weight"]
            if fmt == "compressed-tensors":
                codes4 = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(codes.shape[0], -1)
                scale = tensors[f"{f}.weight_scale"].float() / g  # vLLM: block scale / global scale
                got = (e2m1_decode(codes4).unflatten(-1, (-1, 16)) * scale[..., None]).flatten(-2)
            else:
                got = modelopt_read(tensors, f, scale_2=g)
            assert torch.equal(got.bfloat16().view(torch.int16), used.dequantize().view(torch.int16))


def test_groups_trained_apart_are_quantized_again_and_the_error_is_logged(tmp_path, caplog):
    model, amaxes = trained_llama(N.NVFP4Recipe(keep_bf16=("lm_head",), shared_weight_amax=False), 3)
    before = {f: m.quantized_weight() for f, m in layers(model).items()}
    with caplog.at_level("WARNING", logger="nvfp4_recipe"):
        _, tensors = read(export(model, str(tmp_path / "e"), input_amax=amaxes))
    for group in GROUPS:
        fqns = [f"model.layers.0.{name}" for name in group]
        scales = {tensors[f"{f}.weight_global_scale"].item() for f in fqns}
        assert len(scales) == 1
        amax = max(model.get_submodule(f).weight.abs().max().item() for f in fqns)
        assert scales == {R.encode_scale(torch.tensor(amax)).item()}
        line = next(r.getMessage() for r in caplog.records if "/".join(fqns) in r.getMessage())
        for f in fqns:
            old = before[f].dequantize(torch.float32).double()
            new = (e2m1_decode(unpack_nibbles(tensors[f"{f}.weight_packed"])).unflatten(-1, (-1, 16))
                   * (tensors[f"{f}.weight_scale"].float() / tensors[f"{f}.weight_global_scale"])[..., None]
                   ).flatten(-2).double()
            error = ((new - old).norm() / old.norm()).item()  # within the reader's division
            errors = line.split("relative weight error: ")[1].split(")")[0]
            logged = float(errors.split(f"{f.rpartition('.')[2]} ")[1].split(",")[0])
            assert logged == pytest.approx(error, rel=0.01, abs=1e-6) and error < 0.2
            largest = model.get_submodule(f).weight.abs().max().item() == amax
            assert (logged == 0) == largest  # the member of the largest amax keeps its codes
            assert torch.equal(tensors[f"{f}.weight_packed"], before[f].qdata) == largest
    o = "model.layers.0.self_attn.o_proj"  # no group: as trained
    assert torch.equal(tensors[f"{o}.weight_packed"], before[o].qdata)


def test_a_frozen_base_under_lora_exports_its_stored_weights(tmp_path, caplog):
    peft = pytest.importorskip("peft")
    model, amaxes = trained_llama(N.NVFP4Recipe(keep_bf16=("lm_head",)), 4)
    first = export(model, str(tmp_path / "first"), input_amax=amaxes)
    base = N.load_frozen(tiny_llama(5), first)
    lora = peft.get_peft_model(base, N.lora_config(r=4, target_modules=["q_proj", "v_proj"]))
    with record_amaxes(lora) as again:
        lora(torch.randint(0, 128, (2, 16)))
    assert set(again) == set(amaxes)  # recorded under the served names
    with caplog.at_level("WARNING", logger="nvfp4_recipe"):
        config, tensors = read(export(lora, str(tmp_path / "second"), input_amax=amaxes))
    _, original = read(first)
    assert set(tensors) == set(original) and not any("lora" in k for k in tensors)
    for k, v in original.items():
        assert torch.equal(bits(tensors[k]), bits(v)), k
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert any("LoRA adapters" in r.getMessage() for r in caplog.records)


def test_a_frozen_only_model_exports_in_both_layouts(tmp_path):
    model, amaxes = trained_model(seed=6)
    first = export(model, str(tmp_path / "a"), "modelopt", input_amax=amaxes)
    frozen = N.load_frozen(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(),
                                         nn.Linear(128, 48)), first)
    _, mo = read(first)
    _, again = read(export(frozen, str(tmp_path / "b"), "modelopt", input_amax=amaxes))
    assert all(torch.equal(bits(again[k]), bits(v)) for k, v in mo.items())
    _, ct = read(export(frozen, str(tmp_path / "c"), input_amax=amaxes))
    for fqn in ("1", "3"):  # compressed-tensors' encode scale: its reciprocal is the stored one
        assert torch.equal(torch.ones(1) / ct[f"{fqn}.weight_global_scale"], mo[f"{fqn}.weight_scale_2"].reshape(1))


def test_a_meta_model_is_refused_and_nothing_is_written(tmp_path):
    with torch.device("meta"):
        model = N.quantize_(nn.Sequential(nn.Linear(64, 64)), N.NVFP4Recipe())
    with pytest.raises(ValueError, match="0.weight is on the meta device"):
        export(model, str(tmp_path / "e"))
    assert os.listdir(tmp_path) == []
    model = N.quantize_(nn.Sequential(nn.Linear(64, 64)), N.NVFP4Recipe())
    with torch.no_grad():
        model[0].bias[3] = float("nan")
    with pytest.raises(ValueError, match="0.bias holds non-finite values"):
        export(model, str(tmp_path / "e"))
    assert os.listdir(tmp_path) == []


def test_a_write_that_fails_half_way_leaves_the_target_as_it_was(tmp_path, monkeypatch):
    import safetensors.torch as st
    model, amaxes = trained_model(seed=7)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_file", full_disk)
    (tmp_path / "empty").mkdir()
    for target in ("empty", "new"):
        with pytest.raises(OSError, match="No space"):
            export(model, str(tmp_path / target), input_amax=amaxes)
    assert sorted(os.listdir(tmp_path)) == ["empty"] and os.listdir(tmp_path / "empty") == []
    monkeypatch.undo()
    path = export(model, str(tmp_path / "empty"), input_amax=amaxes)  # a retry is not refused
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]


def test_config_is_the_one_save_pretrained_writes_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM
    model, amaxes = trained_llama(N.NVFP4Recipe(keep_bf16=("lm_head",)), 8)
    path = export(model, str(tmp_path / "e"), input_amax=amaxes)
    config, _ = read(path)
    model.save_pretrained(str(tmp_path / "hf"))
    saved, _ = read(str(tmp_path / "hf"))
    assert (config["architectures"], config["dtype"]) == (saved["architectures"], saved["dtype"]) == (
        ["LlamaForCausalLM"], "bfloat16")
    served = AutoModelForCausalLM.from_pretrained(path)
    assert served.dtype == torch.bfloat16
    served(torch.randint(0, 128, (1, 8)))  # runs: the dtypes agree


def test_a_tied_nvfp4_lm_head_is_exported_in_high_precision(tmp_path, caplog):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    model, amaxes = trained_llama(N.NVFP4Recipe(), 9, tie_word_embeddings=True)
    assert isinstance(model.lm_head, N.NVFP4Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    with caplog.at_level("WARNING", logger="nvfp4_recipe"):
        path = export(model, str(tmp_path / "e"), input_amax=amaxes)
    config, tensors = read(path)
    assert config["quantization_config"]["ignore"] == ["lm_head"] and "lm_head.weight_packed" not in tensors
    assert any("lm_head is tied" in r.getMessage() for r in caplog.records)
    served = AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True))
    assert torch.equal(served.lm_head.weight, model.model.embed_tokens.weight)
    served(torch.randint(0, 128, (1, 8)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0, torch.tensor(float("nan"))])
def test_bad_input_amaxes_are_refused_naming_the_layer(tmp_path, bad):
    model, amaxes = trained_model(seed=10)
    with pytest.raises(ValueError, match=r"input_amax\['3'\].*finite and > 0"):
        export(model, str(tmp_path / "e"), input_amax=dict(amaxes, **{"3": bad}))
    assert not os.path.exists(tmp_path / "e")


def test_input_amaxes_may_be_floats_or_0d_tensors(tmp_path):
    model, amaxes = trained_model(seed=11)
    floats = {k: v.item() for k, v in amaxes.items()}
    _, a = read(export(model, str(tmp_path / "a"), input_amax=floats))
    _, b = read(export(model, str(tmp_path / "b"), input_amax=amaxes))
    assert all(torch.equal(bits(a[k]), bits(b[k])) for k in a)
    with pytest.raises(ValueError, match=r"input_amax\['1'\] must be a float"):
        export(model, str(tmp_path / "c"), input_amax=dict(amaxes, **{"1": "3.0"}))


def test_a_dynamic_export_says_what_servers_need(tmp_path, caplog):
    model, _ = trained_model(seed=12)
    with caplog.at_level("WARNING", logger="nvfp4_recipe"):
        export(model, str(tmp_path / "e"))
    assert any("input_global_scale" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("args,message", [
    (["--recipes", "bf16"], "none of the recipes bf16 trains in NVFP4"),
    (["--recipes", "nvfp4", "nvfp4-tail"], "recipe nvfp4-tail: export: the model has no NVFP4 layer"),
    (["--recipes", "nvfp4-per-token"], "per-token activation scales"),
])
def test_export_arguments_fail_before_training(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setattr(job, "train_run", lambda *a, **k: pytest.fail("trained"))
    status = cli.main(["train", "--preset", "tiny", *args, "--out", str(tmp_path / "out"),
                       "--export", str(tmp_path / "export")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == cli.EXIT_USAGE and len(err) == 1 and message in err[0]


def test_an_unwritable_export_directory_fails_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(job, "train_run", lambda *a, **k: pytest.fail("trained"))
    (tmp_path / "file").write_text("x")
    status = cli.main(["train", "--preset", "tiny", "--out", str(tmp_path / "out"),
                       "--export", str(tmp_path / "file" / "sub")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == cli.EXIT_USAGE and len(err) == 1 and "cannot write there" in err[0]


def test_a_failed_export_keeps_the_run_and_the_later_recipes_run(tmp_path, capsys, monkeypatch):
    real_export = job.export_trained
    calls = []

    def fail_first(model, cfg, batches, device, dtype, path):
        calls.append(os.path.basename(path))
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real_export(model, cfg, batches, device, dtype, path)

    monkeypatch.setattr(job, "export_trained", fail_first)
    status = cli.main(["train", "--preset", "tiny", "--recipes", "nvfp4", "nvfp4-1d-weights",
                       "--steps", "2", "--device", "cpu", "--precision", "fp32", "--no-progress",
                       "--out", str(tmp_path / "out"), "--export", str(tmp_path / "export")])
    assert status == 1 and calls == ["nvfp4", "nvfp4-1d-weights"]
    with open(tmp_path / "out" / "results.json") as f:
        assert [r["recipe"] for r in json.load(f)["runs"]] == ["nvfp4", "nvfp4-1d-weights"]
    assert os.listdir(tmp_path / "export") == ["nvfp4-1d-weights"]
    assert "No space left on device" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# MoE experts: one NVFP4 linear per expert and projection, as serving engines load them
# ---------------------------------------------------------------------------------------------
def fprop_experts(model, fqn):
    """{projection: [the NVFP4Tensor W_g each expert's fprop GEMM used]} of experts module ``fqn``
    (``capture`` of one evaluation forward)."""
    with N.capture(model) as ops, torch.no_grad():
        model(torch.randint(0, 128, (2, 32)))
    return {p: ops[fqn][p]["w"] for p in ops[fqn]}


def served(tensors, name, fmt):
    """(codes, 1x16 scales, decode global scale (), input decode scale ()) of one served linear."""
    if fmt == "compressed-tensors":
        codes, g = tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_global_scale"]
        return (codes, tensors[f"{name}.weight_scale"], (torch.ones(1) / g).reshape(()),
                (torch.ones(1) / tensors[f"{name}.input_global_scale"]).reshape(()))
    return (tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"],
            tensors[f"{name}.weight_scale_2"], tensors[f"{name}.input_scale"])


def within_reader_rounding(got, want):
    """bf16 ``got`` is ``want`` (fp32) rounded to bf16, or one bf16 ulp beside it: the readers
    divide by the global scale (compressed-tensors) or multiply the scales first (ModelOpt) where
    training multiplies by the outer scale last, so an fp32 ulp may move a bf16 rounding."""
    distance = got.bfloat16().view(torch.int16).int() - want.bfloat16().view(torch.int16).int()
    return bool(distance.abs().max() <= 1) and torch.equal(got.bfloat16().sign(), want.bfloat16().sign())


QWEN_EXPERTS = "model.layers.0.mlp.experts"
MOE_RECIPES = ["2d", "1d", "4over6-w256"]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("name", MOE_RECIPES)
def test_moe_experts_are_exported_per_expert_as_fprop_used_them(tmp_path, fmt, name):
    """Qwen3-MoE's batched experts become mlp.experts.{e}.gate_proj / up_proj / down_proj NVFP4
    linears: the codes and 1x16 scales of W_g as the grouped fprop GEMM used them (gate_up_proj[g]'s
    rows split, so gate and up share W_g's global scale), the 4/6 bound in the global scale, each
    expert's recorded input amax; the real readers give the fprop weights within their own
    rounding."""
    recipe = dataclasses.replace(RECIPES[name], keep_bf16=("lm_head",))
    model, amaxes = stepped_and_recorded(N.quantize_(tiny_hf_moe("qwen3_moe", len(name)), recipe), (2, 32))
    used = fprop_experts(model, QWEN_EXPERTS)
    config, tensors = read(export(model, str(tmp_path / "e"), fmt, input_amax=amaxes))
    assert not any(k.startswith(f"{QWEN_EXPERTS}.gate_up_proj") or k.startswith(f"{QWEN_EXPERTS}.down_proj")
                   for k in tensors)
    for e in range(4):
        w13, w2 = used["gate_up_proj"][e], used["down_proj"][e]
        for proj, w, rows in (("gate_proj", w13, slice(0, 32)), ("up_proj", w13, slice(32, 64)),
                              ("down_proj", w2, slice(0, 64))):
            fqn = f"{QWEN_EXPERTS}.{e}.{proj}"
            codes, scale, outer, input_scale = served(tensors, fqn, fmt)
            n, k = rows.stop - rows.start, w.shape[1]
            assert (codes.dtype, scale.dtype, outer.dtype) == (torch.uint8, torch.float8_e4m3fn, torch.float32)
            assert codes.shape == (n, k // 2) and scale.shape == (n, k // 16)
            assert torch.equal(codes, w.qdata[rows])
            tile_rows = slice(rows.start // 16, rows.stop // 16)
            assert torch.equal(bits(scale) if name == "1d" else bits(scale)[::16],
                               bits(w.scale)[rows if name == "1d" else tile_rows])
            assert torch.equal(outer, w.outer_scale)  # 1 / S_enc
            hp = getattr(model.get_submodule(QWEN_EXPERTS), "down_proj" if proj == "down_proj" else "gate_up_proj")
            bound = 256 if name == "4over6-w256" else 448  # W_g's amax, gate and up sharing it
            assert torch.equal(outer, R.decode_scale(R.encode_scale(hp[e].detach().abs().amax(), bound)))
            assert torch.equal(input_scale, R.decode_scale(R.encode_scale(amaxes[fqn])))
            got = ct_read(tensors, fqn, config) if fmt == "compressed-tensors" else modelopt_read(tensors, fqn)
            assert within_reader_rounding(got, w.dequantize(torch.float32)[rows])
        weight = model.get_submodule(QWEN_EXPERTS).gate_up_proj[e].detach()
        spec = RECIPES[name].spec(N.GemmRole.W_FPROP)
        assert torch.equal(R.quantize(weight, spec).qdata, w13.qdata)  # the reference's bits


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_a_vllm_style_fused_moe_read_gives_the_trained_experts(tmp_path, fmt):
    """vLLM's FusedMoE stacks each expert's gate and up into w13 (E, 2I, H/2) with w13's global
    scale (E, 2) read as [:, 0] (TensorRT-LLM asserts w1's == w3's) and one input scale per expert
    (FlashInfer kernels: the max over experts); w2 alike. Dequantized so, the experts are the
    weights the grouped fprop used, and gate and up have one input scale."""
    model, amaxes = stepped_and_recorded(
        N.quantize_(tiny_hf_moe("qwen3_moe", 7), N.NVFP4Recipe(keep_bf16=("lm_head",))), (2, 32))
    used = fprop_experts(model, QWEN_EXPERTS)
    _, tensors = read(export(model, str(tmp_path / "e"), fmt, input_amax=amaxes))
    for shards, trained in ((("gate_proj", "up_proj"), used["gate_up_proj"]), (("down_proj",), used["down_proj"])):
        parts = [[served(tensors, f"{QWEN_EXPERTS}.{e}.{p}", fmt) for p in shards] for e in range(4)]
        codes = torch.stack([torch.cat([s[0] for s in expert]) for expert in parts])
        scales = torch.stack([torch.cat([s[1] for s in expert]) for expert in parts])
        outer = torch.stack([torch.stack([s[2] for s in expert]) for expert in parts])  # (E, shards)
        inputs = torch.stack([torch.stack([s[3] for s in expert]) for expert in parts])
        assert torch.equal(outer[:, :1].expand_as(outer), outer)
        assert torch.equal(inputs[:, :1].expand_as(inputs), inputs)
        values = e2m1_decode(unpack_nibbles(codes)).unflatten(-1, (-1, 16))
        got = (values * (scales.float() * outer[:, 0, None, None])[..., None]).flatten(-2)
        want = torch.stack([w.dequantize(torch.float32) for w in trained])
        assert torch.equal(got.bfloat16().view(torch.int16), want.bfloat16().view(torch.int16))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_exports_load_with_hugging_faces_names(tmp_path, arch):
    """The experts and the router are named as save_pretrained writes them (Mixtral:
    block_sparse_moe.experts.{e}.w1 / w3 / w2 and block_sparse_moe.gate), and transformers loads
    the export: the dense layers as trained, each expert's gate_up_proj and down_proj from its
    per-expert linears in order. transformers 5.24 drops an NVFP4 expert's weight_global_scale
    when it dequantizes (huggingface/transformers#48371): its experts come back as codes x block
    scales, the global scale left out. load_frozen reads the per-expert linears back into frozen
    experts (Mixtral's block_sparse_moe names into its mlp): the trained logits bit for bit."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    model, amaxes = stepped_and_recorded(
        N.quantize_(tiny_hf_moe(arch, 8), N.NVFP4Recipe(keep_bf16=("lm_head",))), (2, 32))
    used = fprop_experts(model, QWEN_EXPERTS)
    path = export(model, str(tmp_path / "e"), input_amax=amaxes)
    _, tensors = read(path)
    block, names = (("mlp", ("gate_proj", "up_proj", "down_proj")) if arch == "qwen3_moe"
                    else ("block_sparse_moe", ("w1", "w3", "w2")))
    prefix = f"model.layers.0.{block}"
    assert {k.rsplit(".", 1)[0] for k in tensors if ".experts." in k} == {
        f"{prefix}.experts.{e}.{n}" for e in range(4) for n in names}
    assert torch.equal(tensors[f"{prefix}.gate.weight"], model.model.layers[0].mlp.gate.weight)
    loaded = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=CompressedTensorsConfig(dequantize=True))
    experts = loaded.model.layers[0].mlp.experts
    for param, trained in (("gate_up_proj", used["gate_up_proj"]), ("down_proj", used["down_proj"])):
        for e, w in enumerate(trained):
            got = getattr(experts, param)[e].detach().view(torch.int16)
            served_w = w.dequantize(torch.bfloat16).view(torch.int16)
            inner = R.dequantize_inner(w).bfloat16().view(torch.int16)  # transformers#48371
            assert torch.equal(got, served_w) or torch.equal(got, inner)
    q = model.model.layers[0].self_attn.q_proj.quantized_weight().dequantize()
    assert torch.equal(loaded.model.layers[0].self_attn.q_proj.weight.view(torch.int16), q.view(torch.int16))
    assert torch.equal(loaded.model.layers[0].mlp.gate.weight, model.model.layers[0].mlp.gate.weight)
    frozen = N.load_frozen(tiny_hf_moe(arch, 9), path)
    tokens = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        assert torch.equal(frozen(tokens).logits, model(tokens).logits)


def tiny_lm_moe(seed=0):
    from nvfp4_recipe.train.model import ModelConfig, TinyLM
    torch.manual_seed(seed)
    return TinyLM(ModelConfig(d_model=64, n_layers=1, n_heads=4, d_ff=64, seq_len=32, n_experts=4, top_k=2))


def test_torchtitan_experts_share_one_global_scale_per_expert_as_served(tmp_path, caplog):
    """torchtitan-layout experts (the main job's --moe TinyLM) are written as
    blocks.0.mlp.experts.{e}.w1 / w3 / w2. Training quantizes w1[g] and w3[g] apart; served as one
    w13 they get one global scale, so each is the reference quantization with the larger amax of
    the pair, the WARNING giving the error (the larger-amax member keeps its trained codes); w2[g]
    is the trained fprop weight; the compressed-tensors decompressor reads them."""
    model = N.quantize_(tiny_lm_moe(10), N.NVFP4Recipe(keep_bf16=("lm_head",)))
    tokens = torch.randint(0, 256, (2, 32))
    with record_amaxes(model) as amaxes, torch.no_grad():
        model(tokens)
    with N.capture(model) as ops, torch.no_grad():
        model(tokens)
    with caplog.at_level("WARNING", logger="nvfp4_recipe"):
        config, tensors = read(export(model, str(tmp_path / "e"), input_amax=amaxes))
    experts = model.blocks[0].mlp.experts
    spec = N.NVFP4Recipe().spec(N.GemmRole.W_FPROP)
    line = next(r.getMessage() for r in caplog.records if "blocks.0.mlp.experts:" in r.getMessage())
    requantized = 0
    for e in range(4):
        w1, w3 = experts.w1[e].detach(), experts.w3[e].detach()
        amax = torch.maximum(w1.abs().amax(), w3.abs().amax()).float()
        requantized += not torch.equal(w1.abs().amax(), w3.abs().amax())
        for name, w, trained in (("w1", w1, ops["blocks.0.mlp.experts"]["w1"]["w"][e]),
                                 ("w3", w3, ops["blocks.0.mlp.experts"]["w3"]["w"][e])):
            fqn = f"blocks.0.mlp.experts.{e}.{name}"
            want = R.quantize(w, spec, amax_=amax)
            assert torch.equal(tensors[f"{fqn}.weight_packed"], want.qdata)
            assert torch.equal(bits(tensors[f"{fqn}.weight_scale"])[::16], bits(want.scale))
            assert torch.equal(tensors[f"{fqn}.weight_global_scale"], R.encode_scale(amax).reshape(1))
            if torch.equal(w.abs().amax().float(), amax):  # the larger amax: as trained
                assert torch.equal(want.qdata, trained.qdata) and torch.equal(want.scale, trained.scale)
            assert within_reader_rounding(ct_read(tensors, fqn, config), R.dequantize(want))
        fqn = f"blocks.0.mlp.experts.{e}.w2"
        trained = ops["blocks.0.mlp.experts"]["w2"]["w"][e]
        assert torch.equal(tensors[f"{fqn}.weight_packed"], trained.qdata)
        assert torch.equal(torch.ones(1) / tensors[f"{fqn}.weight_global_scale"], trained.outer_scale.reshape(1))
    assert requantized and f"{requantized} experts had different weight global scales" in line
    assert "w1" in line and "w3" in line


def test_expert_input_scales_are_the_ones_fprop_used_and_an_unrouted_expert_gets_the_largest(tmp_path, caplog):
    """Each expert's input scale (of w1/w3: its tokens; of w2: its SwiGLU output) is the outer
    scale the grouped GEMM quantized that expert's tokens with; an expert no token reached gets
    its module's largest, with a warning. A model whose only NVFP4 modules are experts exports."""
    from nvfp4_recipe.train.model import GroupedExperts
    torch.manual_seed(11)
    hp = GroupedExperts(32, 48, 4)
    for w in hp.parameters():
        nn.init.normal_(w, std=0.1)
    model = N.quantize_(nn.ModuleDict({"experts": hp}), N.NVFP4Recipe())
    x, counts = torch.randn(64, 32), torch.tensor([16, 0, 40, 8])
    with record_amaxes(model) as amaxes, torch.no_grad():
        model["experts"](x, counts)
    with N.capture(model) as ops, torch.no_grad():
        model["experts"](x, counts)
    assert not any(k.startswith("experts.1.") for k in amaxes)
    for e in (0, 2, 3):
        for proj, operand in (("w1", "w1"), ("w3", "w3"), ("w2", "w2")):
            used = ops["experts"][operand]["x"][e].outer_scale
            assert torch.equal(R.decode_scale(R.encode_scale(amaxes[f"experts.{e}.{proj}"])), used)
    assert torch.equal(amaxes["experts.2.w1"], x[16:56].abs().amax())
    with caplog.at_level("WARNING", logger="nvfp4_recipe"):
        _, tensors = read(export(model, str(tmp_path / "e"), input_amax=amaxes))
    for proj in ("w1", "w3", "w2"):
        largest = torch.stack([amaxes[f"experts.{e}.{proj}"] for e in (0, 2, 3)]).amax()
        assert torch.equal(tensors[f"experts.1.{proj}.input_global_scale"], R.encode_scale(largest).reshape(1))
    assert any("1 experts of experts had no token routed" in r.getMessage() for r in caplog.records)
    assert not any(k.startswith("experts.w") for k in tensors)


def test_expert_recipes_are_checked_like_the_linears(tmp_path):
    model = N.quantize_(nn.ModuleDict({"experts": tiny_lm_moe(12).blocks[0].mlp.experts}),
                        N.NVFP4Recipe(scaling="per_token"))
    with pytest.raises(ValueError, match="experts was trained with per-token activation scales"):
        export(model, str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"input_amax has no entry for 12 NVFP4 layers, e.g. 'experts.0.w1'"):
        export(model, str(tmp_path / "b"), allow_per_token=True, input_amax={})


def test_experts_kept_in_high_precision_are_written_per_expert_and_ignored(tmp_path):
    """Experts left in high precision (keep_bf16) are written as save_pretrained writes them, one
    bf16 linear per expert and projection, and named in the ignore list: vLLM's compressed-tensors
    MoE method looks up ``{experts}.0.gate_proj`` / ``up_proj`` / ``down_proj`` there, else it
    reads a "Linear"-targeted expert as NVFP4. (transformers 5.24 cannot load such a checkpoint:
    its compressed-tensors loader collects only packed experts.)"""
    model, amaxes = stepped_and_recorded(
        N.quantize_(tiny_hf_moe("qwen3_moe", 13), N.NVFP4Recipe(keep_bf16=("lm_head", "*.experts"))), (2, 16))
    experts = model.get_submodule(QWEN_EXPERTS)
    assert not isinstance(experts, N.NVFP4HFExperts)
    path = export(model, str(tmp_path / "e"), input_amax=amaxes)
    config, tensors = read(path)
    names = [f"{QWEN_EXPERTS}.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj") for e in range(4)]
    assert sorted(config["quantization_config"]["ignore"]) == sorted(["lm_head", *names])
    for e in range(4):
        assert torch.equal(tensors[f"{QWEN_EXPERTS}.{e}.gate_proj.weight"], experts.gate_up_proj[e, :32])
        assert torch.equal(tensors[f"{QWEN_EXPERTS}.{e}.up_proj.weight"], experts.gate_up_proj[e, 32:])
        assert torch.equal(tensors[f"{QWEN_EXPERTS}.{e}.down_proj.weight"], experts.down_proj[e])
    assert not any(".experts." in k and not k.endswith(".weight") for k in tensors)


def test_experts_transformers_saves_stacked_are_refused_in_nvfp4_and_kept_so_in_high_precision(tmp_path):
    """GraniteMoE's checkpoints hold each layer's experts stacked (``input_linear``,
    ``output_linear``), which no per-expert NVFP4 layout fits: NVFP4 experts there are refused by
    name before anything is written; experts kept in high precision are written stacked, as
    save_pretrained writes them."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM
    config = GraniteMoeConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(14)
    model = N.quantize_(GraniteMoeForCausalLM(config).to(torch.bfloat16), N.NVFP4Recipe(keep_bf16=("lm_head",)))
    with pytest.raises(ValueError, match=r"saves model\.layers\.0\.block_sparse_moe\.experts\.gate_up_proj as "
                                         r"\['model\.layers\.0\.block_sparse_moe\.input_linear\.weight'\]"):
        export(model, str(tmp_path / "a"))
    assert not os.path.exists(tmp_path / "a")
    kept = N.quantize_(GraniteMoeForCausalLM(config).to(torch.bfloat16),
                       N.NVFP4Recipe(keep_bf16=("lm_head", "*.experts")))
    config, tensors = read(export(kept, str(tmp_path / "b")))
    experts = kept.model.layers[0].block_sparse_moe.experts
    assert torch.equal(tensors["model.layers.0.block_sparse_moe.input_linear.weight"], experts.gate_up_proj)
    assert config["quantization_config"]["ignore"] == ["lm_head"]
