"""Fixtures: a tiny tokenized slice of the bundled corpus and a recipe for it. Shared helpers: tests/helpers."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_trainer.data.prepare import BUNDLED_CORPUS
from tests.helpers import REPO, TINY_MODEL


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A recipe file whose data section points at a 512-token tokenizer and token files cut from ~400 KB of
    Shakespeare, all written by tools/prepare_data.py."""
    root = tmp_path_factory.mktemp("data")
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        (root / "corpus.txt").write_text(f.read(400_000))
    recipe = root / "tiny.yaml"
    recipe.write_text(
        json.dumps(  # JSON is YAML
            {
                "model": TINY_MODEL,
                "parallel": {"mixed_precision": "fp32"},
                "data": {
                    "train_path": str(root / "train.bin"),
                    "val_path": str(root / "val.bin"),
                    "tokenizer_path": str(root / "tokenizer.model"),
                    "seq_len": 32,
                    "micro_batch_size": 2,
                },
                "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
                "train": {"steps": 10, "log_every": 1, "eval_every": 0, "eval_steps": 2},
                "checkpoint": {"every": 0},
            }
        )
    )
    tool = [sys.executable, str(REPO / "tools" / "prepare_data.py"), "--recipe", str(recipe)]
    subprocess.run(
        [*tool, "--input", str(root / "corpus.txt"), "--val_fraction", "0.1"],
        check=True,
        capture_output=True,
        text=True,
    )
    return recipe
