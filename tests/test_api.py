"""quantize_: the layer filter, logging of skipped layers, torchao registration, summary/tensor_stats."""

import copy
import logging
import math
import zlib

import pytest
import torch
import torchao
from torch import nn

import nvfp4_recipe as nr
from nvfp4_recipe import reference as R
from nvfp4_recipe.api import skip_reasons
from nvfp4_recipe.layer import NVFP4Module


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.blocks = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 40), nn.Linear(40, 64))
        self.lm_head = nn.Linear(64, 32)

    def forward(self, x):
        return self.lm_head(self.blocks(self.embed(x)))


def kinds(model):
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_default_filter_and_skip_log(caplog):
    model = Net()
    weight = model.blocks[0].weight
    with caplog.at_level(logging.INFO, logger="nvfp4_recipe"):
        nr.quantize_(model, nr.NVFP4Recipe(keep_bf16=("lm_*",)))
    assert kinds(model) == {"embed": "NVFP4Linear", "blocks.0": "NVFP4Linear", "blocks.2": "Linear",
                            "blocks.3": "Linear", "lm_head": "Linear"}
    assert model.blocks[0].weight is weight  # optimizers keep working
    log = caplog.text
    assert "blocks.2" in log and "out_features=40" in log and "lm_head" in log and "keep_bf16" in log
    assert "recipe=nvfp4(rht, sr, 2d-weights, per_tensor)" in str(model)


def test_keep_first_last():
    model = nr.quantize_(Net(), nr.NVFP4Recipe(keep_first_last=1))
    assert kinds(model) == {"embed": "Linear", "blocks.0": "NVFP4Linear", "blocks.2": "Linear",
                            "blocks.3": "Linear", "lm_head": "Linear"}


def test_torchao_quantize_takes_a_recipe_that_needs_no_layer_names():
    """torchao's quantize_ passes its handler a module and the recipe only: a recipe without SR and
    without a layer filter gives the same model as nvfp4_recipe.quantize_."""
    torch.manual_seed(0)
    model = Net()
    ours = nr.quantize_(copy.deepcopy(model), nr.NVFP4Recipe(stochastic_rounding=False))
    torchao.quantization.quantize_(model, nr.NVFP4Recipe(stochastic_rounding=False))
    assert kinds(model) == kinds(ours)
    x = torch.randn(16, 32)
    assert torch.equal(model(x), ours(x))


@pytest.mark.parametrize("field, value", [("keep_bf16", ("lm_head",)), ("keep_first_last", 1),
                                          ("stochastic_rounding", True)])
def test_torchao_quantize_refuses_fields_that_need_layer_names(field, value):
    """keep_bf16 and keep_first_last select layers by name and position, and SR streams are
    derived from the layer names: torchao's handler cannot know them, so it raises (pointing to
    nvfp4_recipe.quantize_) instead of ignoring the field; nothing is swapped."""
    model = Net()
    fields = {"stochastic_rounding": False, field: value}
    with pytest.raises(ValueError, match=f"NVFP4Recipe.{field}.*nvfp4_recipe.quantize_"):
        torchao.quantization.quantize_(model, nr.NVFP4Recipe(**fields))
    assert "NVFP4Linear" not in kinds(model).values()
    nr.quantize_(model, nr.NVFP4Recipe(**fields))  # our entry point applies the same recipe
    assert "NVFP4Linear" in kinds(model).values()


def test_layer_seeds_are_derived_from_the_layer_names():
    recipe = nr.NVFP4Recipe(seed=11)
    model = nr.quantize_(Net(), recipe)
    seeds = {fqn: int(m.sr_seed) for fqn, m in model.named_modules() if isinstance(m, nr.NVFP4Linear)}
    assert seeds == {fqn: (11 + zlib.crc32(fqn.encode())) & 0xFFFFFFFF
                     for fqn in ("embed", "blocks.0", "lm_head")}
    assert len(set(seeds.values())) == 3


def test_a_top_level_linear_is_returned_swapped():
    layer = nn.Linear(32, 32)
    swapped = nr.quantize_(layer)
    assert type(swapped) is nr.NVFP4Linear and swapped.weight is layer.weight
    assert type(nr.dequantize_(swapped)) is nn.Linear
    kept = nr.quantize_(layer, nr.NVFP4Recipe(keep_first_last=1))
    assert kept is layer


