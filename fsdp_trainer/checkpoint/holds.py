"""What other runs depend on among a run's checkpoints, recorded where that run's rotation (`keep_last`) reads it.

A run that keeps needing another run's checkpoint (its LoRA base, its reference model, its distillation teacher, the
weights it started from) holds it before it reads it:

    SOURCE/checkpoints/holds/step_00000040/dpo-1f0c39a2b4d5.json    {"run": "/abs/runs/dpo", "uses": ["reference"]}

one file per dependent run, written through a temporary file and a rename and synced, so a kill at any instant leaves
the hold whole or not yet made (and the run not yet started). Rotation never deletes a held step, and says once which
run holds it and how to release it. A hold lasts until it is released (`tools/verify_checkpoint.py SOURCE --release
RUN`): deleting or moving the dependent run releases nothing by accident; its hold then shows as stale, and
`--release stale` lets all such go in one command.

A tool reading a checkpoint of a run that may be training (consolidate, evaluate, generate, score) holds the step for as
long as it reads it (`reading`): the hold names the process, is removed when it ends, and one whose process is gone
(killed) is dropped by the next reader of the holds on that host.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fsdp_trainer.checkpoint.storage import STEP_DIR, CheckpointError, is_complete, resolve_checkpoint
from fsdp_trainer.files import CHECKPOINTS_DIR, published_step, write_atomic

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
    run: Path | None
    """The run directory of the run that depends on the step (None: a tool reading it)."""
    uses: list[str]
    """What the step is to that run: "lora base", "reference", "teacher", "start"."""
    reader: str | None = None
    """The tool reading the step, while it reads it: `tools/consolidate.py (pid 812@node3)`."""

    @property
    def stale(self) -> bool:
        """The holding run's directory is gone (deleted or moved), or the reading process has ended: nothing of it can
        read the step any more. A reader on another host is taken to be alive."""
        if self.reader is not None:
            pid, _, host = self.file.stem.removeprefix(_READER).partition("@")
            return host == socket.gethostname() and not _alive(int(pid))
        return not self.run.is_dir()

    def describe(self) -> str:
        """`RUN (its reference)`, with why it is stale where it is."""
        if self.reader is not None:
            return f"{self.reader}, reading it{'; stale: its process has ended' if self.stale else ''}"
        gone = f"; stale: {self.run} is gone" if self.stale else ""
        return f"{self.run} (its {' and '.join(self.uses)}{gone})"

    def kept(self) -> str:
        """What rotation says of a step it kept for this hold: who holds it, and how to release it."""
        if self.reader is not None:
            return f"kept {self.step}: {self.describe()}; a later save deletes it once that tool is done"
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


_READER = "reader-"
"""How a tool's hold file is named: reader-PID@HOST.json (a run's: RUNNAME-HASH.json)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextmanager
def reading(path: str | os.PathLike, reader: str) -> Iterator[Path]:
    """Hold the checkpoint `path` names (a step, or a run whose `latest` names one) while a tool reads it, so that the
    run's rotation does not delete it under the tool; yields the step held (`path` itself where it is no checkpoint of
    ours: a Hugging Face directory). The hold goes when the block ends; a killed tool's hold is stale (Hold.stale)."""
    if published_step(path) is None and not STEP_DIR.match(Path(path).name):
        yield Path(path)
        return
    for _ in range(3):  # `latest` may move on and rotation delete its step between reading it and holding it
        step = resolve_checkpoint(path).resolve()
        file = step.parent / HOLDS_DIR / step.name / f"{_READER}{os.getpid()}@{socket.gethostname()}.json"
        record = {"run": None, "uses": ["reading"], "reader": f"{reader} (pid {os.getpid()}@{socket.gethostname()})"}
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(file, json.dumps(record) + "\n")
        except OSError as e:  # a checkpoint we may read but not write: read unheld
            logger.warning(f"could not hold {step} while reading it ({e.strerror}): its run's keep_last may delete it")
            file = None
            break
        if is_complete(step):
            break
        file.unlink(missing_ok=True)
    else:
        raise CheckpointError(f"{path}'s checkpoints were deleted as fast as they were read; try again")
    try:
        yield step
    finally:
        if file is not None:
            file.unlink(missing_ok=True)
            _drop_if_empty(file.parent)


def _read(file: Path) -> dict:
    try:
        record = json.loads(file.read_text())
        run = None if record.get("reader") else str(record["run"])
        return {"run": run, "uses": list(record["uses"]), "reader": record.get("reader")}
    except (ValueError, KeyError, TypeError) as e:  # a hold cut short by hand: still a hold, of an unknown run
        raise CheckpointError(f"{file} is not a hold record ({type(e).__name__}: {e}); remove it by hand") from e


def step_holds(step: Path) -> list[Hold]:
    """The holds on one step directory, oldest holder first; a stale reader's hold is removed, not returned."""
    folder = step.parent / HOLDS_DIR / step.name
    files = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime) if folder.is_dir() else []
    found = [
        Hold(step, file, record["run"] and Path(record["run"]), record["uses"], record["reader"])
        for file in files
        for record in [_read(file)]
    ]
    gone = [h.reader is not None and h.stale for h in found]
    for h in (h for h, stale in zip(found, gone, strict=True) if stale):
        h.file.unlink(missing_ok=True)
        _drop_if_empty(folder)
    return [h for h, stale in zip(found, gone, strict=True) if not stale]


def all_holds(ckpt_dir: Path) -> list[Hold]:
    """Every hold on the steps of a checkpoints directory, by step (a step since deleted by hand included)."""
    folder = ckpt_dir / HOLDS_DIR
    steps = sorted(p for p in folder.iterdir() if STEP_DIR.match(p.name)) if folder.is_dir() else []
    return [h for step in steps for h in step_holds(ckpt_dir / step.name)]


def release(ckpt_dir: Path, run: str) -> list[Hold]:
    """Drop the holds of run directory `run` (or of every stale holder, for `stale`; or of a reading tool, for its
    `PID@HOST`) on the steps of `ckpt_dir`; returns those released. Rotation deletes the steps at the run's next save
    if nothing else holds them."""
    target = None if run == STALE else Path(run).resolve()
    released = [
        h
        for h in all_holds(ckpt_dir)
        if (h.stale if target is None else h.run == target or h.file.stem == f"{_READER}{run}")
    ]
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
