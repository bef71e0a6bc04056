"""torchtitan 0.2's own trainer on the config path of examples/torchtitan (the 2-GPU recipe of
docs/distributed.md), on 2 CPU processes: ``torchrun --nproc-per-node 2`` of ``torchtitan.train``'s
main (``tests/torchtitan_cpu_train.py``: the device module and FSDP2's gradient reduce-scatter
patched for the CPU and gloo) with ``examples/torchtitan/debug_model.toml`` and
``--model.converters nvfp4``: llama3's debug model, FSDP2 over both ranks, the custom config module
``nvfp4_recipe.torchtitan_job``, the ``python_sources`` dataset (the main job's train files: the
standard library) and the byte tokenizer, DCP checkpoints. Shrunk for the CPU: 2 x 64 tokens per
rank and step, 3 steps at a learning rate of 3e-3 after one warm-up step (so that the loss falls
clearly within them), and torch.compile off (the 2-GPU runs compile each block). The trainer's log is read
with ``examples/torchtitan/report.py``, as ``run_2gpu.sh`` reads it.

Also, in this process: the byte tokenizer (id = byte value) and the datasets (the main job's file
split, one sample per file).
"""

import importlib.util
import os
import pathlib
import random
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan.protocols.model_converter",
                    reason="torchtitan 0.2 is an optional extra: pip install 'nvfp4-recipe[torchtitan]'")

from torchtitan.components.tokenizer import HuggingFaceTokenizer  # noqa: E402
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset  # noqa: E402

from nvfp4_recipe.byte_tokenizer import write_byte_tokenizer  # noqa: E402
from nvfp4_recipe.torchtitan_job import TRAIN_DATASET, VALIDATION_DATASET  # noqa: E402
from nvfp4_recipe.train.data import load_corpus  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "torchtitan"
LAUNCHER = pathlib.Path(__file__).resolve().parent / "torchtitan_cpu_train.py"
STEPS, SAVED_AT = 3, 2  # train 3 steps, the full checkpoint at step 2: the resumed run trains step 3
N_NVFP4_LINEARS = 6 * 7 + 1  # the debug model's 6 blocks x (wq, wk, wv, wo, w1, w2, w3), and output


def _report():
    """examples/torchtitan/report.py, the log reader of run_2gpu.sh."""
    spec = importlib.util.spec_from_file_location("torchtitan_report", EXAMPLES / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _report()


def _train(dump: pathlib.Path, tokenizer: pathlib.Path, seed: int, *options: str) -> str:
    """torchtitan's trainer on 2 CPU ranks with the debug config and the nvfp4 converter; its log
    (rank 0's lines and torchrun's)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--local-ranks-filter", "0", str(LAUNCHER),
         "--job.config_file", str(EXAMPLES / "debug_model.toml"), "--job.dump_folder", str(dump),
         "--model.hf_assets_path", str(tokenizer), "--model.converters", "nvfp4",
         "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--training.steps", str(STEPS), "--checkpoint.interval", str(SAVED_AT),
         "--compile.no-enable", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3",
         "--debug.seed", str(seed), "--nvfp4.seed", str(seed), *options],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(dump folder, tokenizer folder, seed, log) of a 3-step run from a fresh seed."""
    tmp = tmp_path_factory.mktemp("torchtitan")
    tokenizer = pathlib.Path(write_byte_tokenizer(str(tmp / "byte_tokenizer")))
    seed = random.SystemRandom().randrange(2**31)
    log = _train(tmp / "run", tokenizer, seed, "--model.print_after_conversion")
    return tmp / "run", tokenizer, seed, log


def test_byte_tokenizer_encodes_each_utf8_byte_as_its_value(tmp_path):
    """Through torchtitan's HuggingFaceTokenizer: random text (ASCII, Latin-1, CJK, emoji, control
    bytes) encodes to its UTF-8 bytes between BOS 256 and EOS 257, and decodes back."""
    tokenizer = HuggingFaceTokenizer(write_byte_tokenizer(str(tmp_path)))
    rng = random.Random(random.SystemRandom().randrange(2**31))
    text = "".join(chr(rng.choice([rng.randrange(0, 128), rng.randrange(128, 0x800),
                                   rng.randrange(0x4E00, 0x9FFF), rng.randrange(0x1F600, 0x1F64F)]))
                   for _ in range(500))
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids == [256, *text.encode("utf-8"), 257]
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.get_vocab_size()) == (256, 257, 258)
    assert tokenizer.decode(ids[1:-1]) == text