def test_quantize_twice():
    """The same recipe again changes nothing (SR state included); another recipe is an error
    that says how to re-configure, and leaves the model as it was."""
    model = nr.quantize_(Net(), nr.NVFP4Recipe(seed=1))
    model(torch.randn(16, 32, requires_grad=True)).sum().backward()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nr.NVFP4Linear)}
    state = copy.deepcopy(model.state_dict())
    assert nr.quantize_(model, nr.NVFP4Recipe(seed=1)) is model
    assert {n: m for n, m in model.named_modules() if isinstance(m, nr.NVFP4Linear)} == layers
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    with pytest.raises(ValueError, match="another recipe.*dequantize_"):
        nr.quantize_(model, nr.NVFP4Recipe(seed=2))
    with pytest.raises(ValueError, match="another recipe.*dequantize_"):
        torchao.quantization.quantize_(model, nr.NVFP4Recipe(seed=2, stochastic_rounding=False))
    assert int(model.embed.sr_seed) == int(state["embed.sr_seed"]) and model.embed.recipe.seed == 1
    nr.quantize_(nr.dequantize_(model), nr.NVFP4Recipe(seed=2))  # the documented way
    assert model.embed.recipe.seed == 2 and int(model.embed.sr_step) == 0


def test_shared_modules_and_attention_out_proj():
    shared = nn.Linear(32, 32)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared), "attn": nn.MultiheadAttention(32, 2)})
    nr.quantize_(model)
    assert model["a"] is model["b"][0] and type(model["a"]) is nr.NVFP4Linear
    assert type(model["attn"].out_proj) is not nr.NVFP4Linear  # MHA never calls its forward
    assert "MultiheadAttention" in skip_reasons(model, nr.NVFP4Recipe())["attn.out_proj"]


def test_backend_is_checked_at_quantize_time(without_triton_interpreter):
    for backend in ("native", "triton"):
        model = Net()
        with pytest.raises(ValueError, match=f"backend '{backend}' cannot run here"):
            nr.quantize_(model, nr.NVFP4Recipe(backend=backend))
        assert "NVFP4Linear" not in kinds(model).values()


def test_summary_and_tensor_stats():
    recipe = nr.NVFP4Recipe(keep_bf16=("lm_head",))
    model = nr.quantize_(Net(), recipe)
    text = nr.summary(model, recipe)
    assert "2 of 5 linear layers in NVFP4" in text and "keep_bf16" in text and "out_features=40" in text
    x = torch.randn(64, 64)
    stats = nr.tensor_stats(x, recipe, "x_fprop")
    assert 10 < stats["sqnr_db"] < 30  # about 4 bits of signal for Gaussian data
    assert 0 < stats["flushed_to_zero"] < 0.2 and stats["saturated"] == 0
    assert stats["zero_scale_blocks"] == 0
    assert sum(stats["scale_histogram"].values()) == 64 * 4
    assert stats["amax"] == x.abs().amax().item()
    rht = nr.tensor_stats(x, recipe, "x_wgrad")
    assert rht["amax"] != stats["amax"]  # measured after the RHT


def test_tensor_stats_at_extreme_scales():
    """SQNR is summed in float64: the same finite value at 1e-23 and 1e19 as at 1 (fp32 sums
    underflow to 0 or overflow to inf there); one 1e30 outlier shows as the flushed rest."""
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    base = nr.tensor_stats(x)["sqnr_db"]
    for scale in (1e-23, 1e19):
        stats = nr.tensor_stats(x * scale)
        assert math.isclose(stats["sqnr_db"], base, rel_tol=1e-3), (scale, stats)
    outlier = x.clone()
    outlier[5, 7] = 1e30
    stats = nr.tensor_stats(outlier)
    assert math.isfinite(stats["sqnr_db"]) and stats["sqnr_db"] > 100  # the outlier dominates
    assert stats["flushed_to_zero"] > 0.99 and stats["saturated"] == 0


def test_tensor_stats_reports_saturation_under_an_underestimated_amax():
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    stats = nr.tensor_stats(x, amax=x.abs().amax() / 4)  # block scales clamp at 448
    deq = R.dequantize(R.quantize(x, amax_=x.abs().amax() / 4))
    clipped = (x.abs() > 1.125 * deq.abs()) & (deq.abs() == deq.abs().amax())
    assert stats["saturated"] == clipped.double().mean().item() > 0.05
    assert stats["sqnr_db"] < nr.tensor_stats(x)["sqnr_db"]


