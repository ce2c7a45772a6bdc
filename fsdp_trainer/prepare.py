"""Text -> token files, at the paths a recipe's `data` section names (tools/prepare_data.py is its command line).

The tokenizer is the one at data.tokenizer_path, used as it is (a sentencepiece model, an HF tokenizer.json or an HF
directory such as an imported model's); only when nothing exists there is a sentencepiece tokenizer trained on the
inputs, with the recipe's model.vocab_size unless a smaller one is asked for (a 128k vocabulary needs far more text
than a few MB). Inputs: `.txt` / `.txt.gz` files are one document each; `.jsonl` / `.jsonl.gz` files one document per
record (its `text_key` field). Each document is encoded as the model was pretrained (BOS where the tokenizer adds
one, EOS last); the last val_fraction of every input file's tokens goes to the validation file. Outputs made from the
same inputs and tokenizer are kept unless forced.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Iterator

import numpy as np

from fsdp_trainer.config import Recipe
from fsdp_trainer.data import write_token_file
from fsdp_trainer.files import file_sha256, write_atomic
from fsdp_trainer.tokenizer import load_tokenizer, train_tokenizer


def _open(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def read_documents(path: str, text_key: str = "text") -> Iterator[str]:
    """The documents of an input file: the whole text of a .txt, each record's `text_key` of a .jsonl (gzipped or
    not). A malformed record raises ValueError naming the file and line."""
    if not path.removesuffix(".gz").endswith(".jsonl"):
        with _open(path) as f:
            yield f.read()
        return
    with _open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_key]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a JSON object with a {text_key!r} field ({e})") from None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{line_no}: field {text_key!r} is {type(text).__name__}, not text")
            yield text


def prepare(
    recipe: Recipe,
    inputs: list[str],
    val_fraction: float = 0.05,
    vocab_size: int | None = None,
    force: bool = False,
    text_key: str = "text",
) -> None:
    """Write data.train_path and data.val_path of the recipe from the files `inputs`, tokenized with the tokenizer at
    data.tokenizer_path (trained there first if there is none)."""
    data = recipe.data
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val_fraction={val_fraction} must lie in [0, 1)")
    for path in inputs:
        if not os.path.isfile(path):
            raise ValueError(f"--input file {path} does not exist")
    outputs = [data.train_path] + ([data.val_path] if data.val_path else [])
    stamp_path = f"{data.train_path}.inputs.json"
    stamp = {"inputs": [file_sha256(p) for p in inputs], "val_fraction": val_fraction, "text_key": text_key}

    if not os.path.exists(data.tokenizer_path):
        vocab_size = vocab_size or recipe.model.vocab_size
        if vocab_size > recipe.model.vocab_size:
            raise ValueError(
                f"--vocab_size={vocab_size} exceeds the recipe's model.vocab_size={recipe.model.vocab_size}"
            )
        with tempfile.TemporaryDirectory() as tmp:  # sentencepiece trains from plain-text files
            plain = []
            for i, path in enumerate(inputs):
                plain.append(os.path.join(tmp, f"{i}.txt"))
                with open(plain[-1], "w", encoding="utf-8") as f:
                    f.write("\n".join(read_documents(path, text_key)))
            train_tokenizer(plain, data.tokenizer_path, vocab_size)
        print(f"{data.tokenizer_path}: trained, vocab {vocab_size}")
    tokenizer = load_tokenizer(data.tokenizer_path)
    if tokenizer.vocab_size > recipe.model.vocab_size:
        raise ValueError(
            f"data.tokenizer_path={data.tokenizer_path} has {tokenizer.vocab_size} ids (added tokens included), more "
            f"than model.vocab_size={recipe.model.vocab_size}: the model could not embed them"
        )
    stamp["tokenizer"] = tokenizer.fingerprint()
    if not force and all(os.path.isfile(p) for p in outputs) and os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                print(f"data already prepared: {', '.join(outputs)} (pass --force to rebuild)")
                return

    train_ids, val_ids = [], []
    for path in inputs:
        ids = [i for doc in read_documents(path, text_key) for i in tokenizer.encode_document(doc)]
        cut = len(ids) - int(len(ids) * val_fraction) if data.val_path else len(ids)
        train_ids.extend(ids[:cut])
        val_ids.extend(ids[cut:])
    write_token_file(data.train_path, np.array(train_ids), tokenizer.vocab_size, stamp["tokenizer"])
    print(f"{data.train_path}: {len(train_ids):,} tokens")
    if data.val_path:
        write_token_file(data.val_path, np.array(val_ids), tokenizer.vocab_size, stamp["tokenizer"])
        print(f"{data.val_path}: {len(val_ids):,} tokens")
    write_atomic(stamp_path, json.dumps(stamp))
