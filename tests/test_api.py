"""quantize_: the layer filter, logging of skipped layers, torchao registration, summary/tensor_stats."""

import logging

import torch
import torchao
from torch import nn

import nvfp4_recipe as nr


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


def test_keep_first_last_and_distinct_layer_seeds():
    model = nr.quantize_(Net(), nr.NVFP4Recipe(keep_first_last=1))
    assert kinds(model)["embed"] == "Linear" and kinds(model)["lm_head"] == "Linear"
    model = nr.quantize_(Net())
    assert int(model.embed.sr_seed) != int(model.blocks[0].sr_seed)


def test_torchao_quantize_accepts_the_recipe():
    model = Net()
    torchao.quantization.quantize_(model, nr.NVFP4Recipe())
    assert kinds(model)["embed"] == "NVFP4Linear" and kinds(model)["blocks.2"] == "Linear"
    y = model(torch.randn(16, 32))
    assert y.shape == (16, 32) and torch.isfinite(y).all()


def test_summary_and_tensor_stats():
    recipe = nr.NVFP4Recipe(keep_bf16=("lm_head",))
    model = nr.quantize_(Net(), recipe)
    text = nr.summary(model, recipe)
    assert "2 of 5 linear layers in NVFP4" in text and "keep_bf16" in text and "out_features=40" in text
    x = torch.randn(64, 64)
    stats = nr.tensor_stats(x, recipe, "x_fprop")
    assert 10 < stats["sqnr_db"] < 30  # about 4 bits of signal for Gaussian data
    assert 0 <= stats["flushed_to_zero"] < 0.2 and stats["saturated_blocks"] == 0
    assert sum(stats["scale_histogram"].values()) == 64 * 4
    assert stats["amax"] == x.abs().amax().item()
    rht = nr.tensor_stats(x, recipe, "x_wgrad")
    assert rht["amax"] != stats["amax"]  # measured after the RHT
