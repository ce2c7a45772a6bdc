"""Checking a checkpoint's files against the checksums written with it, and listing a run's checkpoints."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

from fsdp_trainer.checkpoint.storage import (
    CHECKSUMS_FILE,
    STEP_DIR,
    CheckpointError,
    file_checksum,
    is_complete,
    read_metadata,
    resolve_checkpoint,
)
from fsdp_trainer.files import (
    CHECKPOINTS_DIR,
    published_step,
)

logger = logging.getLogger("fsdp_trainer")


def file_problem(path: Path, name: str, expected: dict[str, int]) -> str | None:
    """What is wrong with one file of a checkpoint against its entry in CHECKSUMS_FILE, or None."""
    file = path / name
    if not file.is_file():
        return f"{file} is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        return f"{file} holds {size} bytes, not the {expected['bytes']} it was saved with (truncated or overwritten)"
    if file_checksum(file)["crc32"] != expected["crc32"]:
        return f"{file} does not match its checksum: its bytes changed after it was saved (a bad disk or copy)"
    return None


def verify_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> list[str] | None:
    """The problems of the files of a step directory (the share of `rank` when the ranks split the work: every
    world_size-th file from the largest down, so N ranks' N shards are read one per rank); [] when they all match,
    None when it has no checksums."""
    manifest = path / CHECKSUMS_FILE
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{manifest} is unreadable ({type(e).__name__}: {e})"]
    names = sorted(files, key=lambda name: (-files[name]["bytes"], name))[rank::world_size]
    return [problem for name in names if (problem := file_problem(path, name, files[name])) is not None]


def checkpoint_steps(path: str | os.PathLike) -> list[Path]:
    """The step directories of a run directory or of its checkpoints/ directory, oldest first, or [path] itself."""
    path = Path(path)
    if STEP_DIR.match(path.name) or is_complete(path):
        return [path]
    for folder in (path / CHECKPOINTS_DIR, path):
        steps = sorted(p for p in folder.iterdir() if STEP_DIR.match(p.name)) if folder.is_dir() else []
        if steps:
            return steps
    raise CheckpointError(f"{path} holds no checkpoint: no step_* directories and no .metadata")


def checkpoint_status(path: Path) -> tuple[str, str]:
    """(status, detail) of one step directory: ok, unverified (saved before checksums), incomplete, refused (its
    metadata names code to run) or corrupted."""
    if not is_complete(path):
        return "incomplete", "no .metadata: its save never finished, or it was cut short"
    problems = verify_checkpoint(path)
    if problems:
        return "corrupted", "; ".join(problems)
    try:
        read_metadata(path)  # checksums cannot vouch for it: whoever wrote a foreign .metadata wrote them too
    except CheckpointError as e:
        return "refused", str(e)
    if problems is None:
        return "unverified", f"no {CHECKSUMS_FILE} (saved before checksums existed)"
    files = json.loads((path / CHECKSUMS_FILE).read_text())["files"]
    return "ok", f"{len(files)} files, {sum(f['bytes'] for f in files.values()) / 1e6:,.1f} MB"


def accepted(path: Path, problems: list[str] | None, warn: bool = True) -> Path:
    """`path`, given what verify_checkpoint found: nothing, or no checksums (a warning says it is unverified, if
    `warn`: on rank 0 only); else CheckpointError naming the first file that fails."""
    if problems is None and warn:
        logger.warning(f"{path} has no {CHECKSUMS_FILE} (saved before checksums existed): loading it unverified")
    elif problems:
        raise CheckpointError(f"checkpoint {path} is corrupted: {problems[0]}")
    return path


def verified_checkpoint(path: str | os.PathLike) -> Path:
    """resolve_checkpoint, then every file checked against its checksum (see accepted)."""
    path = resolve_checkpoint(path)
    return accepted(path, verify_checkpoint(path))


class SharedVerification:
    """Verification of a run's checkpoints by all its ranks together: each reads 1/N of the bytes, and every rank
    takes the same decision from what all found (gathered on `group`, a gloo group of CPU round trips)."""

    def __init__(self, ckpt_dir: Path, group: dist.ProcessGroup, is_main: bool):
        self.dir, self.group, self.is_main = ckpt_dir, group, is_main

    def problems(self, path: Path) -> list[str] | None:
        """verify_checkpoint with the files split over the ranks (each reads 1/N of the bytes), and the problems every
        rank found gathered on all, so that every rank takes the same decision."""
        share = verify_checkpoint(path, dist.get_rank(), dist.get_world_size())
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, share, group=self.group)  # gloo: CPU objects, no device involved
        return None if found[0] is None else sorted(problem for share in found for problem in share)

    def verified(self, path: Path) -> Path:
        return accepted(path, self.problems(path), warn=self.is_main)

    def newest_verified(self) -> Path:
        """The step `latest` names if it verifies; else, with one warning naming what failed, the newest older
        published step that does (keep_last kept it); CheckpointError if none does."""
        latest = published_step(self.dir).name
        older = [p.name for p in self.dir.iterdir() if STEP_DIR.match(p.name) and p.name < latest]
        failed = []
        for name in [latest, *sorted(older, reverse=True)]:
            path = self.dir / name
            problems = self.problems(path) if is_complete(path) else [f"{path} is missing or has no .metadata"]
            if not problems:  # [] verified, or None: saved before checksums existed
                if failed and self.is_main:
                    logger.warning(f"{failed[0]}; resuming from {name}, the newest checkpoint that verifies")
                return accepted(path, problems, warn=self.is_main)
            failed.append(f"checkpoint {name} is corrupted: {problems[0]}")
        raise CheckpointError(
            f"no checkpoint under {self.dir} verifies ({'; '.join(failed)}); copy good ones back, or start over with "
            "--checkpoint.resume none"
        )
