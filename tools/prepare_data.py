"""Text -> sentencepiece tokenizer -> train/val token files, at the paths a recipe's `data` section names.

    python tools/prepare_data.py --recipe recipes/debug.yaml                 # the bundled Shakespeare corpus
    python tools/prepare_data.py --recipe recipes/125m.yaml --input a.txt b.txt.gz

The tokenizer's vocabulary size is the recipe's model.vocab_size unless --vocab_size asks for fewer (a 128k
vocabulary needs far more text than a few MB). Each input file is one document (ended by the
end-of-sequence id); the last val_fraction of every document goes to the validation file. Existing outputs made from
the same inputs are kept (delete them or pass --force to rebuild).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, uninstalled

from fsdp_trainer.config import load_recipe_yaml  # noqa: E402
from fsdp_trainer.data import BUNDLED_CORPUS, write_token_file  # noqa: E402
from fsdp_trainer.tokenizer import Tokenizer, file_sha256, train_tokenizer  # noqa: E402


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def prepare(
    recipe_path: str, inputs: list[str], val_fraction: float = 0.05, vocab_size: int | None = None, force: bool = False
) -> None:
    """Write data.tokenizer_path, data.train_path and data.val_path of the recipe from the text files `inputs`."""
    recipe = load_recipe_yaml(recipe_path)
    data = recipe.data
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
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    print(f"{data.tokenizer_path}: vocab {tokenizer.vocab_size}")


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("--recipe", required=True, help="recipe whose data section names the outputs")
    parser.add_argument("--input", nargs="+", default=[str(BUNDLED_CORPUS)], help="text files (.txt or .txt.gz)")
    parser.add_argument("--val_fraction", type=float, default=0.05, help="tail of each document kept for validation")
    parser.add_argument(
        "--vocab_size",
        type=int,
        default=None,
        help="tokenizer vocabulary (default: the recipe's model.vocab_size; may be smaller)",
    )
    parser.add_argument("--force", type=bool, default=False, help="rebuild even if the outputs are up to date")
    try:
        args = parser.parse_args(argv)
        if not 0 <= args.val_fraction < 1:
            raise ValueError(f"--val_fraction={args.val_fraction} must lie in [0, 1)")
        for path in args.input:
            if not os.path.isfile(path):
                raise ValueError(f"--input file {path} does not exist")
        prepare(args.recipe, args.input, args.val_fraction, args.vocab_size, args.force)
    except Exception as e:  # noqa: BLE001 -- a CLI: one line, exit 1
        sys.exit(f"error: {' '.join(str(e).split())}")


if __name__ == "__main__":
    main()
