"""Text -> sentencepiece tokenizer -> train/val token files, at the paths a recipe's `data` section names
(tools/prepare_data.py is its command line).

The tokenizer's vocabulary size is the recipe's model.vocab_size unless a smaller one is asked for (a 128k vocabulary
needs far more text than a few MB). Each input file is one document (ended by the end-of-sequence id); the last
val_fraction of every document goes to the validation file. Outputs made from the same inputs are kept unless forced.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile

import numpy as np

from fsdp_trainer.config import Recipe
from fsdp_trainer.data import write_token_file
from fsdp_trainer.files import file_sha256, write_atomic
from fsdp_trainer.tokenizer import Tokenizer, train_tokenizer


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def prepare(
    recipe: Recipe, inputs: list[str], val_fraction: float = 0.05, vocab_size: int | None = None, force: bool = False
) -> None:
    """Write data.tokenizer_path, data.train_path and data.val_path of the recipe from the text files `inputs`."""
    data = recipe.data
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val_fraction={val_fraction} must lie in [0, 1)")
    for path in inputs:
        if not os.path.isfile(path):
            raise ValueError(f"--input file {path} does not exist")
    vocab_size = vocab_size or recipe.model.vocab_size
    if vocab_size > recipe.model.vocab_size:
        raise ValueError(f"--vocab_size={vocab_size} exceeds the recipe's model.vocab_size={recipe.model.vocab_size}")
    outputs = [data.tokenizer_path, data.train_path] + ([data.val_path] if data.val_path else [])
    stamp = {"inputs": [file_sha256(p) for p in inputs], "vocab_size": vocab_size, "val_fraction": val_fraction}
    stamp_path = f"{data.train_path}.inputs.json"
    if not force and all(os.path.isfile(p) for p in outputs) and os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                print(f"data already prepared: {', '.join(outputs)} (pass --force to rebuild)")
                return

    texts = [read_text(p) for p in inputs]
    with tempfile.TemporaryDirectory() as tmp:  # sentencepiece trains from plain-text files
        plain = []
        for i, text in enumerate(texts):
            plain.append(os.path.join(tmp, f"{i}.txt"))
            with open(plain[-1], "w", encoding="utf-8") as f:
                f.write(text)
        train_tokenizer(plain, data.tokenizer_path, vocab_size)
    tokenizer = Tokenizer(data.tokenizer_path)
    sha = tokenizer.sha256()

    train_ids, val_ids = [], []
    for text in texts:
        ids = tokenizer.encode_document(text)
        cut = len(ids) - int(len(ids) * val_fraction) if data.val_path else len(ids)
        train_ids.extend(ids[:cut])
        val_ids.extend(ids[cut:])
    write_token_file(data.train_path, np.array(train_ids), tokenizer.vocab_size, sha)
    print(f"{data.train_path}: {len(train_ids):,} tokens")
    if data.val_path:
        write_token_file(data.val_path, np.array(val_ids), tokenizer.vocab_size, sha)
        print(f"{data.val_path}: {len(val_ids):,} tokens")
    write_atomic(stamp_path, json.dumps(stamp))
    print(f"{data.tokenizer_path}: vocab {tokenizer.vocab_size}")