def _quantize_records(caplog, model, recipe=None, **kw):
    """quantize_ with the log captured: (the returned model, the WARNING records of the call)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nvfp4_recipe"):
        out = nr.quantize_(model, recipe, **kw)
    return out, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_quantize_warns_once_with_the_layers_it_kept_and_why(caplog):
    """One WARNING line per call: the counts and every module left in high precision with its
    reason (keep_bf16, a width not a multiple of 16, MultiheadAttention's out_proj and its
    in_proj_weight); the reasons stay on the model, and summary shows them without the recipe."""
    model = nn.ModuleDict({"net": Net(), "attn": nn.MultiheadAttention(32, 2)})
    model, warnings = _quantize_records(caplog, model, nr.NVFP4Recipe(keep_bf16=("net.lm_*",)))
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert line.startswith("quantize_: 2 of 6 linear layers in NVFP4; kept in high precision: ")
    for part in ("net.lm_head (matches keep_bf16 pattern 'net.lm_*')",
                 "net.blocks.2 (out_features=40 is not a positive multiple of 16)",
                 "attn.out_proj (out_proj of an nn.MultiheadAttention",
                 "attn (MultiheadAttention holding in_proj_weight"):
        assert part in line, part
    assert set(model.nvfp4_kept) == {"net.lm_head", "net.blocks.2", "net.blocks.3",
                                     "attn.out_proj", "attn"}
    rows = {line.split()[0]: line for line in nr.summary(model).splitlines()[2:]}
    assert "keep_bf16 pattern 'net.lm_*'" in rows["net.lm_head"]
    assert "in_proj_weight" in rows["attn"]
    assert nr.summary(model).endswith("2 of 6 linear layers in NVFP4")


def test_quantize_names_unconverted_matmul_layers_not_other_parameters(caplog):
    """A convolution's weight feeds a matmul quantize_ does not convert: it is named. A model's
    own positional-embedding parameter (2-D, matmul-sized) is no layer: it is not."""
    class WithPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(64, 32))
            self.conv = nn.Conv1d(32, 32, 3)
            self.fc = nn.Linear(32, 32)

    model, warnings = _quantize_records(caplog, WithPositions())
    assert len(warnings) == 1 and "conv (Conv1d holding weight" in warnings[0]
    assert set(model.nvfp4_kept) == {"conv"}


def test_quantize_says_when_nothing_or_everything_is_converted(caplog):
    _, warnings = _quantize_records(caplog, nn.Sequential(nn.Linear(24, 24)))
    assert warnings == ["quantize_: 0 of 1 linear layers in NVFP4; kept in high precision: "
                        "0 (in_features=24 is not a positive multiple of 16)"]
    _, warnings = _quantize_records(caplog, nn.Sequential(nn.ReLU()))
    assert warnings == ["quantize_: 0 of 0 linear layers in NVFP4"]
    model, warnings = _quantize_records(caplog, nn.Sequential(nn.Linear(32, 32)))
    assert warnings == [] and "quantize_: 1 of 1 linear layers in NVFP4" in caplog.text
    assert model.nvfp4_kept == {}
    model, warnings = _quantize_records(caplog, Net(), filter_fn=lambda m, fqn: fqn != "embed")
    assert "embed (filter_fn returned False)" in warnings[0] and type(model.embed) is nn.Linear
    assert "nvfp4_kept" not in vars(nr.dequantize_(model))


def test_keep_bf16_pattern_that_matches_no_layer_is_named(caplog):
    """A misspelled pattern would quantize the layer it was meant to protect: it is named in a
    WARNING with the closest layer names."""
    model, warnings = _quantize_records(caplog, Net(), nr.NVFP4Recipe(keep_bf16=("lm-head", "embed")))
    assert type(model.lm_head) is nr.NVFP4Linear and type(model.embed) is nn.Linear
    assert any("'lm-head' matches no layer" in w and "lm_head" in w for w in warnings), warnings
    assert not any("'embed' matches no layer" in w for w in warnings)


def test_float64_layers_stay_in_high_precision_with_the_reason(caplog):
    """A float64 layer would fail at its first forward in NVFP4: quantize_ keeps it, says why,
    and the model runs."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32).double())
    model, warnings = _quantize_records(caplog, model)
    assert type(model[0]) is nr.NVFP4Linear and type(model[1]) is nn.Linear
    assert "1 (float64 parameters (NVFP4 layers take bfloat16, float16 or float32))" in warnings[0]
    x = torch.randn(16, 32)
    y = model[1](model[0](x).double())
    assert y.dtype == torch.float64 and torch.isfinite(y).all()


