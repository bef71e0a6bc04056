"""One custom config module for torchtitan 0.2 jobs on the main job's corpus (examples/torchtitan).

``--job.custom_config_module nvfp4_recipe.torchtitan_job`` (or ``[job] custom_config_module`` in
the TOML file) brings, in every process torchtitan starts:

- the ``nvfp4`` model converter and its ``[nvfp4]`` job-config section (``nvfp4_recipe.torchtitan``,
  whose ``JobConfig`` this module exports as its own);
- the datasets ``python_sources`` / ``python_sources_val`` (``nvfp4_recipe.torchtitan_data``);
- the llama3 flavor ``1B_bytes``: Llama 3.2 1B's transformer (d_model 2048, 16 layers, 32 heads of
  64, 8 KV heads, SwiGLU FFN 8192, RoPE theta 5e5; 973M parameters in the blocks) with a vocabulary
  of 2048 (the debug model's; the byte tokenizer uses ids 0-257), 0.98B parameters in all, untied
  embeddings. torchtitan 0.2 defines no llama3 flavor between ``debugmodel`` (dim 256) and ``8B``;
  its flavors are the ``llama3_args`` table its llama3 TrainSpec reads (``model_args``), which
  this module extends by one key, so that ``--model.name llama3 --model.flavor 1B_bytes`` builds it.
"""

from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

from .torchtitan import JobConfig
from .torchtitan_data import TRAIN_DATASET, VALIDATION_DATASET

__all__ = ["FLAVOR_1B", "JobConfig", "TRAIN_DATASET", "VALIDATION_DATASET"]

FLAVOR_1B = "1B_bytes"

# FFN hidden: 1.5 * int(2 * 4 * 2048 / 3) = 8191, rounded up to a multiple of 256 (torchtitan's FeedForward)
llama3_args[FLAVOR_1B] = TransformerModelArgs(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=2048, ffn_dim_multiplier=1.5,
    multiple_of=256, rope_theta=500000)