def test_datasets_are_the_main_jobs_file_split(tmp_path):
    """``python_sources`` / ``python_sources_val`` of a directory of random .py files: one sample
    per file, the train and validation files of the main job's split (``load_corpus``), the train
    files shuffled; torchtitan's text dataset cuts BOS + bytes + EOS of each file in order into
    windows (labels = inputs shifted by one)."""
    rng = random.Random(random.SystemRandom().randrange(2**31))
    files = {}
    for i in range(12):
        text = "".join(rng.choice("abc xyz=():\n\té") for _ in range(rng.randrange(50, 400)))
        path = tmp_path / f"pkg{i % 3}" / f"m{i}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        files[str(path)] = text
    train = list(DATASETS[TRAIN_DATASET].loader(str(tmp_path))["text"])
    val = list(DATASETS[VALIDATION_DATASET].loader(str(tmp_path))["text"])
    corpus = load_corpus([str(tmp_path)], use_stdlib=False)
    assert sorted(train + val) == sorted(files.values())
    assert sum(len(t.encode()) + 1 for t in val) == corpus.val.numel()
    assert sum(len(t.encode()) + 1 for t in train) == corpus.train.numel()

    tokenizer = HuggingFaceTokenizer(write_byte_tokenizer(str(tmp_path / "tok")))
    dataset = HuggingFaceTextDataset(TRAIN_DATASET, str(tmp_path), tokenizer, seq_len=32)
    stream = [t for text in train for t in (256, *text.encode(), 257)]
    windows = [w for _, w in zip(range(len(stream) // 33), dataset)]
    assert len(windows) == len(stream) // 33 > 0
    for i, (inputs, labels) in enumerate(windows):
        assert inputs["input"].tolist() == stream[33 * i:33 * i + 32]
        assert labels.tolist() == stream[33 * i + 1:33 * i + 33]


def test_torchtitans_trainer_trains_the_debug_model_in_nvfp4_on_the_corpus(first_run):
    """Every linear of the debug model converted (as torchtitan prints the model after its
    converters), the dataset and tokenizer of the config, FSDP2 over the 2 ranks, and the DCP
    checkpoints of the config's interval and last step. The loss is finite and falls from a fresh
    initialization (seeded at random): at step 1 about ln(2048) = 7.6 nats plus half the variance
    of the initial logits (7.9-8.3 measured), then by more than 1 nat in two steps (measured 2.0 to
    2.3 nats) as the model learns the bytes' frequencies."""
    dump, _, seed, log = first_run
    assert log.count("NVFP4Linear(") == N_NVFP4_LINEARS, seed
    assert "Preparing python_sources dataset" in log and "Loading tokenizer from tokenizer.json" in log
    assert "Applied FSDP to the model" in log
    steps = report.parse_log_text(log)
    assert [s.step for s in steps] == list(range(1, STEPS + 1))
    losses = torch.tensor([s.loss for s in steps])
    assert torch.isfinite(losses).all() and 7.6 < losses[0] < 9.0, (seed, losses)
    assert losses[-1] < losses[0] - 1.0, (seed, losses)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == [f"step-{SAVED_AT}", f"step-{STEPS}"]


def test_resumed_from_the_dcp_checkpoint_the_steps_are_bit_identical(first_run, tmp_path):
    """A new trainer process in a new folder holding only the step-2 checkpoint (model with its
    NVFP4 buffers, optimizer, LR schedule, data position) trains step 3 as the uninterrupted run
    did: the same printed loss and grad norm, and the same step-3 checkpoint bit for bit (weights
    and the NVFP4 layers' SR step)."""
    dump, tokenizer, seed, log = first_run
    shutil.copytree(dump / "checkpoint" / f"step-{SAVED_AT}", tmp_path / "checkpoint" / f"step-{SAVED_AT}")
    resumed = _train(tmp_path, tokenizer, seed)
    assert f"Training starts at step {SAVED_AT + 1}" in resumed
    reference, resumed_steps = report.parse_log_text(log), report.parse_log_text(resumed)
    assert [s.step for s in resumed_steps] == list(range(SAVED_AT + 1, STEPS + 1))
    assert report.resumed_mismatches(reference, resumed_steps, SAVED_AT) == []
    assert report.resumed_mismatches(reference, resumed_steps, 0)[0] == "step 1: missing from the resumed run"
    final = f"step-{STEPS}"
    assert report.checkpoint_mismatches(str(dump / "checkpoint" / final),
                                        str(tmp_path / "checkpoint" / final)) == []
    earlier = report.checkpoint_mismatches(str(dump / "checkpoint" / final),
                                           str(dump / "checkpoint" / f"step-{SAVED_AT}"))
    assert any(p.endswith("sr_step: differs") for p in earlier)  # the comparisons can fail
