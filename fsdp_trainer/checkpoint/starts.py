"""The weights a run started from: the models a run holds beside what it saves (a LoRA run's frozen base, a
preference run's reference, later a distillation teacher) take them, and each of the run's checkpoints records where
they came from (path and fingerprint), so that a resume loads the same weights again and refuses changed ones.

Each such model is a Start, declared by whoever holds it (the adapters, a training kind) and handed to the
Checkpointer, which records, fingerprints and reloads every Start the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from fsdp_trainer.checkpoint.storage import CHECKSUMS_FILE, CheckpointError, is_complete
from fsdp_trainer.files import file_sha256

LORA_BASE_FILE = "lora_base.json"
"""In a LoRA run's step directory: the model its adapters apply to, {"path": a checkpoint, or null for the recipe's
seeded init; "fingerprint": sha256 of that checkpoint's checksums.json}."""


@dataclass
class Start:
    """A model of the run that holds the weights the run started from, not weights it trains or saves."""

    record: str
    """The file in every step directory that records where its weights came from."""
    model: nn.Module
    what: str
    """What it is to the run, for messages: "adapters were trained on", "reference model is"."""
    source: Path | None = None
    """Where its weights come from when not from the checkpoint the run starts from (a distillation teacher)."""

    @property
    def use(self) -> str:
        """What its checkpoint is to the run, for the hold the run makes on it: "lora base", "reference", "teacher"."""
        return Path(self.record).stem.replace("_", " ")


def lora_start(policy: nn.Module) -> Start:
    """A LoRA run's frozen base: the policy itself, whose adapters its checkpoints hold alone."""
    return Start(LORA_BASE_FILE, policy, "adapters were trained on")


def base_fingerprint(path: Path) -> str:
    """What identifies a checkpoint's values: the sha256 of its checksums.json (the size and CRC-32 of every file), or
    of its .metadata where it has none."""
    manifest = path / CHECKSUMS_FILE
    return file_sha256(manifest if manifest.is_file() else path / ".metadata")


def lora_base(ckpt: Path) -> Path | None:
    """The base model a LoRA checkpoint's adapters apply to (None: the recipe's seeded init), checked against the
    fingerprint recorded when the run started; CheckpointError naming both if it is gone or changed."""
    return recorded_start(ckpt, LORA_BASE_FILE, "adapters apply to")


def is_adapters_only(ckpt: Path) -> bool:
    """Whether a checkpoint holds a LoRA run's adapters alone, its frozen weights being its base's."""
    return (ckpt / LORA_BASE_FILE).is_file()


def recorded_start(ckpt: Path, record_file: str, what: str) -> Path | None:
    """Where the weights a Start holds came from (None: the recipe's seeded init), as `ckpt` records them, checked
    against the recorded fingerprint; CheckpointError naming both if that checkpoint is gone or changed."""
    if not (ckpt / record_file).is_file():
        raise CheckpointError(f"{ckpt} has no {record_file}: it was saved by a run of another kind")
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
    """The record of a Start's weights: a checkpoint's path and fingerprint, or null for the recipe's seeded init."""
    return json.dumps({"path": None, "fingerprint": None} if path is None else {
        "path": str(path.resolve()), "fingerprint": base_fingerprint(path)
    }).encode()  # fmt: skip
