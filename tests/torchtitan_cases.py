"""Shared torchtitan 0.2 test setup: a job config parsed by torchtitan's ConfigManager with the
``nvfp4`` converter, and the converters torchtitan's trainer builds from it for one process (no
parallelism, no torch.distributed). Import it after ``pytest.importorskip("torchtitan...")``."""


def job(*options):
    """torchtitan's JobConfig of ``--model.converters nvfp4`` (``nvfp4_recipe.torchtitan`` as the
    custom config module) and the extra command-line ``options``."""
    from torchtitan.config import ConfigManager
    return ConfigManager().parse_args(["--job.custom_config_module", "nvfp4_recipe.torchtitan",
                                       "--model.hf_assets_path", ".",  # no tokenizer needed
                                       "--model.converters", "nvfp4", *options])


def converters(job_config):
    """torchtitan's ``build_model_converters`` of the job on a single process (every parallel
    degree 1, world size 1)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return build_model_converters(job_config, dims)
