"""The weights a run started from, recorded in each of its checkpoints (path and fingerprint) and checked when they
are loaded again."""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_trainer.checkpoint.storage import CHECKSUMS_FILE, CheckpointError, is_complete
from fsdp_trainer.files import (
    file_sha256,
)

LORA_BASE_FILE = "lora_base.json"
"""In a LoRA run's step directory: the model its adapters apply to, {"path": a weights-only checkpoint, or null for
the recipe's seeded init; "fingerprint": sha256 of that checkpoint's checksums.json}."""


def base_fingerprint(path: Path) -> str:
    """What identifies a weights-only checkpoint's values: the sha256 of its checksums.json (the size and CRC-32 of
    every file), or of its .metadata where it has none."""
    manifest = path / CHECKSUMS_FILE
    return file_sha256(manifest if manifest.is_file() else path / ".metadata")


def lora_base(ckpt: Path) -> Path | None:
    """The base model a LoRA checkpoint's adapters apply to (None: the recipe's seeded init), checked against the
    fingerprint recorded when the run started; CheckpointError naming both if it is gone or changed."""
    return _recorded_start(ckpt, LORA_BASE_FILE, "adapters apply to", "it is not a LoRA checkpoint of this trainer")


REFERENCE_FILE = "reference.json"
"""In a full fine-tuning preference run's step directory: the weights its frozen reference model holds, the model the
run started from, recorded as LORA_BASE_FILE records a base."""


def preference_reference(ckpt: Path) -> Path | None:
    """The checkpoint a preference run's reference was loaded from (None: the recipe's seeded init), checked as
    lora_base checks a base."""
    return _recorded_start(ckpt, REFERENCE_FILE, "reference model is", "it is not a preference run's checkpoint")


def _recorded_start(ckpt: Path, record_file: str, what: str, foreign: str) -> Path | None:
    if not (ckpt / record_file).is_file():
        raise CheckpointError(f"{ckpt} has no {record_file}: {foreign}")
    record = json.loads((ckpt / record_file).read_text())
    if record["path"] is None:
        return None
    base = Path(record["path"])
    if not is_complete(base):
        raise CheckpointError(f"{ckpt}'s {what} {base}, which is gone; put that checkpoint back")
    fingerprint = base_fingerprint(base)
    if fingerprint != record["fingerprint"]:
        raise CheckpointError(
            f"{ckpt}'s {what} {base} as it was when the run started, and its weights have changed since (fingerprint "
            f"{fingerprint[:12]}, recorded {record['fingerprint'][:12]}); put the original back"
        )
    return base


def start_record(path: Path | None) -> bytes:
    return json.dumps({"path": None, "fingerprint": None} if path is None else {
        "path": str(path.resolve()), "fingerprint": base_fingerprint(path)
    }).encode()  # fmt: skip