def test_wrong_argument_types_are_named():
    x = torch.randn(16, 16)
    with pytest.raises(TypeError, match="quantize_ takes an nn.Module as model, got Tensor"):
        nr.quantize_(x, nr.NVFP4Recipe())
    model = Net()
    with pytest.raises(TypeError, match="filter_fn must be None or a callable.*got str"):
        nr.quantize_(model, nr.NVFP4Recipe(), filter_fn="2")
    assert "NVFP4Linear" not in kinds(model).values()
    with pytest.raises(TypeError, match="summary takes an nn.Module as model, got Tensor"):
        nr.summary(x)
    with pytest.raises(TypeError, match="dequantize_ takes an nn.Module as model, got Tensor"):
        nr.dequantize_(x)
    with pytest.raises(TypeError, match="tensor_stats takes a torch.Tensor as x, got list"):
        nr.tensor_stats(x.tolist())
    for spec in (None, nr.QuantSpec(), nr.NVFP4Recipe()):
        with pytest.raises(ValueError, match=r"role 'foo'.*\['x_fprop', 'w_fprop'"):
            nr.tensor_stats(x, spec, "foo")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_tensor_stats_reports_non_finite_input(bad):
    """NaN or Inf makes the quantization non-finite (spec item 9): SQNR is nan, not the inf of an
    exact quantization, and the non-finite elements are counted."""
    x = torch.randn(32, 64)
    assert nr.tensor_stats(x)["non_finite"] == 0 and math.isfinite(nr.tensor_stats(x)["sqnr_db"])
    idx = torch.randperm(x.numel())[:3]
    x.view(-1)[idx] = bad
    stats = nr.tensor_stats(x)
    assert math.isnan(stats["sqnr_db"]) and stats["non_finite"] == 3


def test_conversion_builds_each_module_once_from_the_one_it_replaces(monkeypatch):
    """``from_module`` (quantize_'s conversion) makes every kind of NVFP4 module: the recipe state
    once (one ``_init_nvfp4``), the Parameters the same objects, no random number drawn, the train
    mode kept; ``dequantize_`` gives back a plain nn.Linear holding them, or the Conv1D and the
    experts modules themselves."""
    from test_linear import Conv1D
    from test_moe import GroupedExperts, tiny_qwen3_moe
    hf_experts = tiny_qwen3_moe().model.layers[0].mlp.experts
    model = nn.ModuleDict({"linear": nn.Linear(32, 48), "conv": Conv1D(48, 32),
                           "experts": GroupedExperts(32, 48, 4), "hf": hf_experts}).eval()
    originals = dict(model.named_children())
    params = {name: p for name, p in model.named_parameters()}
    inits, init = [], NVFP4Module._init_nvfp4
    monkeypatch.setattr(NVFP4Module, "_init_nvfp4",
                        lambda self, *args: (inits.append(type(self).__name__), init(self, *args))[1])
    rng = torch.get_rng_state()
    nr.quantize_(model, nr.NVFP4Recipe(backend="reference"))
    assert torch.equal(torch.get_rng_state(), rng)
    assert sorted(inits) == ["NVFP4Conv1D", "NVFP4GroupedExperts", "NVFP4HFExperts", "NVFP4Linear"]
    assert {n: type(m).__name__ for n, m in model.named_children()} == {
        "linear": "NVFP4Linear", "conv": "NVFP4Conv1D", "experts": "NVFP4GroupedExperts",
        "hf": "NVFP4HFExperts"}
    assert all(not m.training for m in model.modules())
    assert all(params[name] is p for name, p in model.named_parameters())
    with torch.no_grad():  # the converted modules run
        model["linear"](torch.randn(5, 32))
        model["experts"](torch.randn(8, 32), torch.tensor([4, 0, 4, 0]))
    nr.dequantize_(model)
    assert type(model["linear"]) is nn.Linear and not model["linear"].training
    assert all(model[n] is originals[n] for n in ("conv", "experts", "hf"))
    assert all(params[name] is p for name, p in model.named_parameters())


def test_conversion_errors_name_the_layer_and_the_dimension():
    from test_linear import Conv1D
    with pytest.raises(ValueError, match="^NVFP4Linear: out_features=40 is not a positive multiple of 16$"):
        nr.NVFP4Linear.from_module(nn.Linear(32, 40))
    with pytest.raises(ValueError, match="^NVFP4Conv1D: in_features=24 is not a positive multiple"):
        nr.NVFP4Conv1D.from_module(Conv1D(32, 24))
    with pytest.raises(ValueError, match="^NVFP4GroupedExperts: hidden_dim=0 is not a positive"):
        nr.NVFP4GroupedExperts(32, 0, 2)
    with pytest.raises(TypeError, match="NVFP4Conv1D.from_module"):
        nr.NVFP4Conv1D(Conv1D(32, 32))
    with pytest.raises(TypeError, match="NVFP4FrozenLinear is not made from a high-precision module"):
        nr.NVFP4FrozenLinear.from_module(nn.Linear(32, 32))
    with pytest.raises(ValueError, match="NVFP4GroupedExperts was built directly"):
        nr.dequantize_(nr.NVFP4GroupedExperts(32, 48, 2))
