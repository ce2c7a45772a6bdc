"""tools/prepare_data.py: what it writes, that it skips up-to-date outputs, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import yaml

from fsdp_trainer.data import TokenFile
from fsdp_trainer.tokenizer import load_tokenizer
from tests.helpers import REPO

TOOL = [sys.executable, str(REPO / "tools" / "prepare_data.py")]


def test_outputs_decode_to_the_input(tiny_data):
    recipe = json.loads(tiny_data.read_text())["data"]
    train, val = TokenFile(recipe["train_path"]), TokenFile(recipe["val_path"])
    tokenizer = load_tokenizer(recipe["tokenizer_path"])
    assert train.vocab_size == tokenizer.vocab_size == 512 and train.meta["dtype"] == "uint16"
    assert train.tokenizer_sha256 == val.tokenizer_sha256 == tokenizer.fingerprint()
    assert 0.08 < len(val) / (len(train) + len(val)) < 0.12  # --val_fraction 0.1
    text = (tiny_data.parent / "corpus.txt").read_text()
    ids = np.concatenate([train.tokens, val.tokens]).tolist()
    assert ids[-1] == tokenizer.eos_id and tokenizer.decode(ids[:-1]) == text  # lossless, newlines included


def test_up_to_date_outputs_are_kept(tiny_data):
    cmd = [*TOOL, "--recipe", str(tiny_data), "--input", str(tiny_data.parent / "corpus.txt"), "--val_fraction", "0.1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "already prepared" in proc.stdout


def test_missing_input_is_one_error_line(tiny_data, tmp_path):
    proc = subprocess.run(
        [*TOOL, "--recipe", str(tiny_data), "--input", str(tmp_path / "nope.txt")], capture_output=True, text=True
    )
    assert proc.returncode == 1 and proc.stderr.strip() == f"error: --input file {tmp_path / 'nope.txt'} does not exist"


def test_the_recipe_is_read_as_the_trainer_reads_it(tiny_data, tmp_path):
    """Any key can be overridden on the command line, and `lr: 3e-4` (a string to PyYAML) is a float here too."""
    sections = json.loads(tiny_data.read_text())
    del sections["optim"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(sections) + "optim:\n  lr: 3e-4\n  min_lr: 3e-5\n")
    out = tmp_path / "other"
    overrides = [
        "--data.train_path",
        out / "train.bin",
        "--data.val_path",
        "null",
        "--data.tokenizer_path",
        out / "tok.model",
        "--vocab_size",
        "400",
    ]
    cmd = [*TOOL, "--recipe", recipe, "--input", tiny_data.parent / "corpus.txt", *overrides]
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert TokenFile(out / "train.bin").vocab_size == load_tokenizer(out / "tok.model").vocab_size == 400
    assert not (out / "val.bin").exists()
