"""High-precision tails (keep_first_blocks / keep_last_blocks: whole transformer blocks, found from
the model's repeated blocks, with their experts) and set_recipe (a quantized model's recipe
changed mid-run, its SR streams going on where they were)."""

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

import nvfp4_recipe as nr
from nvfp4_recipe.train.model import TinyLM
from nvfp4_recipe.train.presets import preset_config
from test_integration import _tiny_llama
from test_moe import tiny_qwen3_moe


def _tiny_lm(n_layers=4):
    torch.manual_seed(0)
    return TinyLM(preset_config("tiny", n_layers=n_layers).model_config())


def _precision(model):
    return {fqn: isinstance(m, nr.NVFP4Linear) for fqn, m in model.named_modules()
            if isinstance(m, (nn.Linear, nr.NVFP4Linear))}


@pytest.mark.parametrize("first,last,kept", [(1, 0, {0}), (0, 2, {8, 9}), (0, 0.15, {8, 9}),
                                              (0.1, 0.1, {0, 9}), (3, 9, set(range(10)))])
def test_tails_keep_whole_blocks_counted_or_as_a_fraction_rounded_up(first, last, kept):
    model = nr.quantize_(_tiny_lm(10), nr.NVFP4Recipe(keep_first_blocks=first, keep_last_blocks=last))
    for fqn, nvfp4 in _precision(model).items():
        if fqn.startswith("blocks."):
            assert nvfp4 == (int(fqn.split(".")[1]) not in kept), fqn
    assert _precision(model)["lm_head"]


def test_tails_are_logged_by_name(caplog):
    with caplog.at_level(logging.WARNING, logger="nvfp4_recipe"):
        model = nr.quantize_(_tiny_lm(), nr.NVFP4Recipe(keep_last_blocks=1))
    assert "blocks.3.mlp.fc2 (in block blocks.3, one of the last 1 of 4 blocks (keep_last_blocks))" \
        in caplog.text
    assert "keep_last_blocks" in nr.summary(model)


def test_tails_of_a_hugging_face_model():
    model = nr.quantize_(_tiny_llama(), nr.NVFP4Recipe(keep_first_blocks=1))
    layers = _precision(model)
    assert not any(v for k, v in layers.items() if k.startswith("model.layers.0."))
    assert all(v for k, v in layers.items() if k.startswith("model.layers.1."))


def test_a_kept_block_keeps_its_experts():
    model = nr.quantize_(tiny_qwen3_moe(), nr.NVFP4Recipe(keep_last_blocks=1))
    assert not any(isinstance(m, nr.layer.NVFP4Module) for m in model.model.layers[0].modules())
    assert "keep_last_blocks" in model.nvfp4_kept["model.layers.0.mlp.experts"]


def test_tails_need_repeated_blocks_and_the_model():
    with pytest.raises(ValueError, match="keep_last_blocks: Sequential has no repeated blocks"):
        nr.quantize_(nn.Sequential(nn.Linear(16, 16)), nr.NVFP4Recipe(keep_last_blocks=1))
    from torchao.quantization import quantize_ as torchao_quantize_
    with pytest.raises(ValueError, match="keep_last_blocks"):
        torchao_quantize_(nn.Sequential(nn.Linear(16, 16)), nr.NVFP4Recipe(keep_last_blocks=1,
                                                                          stochastic_rounding=False))


def _train(model, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    model.zero_grad()
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 64), generator=g)
        model(x).float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_set_recipe_keeps_the_sr_streams_going():
    """A model switched to a high-precision backward and back continues bit for bit as one that
    never switched; while switched, its SR steps do not move."""
    a = nr.quantize_(_tiny_lm(2), nr.NVFP4Recipe(backend="reference"))
    b = copy.deepcopy(a)
    _train(a, 2), _train(b, 2)
    nr.set_recipe(b, backward_override="high_precision")
    steps = [int(m.sr_step) for m in b.modules() if isinstance(m, nr.NVFP4Linear)]
    _train(b, 1, seed=5)
    assert steps == [int(m.sr_step) for m in b.modules() if isinstance(m, nr.NVFP4Linear)]
    nr.set_recipe(b, backward_override=None)
    for ga, gb in zip(_train(a, 1, seed=9), _train(b, 1, seed=9)):
        assert torch.equal(ga, gb)


def test_set_recipe_forward_override_runs_fprop_in_high_precision():
    model = nr.set_recipe(nr.quantize_(_tiny_lm(1), nr.NVFP4Recipe(backend="reference")),
                          forward_override="high_precision")
    layer = model.blocks[0].mlp.fc1
    assert layer.recipe == dataclasses.replace(nr.NVFP4Recipe(backend="reference"),
                                               forward_override="high_precision")
    x = torch.randn(16, 32)
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_set_recipe_refuses_what_quantize_fixed_and_changes_nothing_then():
    model = nr.quantize_(_tiny_lm(1), nr.NVFP4Recipe())
    before = [m.recipe for m in model.modules() if isinstance(m, nr.NVFP4Linear)]
    with pytest.raises(ValueError, match="cannot change seed: it sets the layers' SR streams"):
        nr.set_recipe(model, seed=3)
    with pytest.raises(ValueError, match="cannot change keep_last_blocks"):
        nr.set_recipe(model, keep_last_blocks=1)
    with pytest.raises(TypeError, match="no field 'scalling'"):
        nr.set_recipe(model, scalling="per_token")
    with pytest.raises(ValueError, match="NVFP4Recipe.scaling"):
        nr.set_recipe(model, scaling="bogus")
    with pytest.raises(ValueError, match="no NVFP4 module"):
        nr.set_recipe(nn.Linear(16, 16), rht=False)
    assert before == [m.recipe for m in model.modules() if isinstance(m, nr.NVFP4Linear)]
