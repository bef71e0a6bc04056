"""repeated_blocks finds the transformer blocks of the models users train: Hugging Face's
``model.layers``, torchtitan's ``layers`` (a ModuleDict), the main job's ``blocks``; and compiling
one block at a time reuses the first block's compiled graph for the others."""

import dataclasses

import pytest
import torch
from torch import nn

from nvfp4_recipe.blocks import repeated_blocks
from nvfp4_recipe.train.loop import build_model, lm_loss
from nvfp4_recipe.train.presets import preset_config
from test_integration import _tiny_llama


def test_hugging_face_layers():
    model = _tiny_llama()
    names = [name for name, _ in repeated_blocks(model)]
    assert names == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]


def test_torchtitan_layers_module_dict():
    pytest.importorskip("torchtitan.models.llama3")
    from torchtitan.models.llama3 import Transformer, llama3_args
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(llama3_args["debugmodel"], max_seq_len=64))
    blocks = repeated_blocks(model)
    assert [name for name, _ in blocks] == [f"layers.{i}" for i in range(len(model.layers))]
    assert all(block is model.layers[name.split(".")[1]] for name, block in blocks)


def test_the_largest_list_wins_over_smaller_ones():
    """A list of heads inside each block has fewer parameters than the list of blocks."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    model = nn.Module()
    model.blocks = nn.ModuleList(Block() for _ in range(2))
    assert [name for name, _ in repeated_blocks(model)] == ["blocks.0", "blocks.1"]


def test_no_repeated_blocks_raises_naming_the_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]))
    with pytest.raises(ValueError, match="Sequential has no repeated blocks"):
        repeated_blocks(model)


def test_compiling_each_block_compiles_one_graph():
    """The quantized blocks share their compiled code: three blocks, one graph, no recompile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = preset_config("tiny", n_layers=3)
    model = build_model(cfg, "nvfp4", torch.device("cpu"))
    for _, block in repeated_blocks(model):
        block.compile(fullgraph=True, backend="aot_eager")
    x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    lm_loss(model, x, x).backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["recompiles"]
    torch._dynamo.reset()
