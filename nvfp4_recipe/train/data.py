"""The training corpus: Python source files read as bytes (vocabulary 256), split by file.

The default corpus is the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``
without its ``site-packages`` / ``dist-packages``), which every Python installation has, so the main
job needs no download. More directories can be added (``--data``).
"""

import os
import random
import sysconfig
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

# Separates two files in the token stream (a byte that does not occur in ordinary Python source).
FILE_SEPARATOR = b"\x00"
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".tox", "node_modules"}
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages"}


def stdlib_dir() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def find_sources(root: str, skip: Iterable[str] = ()) -> List[str]:
    """Sorted paths of the ``*.py`` files under ``root`` (following no symlinked directories).

    Args:
        root: a directory.
        skip: directory names not to descend into (besides caches and VCS directories).
    Raises:
        FileNotFoundError: ``root`` is not a directory; the message is "data directory not found: ROOT".
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(f"data directory not found: {root}")
    skip = _SKIP_DIRS | set(skip)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found)


def split_files(files: Sequence[Tuple[str, int]], val_fraction: float,
                seed: int) -> Tuple[List[str], List[str]]:
    """Split (path, size) pairs into train and validation files, deterministically for ``seed``.

    The files are shuffled by ``random.Random(seed)``; validation takes files from the front of the
    shuffled order until it holds at least ``val_fraction`` of all bytes (and at least one file).

    Raises:
        ValueError: fewer than two files, or a fraction outside (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(files) < 2:
        raise ValueError(f"need at least 2 source files for a train/validation split, found {len(files)}")
    order = sorted(files)
    random.Random(seed).shuffle(order)
    total = sum(size for _, size in order)
    val, val_bytes = [], 0
    for path, size in order[:-1]:
        if val and val_bytes >= val_fraction * total:
            break
        val.append(path)
        val_bytes += size
    val_set = set(val)
    train = [path for path, _ in order if path not in val_set]
    return sorted(train), sorted(val)


def read_tokens(paths: Sequence[str]) -> torch.Tensor:
    """The bytes of ``paths`` joined by :data:`FILE_SEPARATOR`, as a uint8 (n_bytes,) tensor."""
    blob = bytearray()
    for path in paths:
        with open(path, "rb") as f:
            blob += f.read()
        blob += FILE_SEPARATOR
    return torch.frombuffer(blob, dtype=torch.uint8).clone() if blob else torch.zeros(0, dtype=torch.uint8)


@dataclass
class Corpus:
    """Train and validation token streams (uint8, one token per byte) and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    roots: List[str]
    train_files: int
    val_files: int

    def summary(self) -> str:
        files = self.train_files + self.val_files
        nbytes = self.train.numel() + self.val.numel()
        return (f"data: {files} .py files, {nbytes / 1e6:.1f} MB from {', '.join(self.roots)}; "
                f"train {self.train_files} files / {self.train.numel() / 1e6:.2f} MB, "
                f"validation {self.val_files} files / {self.val.numel() / 1e6:.2f} MB (split by file)")

    def as_dict(self) -> dict:
        return {"roots": self.roots, "files": self.train_files + self.val_files,
                "bytes": self.train.numel() + self.val.numel(), "train_files": self.train_files,
                "train_bytes": self.train.numel(), "val_files": self.val_files,
                "val_bytes": self.val.numel()}


def load_corpus(extra_dirs: Sequence[str] = (), use_stdlib: bool = True, val_fraction: float = 0.05,
                seed: int = 0, max_bytes: Optional[int] = None) -> Corpus:
    """Read the corpus and split it by file.

    Args:
        extra_dirs: more directories whose ``*.py`` files are added (``--data``).
        use_stdlib: include the standard library (without site-packages / dist-packages).
        val_fraction: share of the bytes (by whole files) held out for validation.
        seed: seeds the file split.
        max_bytes: if set, keep a seeded random subset of files of about this many bytes in all
            (before the split), so that huge trees load quickly.
    Raises:
        FileNotFoundError: a directory does not exist ("data directory not found: DIR").
        ValueError: no directories, or fewer than two source files.
    """
    roots = ([stdlib_dir()] if use_stdlib else []) + [os.path.abspath(d) for d in extra_dirs]
    if not roots:
        raise ValueError("no data: give --data DIR or leave the standard library in")
    paths = []
    for root in roots:
        skip = _STDLIB_SKIP_DIRS if root == stdlib_dir() and use_stdlib else ()
        paths.extend(find_sources(root, skip))
    files = _nonempty_sizes(paths)
    if max_bytes is not None:
        files = _subset(files, max_bytes, seed)
    train, val = split_files(files, val_fraction, seed)
    return Corpus(read_tokens(train), read_tokens(val), roots, len(train), len(val))


def _nonempty_sizes(paths: Iterable[str]) -> List[Tuple[str, int]]:
    """Sorted, deduplicated (path, size) of the non-empty files; broken links are left out."""
    files = set()
    for path in paths:
        try:
            size = os.path.getsize(path)
        except OSError:
            continue
        if size > 0:
            files.add((path, size))
    return sorted(files)


def _subset(files: List[Tuple[str, int]], max_bytes: int, seed: int) -> List[Tuple[str, int]]:
    """A seeded random subset of ``files`` holding at most about ``max_bytes`` bytes."""
    order = list(files)
    random.Random(seed + 1).shuffle(order)
    kept, total = [], 0
    for path, size in order:
        if kept and total + size > max_bytes:
            continue
        kept.append((path, size))
        total += size
    return sorted(kept)


class Batches:
    """Random training windows and fixed validation windows of ``seq_len + 1`` tokens.

    The training order depends only on ``seed``, so every recipe sees the same batches.
    """

    def __init__(self, corpus: Corpus, batch_size: int, seq_len: int, seed: int):
        for name, stream in (("train", corpus.train), ("validation", corpus.val)):
            if stream.numel() <= seq_len + 1:
                raise ValueError(f"the {name} data ({stream.numel()} bytes) is shorter than one "
                                 f"sequence of {seq_len + 1} tokens")
        self.corpus, self.batch_size, self.seq_len = corpus, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def train_batch(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, int64 (batch_size, seq_len), from random offsets of the train stream."""
        n = self.corpus.train.numel() - self.seq_len - 1
        starts = torch.randint(0, n + 1, (self.batch_size,), generator=self.generator)
        return self._windows(self.corpus.train, starts, device)

    def val_batches(self, max_tokens: int, device: torch.device):
        """Yield (inputs, targets) of non-overlapping windows spread evenly over the validation
        stream, about ``max_tokens`` target tokens in all (at least one batch); the same every call."""
        n_windows = max(self.batch_size, max_tokens // self.seq_len)
        span = self.corpus.val.numel() - self.seq_len - 1
        n_windows = min(n_windows, span // self.seq_len + 1)
        starts = torch.linspace(0, span, n_windows).long()
        for i in range(0, n_windows, self.batch_size):
            yield self._windows(self.corpus.val, starts[i:i + self.batch_size], device)

    def _windows(self, stream: torch.Tensor, starts: torch.Tensor, device: torch.device):
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        w = stream[idx].to(device=device, dtype=torch.int64, non_blocking=True)
        return w[:, :-1], w[:, 1:]
