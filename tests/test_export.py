"""serving.export: the NVFP4 weights training used, read back by the real readers (compressed-tensors,
Hugging Face from_pretrained) and checked against ModelOpt's documented layout; the main job's
--export round trip."""

import json
import os

import pytest
import torch
from torch import nn

import nvfp4_recipe as N
from nvfp4_recipe import cli
from nvfp4_recipe import reference as R
from nvfp4_recipe.formats import e2m1_decode, unpack_nibbles
from nvfp4_recipe.serving import export, record_amaxes
from nvfp4_recipe.train import job
from nvfp4_recipe.train.recipes import make_recipe

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


def test_train_export_round_trip_gives_the_trained_logits(tmp_path, monkeypatch):
    trained = {}
    real_export = job.export_trained

    def keep(model, *args):
        trained["model"] = model
        return real_export(model, *args)

    monkeypatch.setattr(job, "export_trained", keep)
    status = cli.main(["train", "--preset", "tiny", "--recipes", "bf16", "nvfp4", "--steps", "3",
                       "--device", "cpu", "--precision", "fp32", "--no-progress",
                       "--out", str(tmp_path / "out"),
                       "--export", str(tmp_path / "export")])
    assert status == 0
    assert os.listdir(tmp_path / "export") == ["nvfp4"]  # the baseline has nothing in NVFP4
    loaded = job.load_exported(str(tmp_path / "export" / "nvfp4"), make_recipe("nvfp4", 0, "auto"), "cpu")
    assert not any(isinstance(m, N.NVFP4Linear) for m in loaded.modules())
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), trained["model"](tokens))


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
    model = N.quantize_(tiny_llama(seed, **kw), recipe)
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens).logits.float().square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad / p.grad.abs().max()
    with record_amaxes(model) as amaxes:
        model(torch.randint(0, 128, (2, 16)))
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

