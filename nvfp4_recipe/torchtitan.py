"""A torchtitan model converter: ``--model.converters nvfp4`` trains a torchtitan model in NVFP4.

For torchtitan 0.2 (its ``--model.converters`` registry; ``pip install 'nvfp4-recipe[torchtitan]'``)::

    torchrun --nproc-per-node 8 -m torchtitan.train --job.config_file llama3_8b.toml \\
        --job.custom_config_module nvfp4_recipe.torchtitan \\
        --model.converters nvfp4 --nvfp4.keep_bf16 output --nvfp4.scaling per_token

``--job.custom_config_module nvfp4_recipe.torchtitan`` imports this module, which registers the
converter under the name ``nvfp4`` and adds an ``[nvfp4]`` section to the job config (also settable
in the TOML file): one option per :class:`~nvfp4_recipe.NVFP4Recipe` field, same names, same
defaults, generated from the recipe's fields (``recipe.options_dataclass``; docs/recipe.md). The
converter runs ``quantize_(model, recipe)`` on the model torchtitan built on the meta device (the
layers' buffers are set when it is materialized), then ``distributed.set_sr_rank`` with
torchtitan's data-parallel mesh (``loss``: the data-parallel and context-parallel ranks, which see
different tokens), so that those ranks draw independent SR streams while tensor-parallel ranks
share theirs. torchtitan's tensor-parallel plans
(ColwiseParallel / RowwiseParallel) then shard the NVFP4Linear layers as they would nn.Linear
(``distributed.tensor_parallel_forward``). torchtitan 0.3 builds models from config converters
instead of a name registry; it is not supported yet.
"""

from dataclasses import dataclass, field

from torch import nn

try:
    from torchtitan.protocols.model_converter import register_model_converter
except ImportError as e:
    raise ImportError(
        "nvfp4_recipe.torchtitan needs torchtitan 0.2 (its --model.converters registry; torchtitan "
        "0.3 builds models from config converters, not supported yet): pip install "
        "'nvfp4-recipe[torchtitan]'") from e

from .api import quantize_
from .distributed import set_sr_rank
from .recipe import options_dataclass

__all__ = ["NVFP4", "JobConfig", "NVFP4Converter"]


NVFP4 = options_dataclass(
    "NVFP4", __name__, "The ``[nvfp4]`` section of the job config: NVFP4Recipe's fields (docs/recipe.md).")


@dataclass
class JobConfig:
    """torchtitan's job config extension (``--job.custom_config_module nvfp4_recipe.torchtitan``)."""

    nvfp4: NVFP4 = field(default_factory=NVFP4)


class NVFP4Converter:
    """torchtitan ModelConverter ``nvfp4``: NVFP4Linear in place of the model's eligible nn.Linear.

    Args:
        job_config: torchtitan's JobConfig extended with :class:`JobConfig` (its ``nvfp4``).
        parallel_dims: torchtitan's ParallelDims; its ``loss`` mesh (data- and context-parallel
            ranks) keys the SR streams.
    Raises:
        ValueError: a bad ``[nvfp4]`` option (the message names the recipe field), or a job config
            without the section (the custom config module is missing).
    """

    def __init__(self, job_config, parallel_dims):
        options = getattr(job_config, "nvfp4", None)
        if options is None:
            raise ValueError("the nvfp4 converter needs its job config section: pass "
                             "--job.custom_config_module nvfp4_recipe.torchtitan")
        self.recipe = options.recipe()
        self.parallel_dims = parallel_dims

    def convert(self, model: nn.Module) -> None:
        """``quantize_(model, recipe)`` in place, then this rank's data-parallel SR stream (rank
        0 without data or context parallelism: tensor-parallel ranks share their streams)."""
        quantize_(model, self.recipe)
        if self.parallel_dims.dp_cp_enabled:
            set_sr_rank(model, self.parallel_dims.get_mesh("loss"))

    def post_optimizer_hook(self, model) -> None:
        """Nothing: the master weights are quantized again at every forward."""


register_model_converter(NVFP4Converter, "nvfp4")
