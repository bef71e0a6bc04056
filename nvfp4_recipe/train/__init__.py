"""The main job: train the same small byte-level transformer under several recipes and compare.

Modules: ``data`` (the corpus of Python sources), ``model`` (TinyLM), ``recipes`` (bf16 and the NVFP4
variants), ``loop`` (one run), ``presets`` (sizes), ``report`` (table, JSON, plot). The command line
is ``nvfp4_recipe.cli``.
"""

from .data import Batches, Corpus, load_corpus
from .loop import RunResult, TrainConfig, train_run
from .model import ModelConfig, TinyLM
from .recipes import RECIPES

__all__ = ["Batches", "Corpus", "load_corpus", "RunResult", "TrainConfig", "train_run",
           "ModelConfig", "TinyLM", "RECIPES"]
