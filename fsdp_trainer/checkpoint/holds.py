"""What other runs depend on among a run's checkpoints, recorded where that run's rotation (`keep_last`) reads it.

A run that keeps needing another run's checkpoint (its LoRA base, its reference model, its distillation teacher, the
weights it started from) holds it before it reads it:

    SOURCE/checkpoints/holds/step_00000040/dpo-1f0c39a2b4d5.json    {"run": "/abs/runs/dpo", "uses": ["reference"]}

one file per dependent run, written through a temporary file and a rename and synced, so a kill at any instant leaves
the hold whole or not yet made (and the run not yet started). Rotation never deletes a held step, and says once which
run holds it and how to release it. A hold lasts until it is released (`tools/verify_checkpoint.py SOURCE --release
RUN`): deleting or moving the dependent run releases nothing by accident; its hold then shows as stale, and
`--release stale` lets all such go in one command.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_trainer.checkpoint.storage import STEP_DIR, CheckpointError, is_complete
from fsdp_trainer.files import CHECKPOINTS_DIR, write_atomic

logger = logging.getLogger("fsdp_trainer")

HOLDS_DIR = "holds"
STALE = "stale"
"""What `--release` takes to release every hold whose run is gone."""


@dataclass
class Hold:
    """One run's hold on one step of another run."""

    step: Path
    """The held step directory."""
    file: Path
    run: Path
    """The run directory of the run that depends on the step."""
    uses: list[str]
    """What the step is to that run: "lora base", "reference", "teacher", "start"."""

    @property
    def stale(self) -> bool:
        """The holding run's directory is gone (deleted or moved): nothing of it can read the step any more."""
        return not self.run.is_dir()

    def describe(self) -> str:
        """`RUN (its reference)`, with why it is stale where it is."""
        gone = f"; stale: {self.run} is gone" if self.stale else ""
        return f"{self.run} (its {' and '.join(self.uses)}{gone})"

    def kept(self) -> str:
        """What rotation says of a step it kept for this hold: who holds it, and how to release it."""
        return (
            f"kept {self.step}: run {self.describe()} depends on it; once that run is done with it, `python "
            f"tools/verify_checkpoint.py {self.step.parent.parent} --release {self.run}` lets rotation delete it"
        )


def _hold_file(step: Path, run: Path) -> Path:
    key = hashlib.sha256(str(run).encode()).hexdigest()[:12]
    return step.parent / HOLDS_DIR / step.name / f"{run.name}-{key}.json"


def hold(run_dir: str | os.PathLike, step: Path, uses: list[str]) -> None:
    """Record that the run in `run_dir` depends on step directory `step` (as its `uses`), unless the step is the run's
    own or is not a run's step (nothing rotates it). A checkpoint directory this process cannot write to is read unheld,
    with one warning. Raises CheckpointError if the step is gone once the hold is made (rotation won the race)."""
    step, run = Path(step).resolve(), Path(run_dir).resolve()
    if not STEP_DIR.match(step.name) or step.parent == run / CHECKPOINTS_DIR:
        return
    file = _hold_file(step, run)
    held = _read(file)["uses"] if file.is_file() else []
    if not set(uses) <= set(held):
        uses = [*held, *(use for use in uses if use not in held)]
        record = {"run": str(run), "uses": uses, "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(file, json.dumps(record) + "\n", sync=True)
        except OSError as e:
            logger.warning(
                f"could not record at {file} that this run depends on {step} ({e.strerror}): its run's keep_last may "
                "delete it; copy it somewhere it is kept"
            )
    if not is_complete(step):
        raise CheckpointError(f"{step} was deleted as this run started; put it back or start from another step")


def _read(file: Path) -> dict:
    try:
        record = json.loads(file.read_text())
        return {"run": str(record["run"]), "uses": list(record["uses"])}
    except (ValueError, KeyError, TypeError) as e:  # a hold cut short by hand: still a hold, of an unknown run
        raise CheckpointError(f"{file} is not a hold record ({type(e).__name__}: {e}); remove it by hand") from e


def step_holds(step: Path) -> list[Hold]:
    """The holds on one step directory, oldest holder first."""
    folder = step.parent / HOLDS_DIR / step.name
    files = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime) if folder.is_dir() else []
    return [Hold(step, file, Path(record["run"]), record["uses"]) for file in files for record in [_read(file)]]


def all_holds(ckpt_dir: Path) -> list[Hold]:
    """Every hold on the steps of a checkpoints directory, by step (a step since deleted by hand included)."""
    folder = ckpt_dir / HOLDS_DIR
    steps = sorted(p for p in folder.iterdir() if STEP_DIR.match(p.name)) if folder.is_dir() else []
    return [h for step in steps for h in step_holds(ckpt_dir / step.name)]


def release(ckpt_dir: Path, run: str) -> list[Hold]:
    """Drop the holds of run directory `run` (or of every stale holder, for `stale`) on the steps of `ckpt_dir`;
    returns those released. Rotation deletes the steps at the run's next save if nothing else holds them."""
    target = None if run == STALE else Path(run).resolve()
    released = [h for h in all_holds(ckpt_dir) if (h.stale if target is None else h.run == target)]
    for h in released:
        h.file.unlink()
        _drop_if_empty(h.file.parent)
    return released


def _drop_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (another hold), or gone
        pass


def delete_step(step: Path) -> None:
    """Remove a step directory rotation let go, and its (empty) holds folder."""
    shutil.rmtree(step, ignore_errors=True)
    _drop_if_empty(step.parent / HOLDS_DIR / step.name)
