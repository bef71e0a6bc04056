"""Smaller items of issue 47: 4/6 shown by NVFP4Tensor's repr and tensor_stats; set_recipe turning
4/6 off and checking the backend; the main job's seed table and plot title."""

import dataclasses

import pytest
import torch
from torch import nn

import nvfp4_recipe as N
from nvfp4_recipe import reference as R
from nvfp4_recipe.formats import unpack_nibbles
from nvfp4_recipe.spec import FourOverSix, QuantSpec
from nvfp4_recipe.train import job
from nvfp4_recipe.train.loop import RunResult
from nvfp4_recipe.train.report import format_seed_table


def test_repr_and_tensor_stats_show_four_over_six():
    x = torch.randn(32, 64) * torch.rand(32, 64).pow(3)  # uneven blocks: some map to 4
    t = N.NVFP4Tensor.from_hp(x, four_over_six="mse", four_over_six_e4m3_max=256)
    assert "4/6=mse (E4M3 bound 256)" in repr(t) and "4/6" not in repr(N.NVFP4Tensor.from_hp(x))
    spec = QuantSpec(four_over_six=FourOverSix(e4m3_max=256))
    stats = N.tensor_stats(x, spec)
    assert stats["four_over_six"] == {"error": "mae", "e4m3_max": 256, "fast_math": False}
    op = R.quantize(x, spec)
    top = (unpack_nibbles(op.qdata) & 0x7).reshape(32, -1, 16).amax(-1)
    live = op.scale.float() > 0
    want = ((top < 7) & live).sum().item() / live.sum().item()
    assert stats["mapped_to_4"] == want and 0 < want < 1
    assert "four_over_six" not in N.tensor_stats(x)


def test_set_recipe_turns_four_over_six_off_and_checks_the_backend():
    model = N.quantize_(nn.Sequential(nn.Linear(64, 64)),
                        N.NVFP4Recipe(four_over_six="weights", four_over_six_e4m3_max=448))
    N.set_recipe(model, four_over_six=None)  # the bound goes back to its default with 4/6
    assert model[0].recipe.four_over_six is None and model[0].recipe.four_over_six_e4m3_max == 256
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'native' cannot run here"):
            N.set_recipe(model, backend="native")  # Blackwell only (triton runs interpreted here)
        assert model[0].recipe.backend.value == "auto"


def test_seed_table_without_the_baseline_and_a_tiny_title():
    fields = {f.name: None for f in dataclasses.fields(RunResult)}
    run = RunResult(**dict(fields, recipe="nvfp4", status="ok", val_loss=3.0))
    assert "n/a %" not in format_seed_table([run]) and "| n/a" in format_seed_table([run])
    assert job._param_count(26_000) == "26K" and job._param_count(38_200_000) == "38.2M"
