"""A byte-level Hugging Face tokenizer: token id = byte value (0-255), BOS 256, EOS 257.

The main job's vocabulary (``train/data.py``: one token per byte of UTF-8 Python source) with the
two special tokens torchtitan's text datasets put around each sample, written as the files that
torchtitan's ``HuggingFaceTokenizer`` reads from ``--model.hf_assets_path``: ``tokenizer.json``
(the ``tokenizers`` package's format) and ``tokenizer_config.json`` (which names BOS and EOS).
Nothing is downloaded::

    python -m nvfp4_recipe.byte_tokenizer assets/byte_tokenizer

The tokenizer is GPT-2's byte-level pre-tokenizer (each UTF-8 byte mapped to one printable
character, ``bytes_to_unicode`` of openai/gpt-2 ``src/encoder.py``) and a BPE model with those 256
characters as its vocabulary and no merges, so encoding ``text`` gives ``list(text.encode())``.
"""

import argparse
import json
import os
from typing import Dict

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

__all__ = ["BOS", "EOS", "VOCAB_SIZE", "byte_tokenizer", "write_byte_tokenizer"]

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"  # llama3's names; ids 256 and 257
VOCAB_SIZE = 258


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (openai/gpt-2 ``src/encoder.py``),
    the one ``tokenizers``' ByteLevel pre-tokenizer applies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]  # control bytes, space, DEL, 0x80-0xa0, 0xad
    chars.update((b, chr(256 + i)) for i, b in enumerate(others))
    return chars


def byte_tokenizer() -> Tokenizer:
    """The tokenizer: id of each UTF-8 byte = its value, then BOS (256) and EOS (257)."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    return tokenizer


def write_byte_tokenizer(directory: str) -> str:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (made if missing,
    files replaced); returns ``directory``, the value for torchtitan's ``--model.hf_assets_path``."""
    os.makedirs(directory, exist_ok=True)
    byte_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f, indent=2)
    return directory


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", help="where tokenizer.json and tokenizer_config.json go")
    print(write_byte_tokenizer(parser.parse_args(argv).directory))


if __name__ == "__main__":
    main()
