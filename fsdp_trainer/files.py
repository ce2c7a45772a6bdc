"""What a run writes where, and how a file is written so that no reader ever sees half of it.

OUT_DIR/config.yaml      the fully resolved recipe (config.write_config)
OUT_DIR/metrics.jsonl    one JSON object per logged step (metrics.py)
OUT_DIR/tensorboard/     the same scalars as TensorBoard events (metrics.py)
OUT_DIR/checkpoints/     step directories and `latest`, the name of the newest complete one: checkpoint.py writes
                         them; published_step() below is the one reader of `latest` that needs no torch
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"


def write_atomic(path: str | os.PathLike, content: bytes | str) -> None:
    """Write `content` to `path` through a temporary file and a rename: readers see the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content.encode() if isinstance(content, str) else content)
    os.replace(tmp, path)


def published_step(path: str | os.PathLike) -> Path | None:
    """The step directory `latest` names in a checkpoints directory, or in a run directory's checkpoints/; None where
    neither has a `latest`. Whether that step is complete is checkpoint.py's business."""
    path = Path(path)
    for latest in (path / LATEST_FILE, path / CHECKPOINTS_DIR / LATEST_FILE):
        if latest.is_file():
            return latest.parent / latest.read_text().strip()
    return None


def check_writable(out_dir: str, rank: int) -> None:
    """Fail before any collective, naming the directory, if this rank cannot create files in `out_dir` (every rank
    writes checkpoint shards there): a probe file is written, synced and removed."""
    probe = os.path.join(out_dir, f".write_test.rank{rank}")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(bytes(4096))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ValueError(f"train.out_dir={out_dir} is not writable ({e.strerror}); choose another directory") from e
    finally:
        if os.path.exists(probe):
            os.remove(probe)


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
