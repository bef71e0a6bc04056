"""The main job's corpus as torchtitan 0.2 datasets: ``python_sources`` and ``python_sources_val``.

Registered in torchtitan's ``DATASETS`` table as its docs/datasets.md describes custom datasets (a
``DatasetConfig`` of a default path, a loader returning a Hugging Face dataset and a sample
processor) when this module is imported, which ``--job.custom_config_module
nvfp4_recipe.torchtitan_job`` does; then::

    [training]
    dataset = "python_sources"        # the train files
    dataset_path = "/some/tree"       # optional: a directory of .py files; default the stdlib
    [validation]
    dataset = "python_sources_val"    # the held-out files

The files are the main job's (``train.data.load_corpus``: the ``*.py`` files under the directory,
the standard library without site-packages when the path is the stdlib directory, split into train
and validation by whole files, 5% of the bytes held out, seed 0). One sample is one file's text
(UTF-8; an invalid byte reads as U+FFFD), which torchtitan's ``HuggingFaceTextDataset`` tokenizes
with BOS and EOS around it, concatenates and cuts into ``seq_len + 1`` windows. The train files come
in a fixed shuffled order (seed 0; the split itself is sorted by path), contiguous shards of it per
data-parallel rank; the dataset's position (``sample_idx``) is in torchtitan's checkpoints.
"""

import functools
import os
import random
from typing import Dict, List

import torch
from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.tools.logging import logger

from .train.data import FILE_SEPARATOR, Corpus, load_corpus, stdlib_dir

__all__ = ["TRAIN_DATASET", "VALIDATION_DATASET", "load_train_files", "load_validation_files"]

TRAIN_DATASET, VALIDATION_DATASET = "python_sources", "python_sources_val"
SEED = 0  # the main job's default: the file split, and the order of the train files


@functools.lru_cache(maxsize=2)
def _corpus(path: str) -> Corpus:
    """The main job's corpus of ``path`` (the stdlib directory: the main job's default corpus)."""
    if os.path.realpath(path) == os.path.realpath(stdlib_dir()):
        corpus = load_corpus(seed=SEED)
    else:
        corpus = load_corpus([path], use_stdlib=False, seed=SEED)
    logger.info(corpus.summary())
    return corpus


def _texts(stream: torch.Tensor) -> List[str]:
    """The files of a corpus stream (each followed by FILE_SEPARATOR) as text."""
    files = stream.numpy().tobytes().split(FILE_SEPARATOR)[:-1]
    return [f.decode("utf-8", errors="replace") for f in files]


def load_train_files(path: str) -> Dataset:
    """The train files under ``path`` in the fixed shuffled order: a map-style Dataset, column
    ``text``. Raises FileNotFoundError (no such directory) or ValueError (fewer than 2 files)."""
    texts = _texts(_corpus(path).train)
    random.Random(SEED).shuffle(texts)
    return Dataset.from_dict({"text": texts})


def load_validation_files(path: str) -> Dataset:
    """The held-out files under ``path``, sorted by path: a map-style Dataset, column ``text``."""
    return Dataset.from_dict({"text": _texts(_corpus(path).val)})


def _text(sample: Dict[str, str]) -> str:
    return sample["text"]


DATASETS[TRAIN_DATASET] = DatasetConfig(path=stdlib_dir(), loader=load_train_files, sample_processor=_text)
DATASETS[VALIDATION_DATASET] = DatasetConfig(path=stdlib_dir(), loader=load_validation_files,
                                             sample_processor=_text)
