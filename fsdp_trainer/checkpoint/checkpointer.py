"""The Checkpointer: when a run saves, what it restores, and the training states it saves."""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_trainer.checkpoint.holds import delete_step, step_holds
from fsdp_trainer.checkpoint.restore import Restorer
from fsdp_trainer.checkpoint.starts import Start, start_record
from fsdp_trainer.checkpoint.storage import (
    RECIPE_FILE,
    STEP_DIR,
    CheckpointError,
    ChecksummedWriter,
    first_failure,
)
from fsdp_trainer.config import CheckpointConfig, Recipe, recipe_to_yaml
from fsdp_trainer.distributed.runtime import DistEnv, PreemptionFlag
from fsdp_trainer.files import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    published_step,
    write_failure,
)
from fsdp_trainer.tokenizer import tokenizer_files

logger = logging.getLogger("fsdp_trainer")


class OptimState(Stateful):
    """The optimizer's state (AdamW's moments and step counts, Muon's momentum), keyed by parameter name so it
    reshards to another world size."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class Writes:
    """The checkpoints a run writes: one at a time (in the background with `async_save`), `latest` moved to a step
    once it is complete, a failed write removed and said in one line, old ones pruned to `keep_last`."""

    def __init__(
        self, cfg: CheckpointConfig, ckpt_dir: Path, states: dict[str, Stateful], attachments: dict, env: DistEnv
    ):
        self.cfg, self.dir, self.states, self.attachments = cfg, ckpt_dir, states, attachments
        self.is_main, self.local_main = env.is_main, env.local_rank == 0  # local_main says what its node's ranks found
        self.pending: tuple[Future, Path, float, float] | None = None  # future, path, start time, blocked seconds
        self.said_held: set[Path] = set()  # the holds rotation has said it keeps a step for
        # The background write runs its own collectives; on the default group they would interleave with training's
        # and deadlock (gloo hangs until its timeout), so it gets a group of its own.
        self._async_group = dist.new_group(backend="gloo", timeout=env.timeout) if cfg.async_save else None

    def busy(self) -> bool:
        """Whether this rank's background write is still going on."""
        return self.pending is not None and not self.pending[0].done()

    def save(self, step: int, final: bool) -> None:
        """Write `step`; a `final` save (the run's last, or on SIGTERM) that fails stops the run whatever
        checkpoint.on_save_error says."""
        path = self.dir / f"step_{step:08d}"
        if self.pending is not None:  # one write in flight at a time
            self.settle(final=False)
        start = time.perf_counter()
        try:
            writer = ChecksummedWriter(path, self.attachments)
            if self.cfg.async_save:
                future = dcp.async_save(self.states, storage_writer=writer, process_group=self._async_group)
                self.pending = (future, path, start, time.perf_counter() - start)
                return
            dcp.save(self.states, storage_writer=writer)
        except (OSError, CheckpointException) as e:
            self._failed(path, e, final)
            return
        # dcp.save returns only after the coordinator wrote .metadata, the checksums and `latest`, on every rank.
        blocked = time.perf_counter() - start
        self._published(path, blocked, blocked)

    def settle(self, final: bool) -> None:
        """Wait for the background write and publish it, or say it failed."""
        future, path, start, blocked = self.pending
        self.pending = None
        try:
            future.result()  # re-raises a failed background write
        except (OSError, CheckpointException) as e:
            self._failed(path, e, final)
            return
        self._published(path, time.perf_counter() - start, blocked)

    def _failed(self, path: Path, error: BaseException, final: bool) -> None:
        """A save failed on some rank (a full disk, a quota, an I/O error), and DCP raised it on every rank: the partial
        step directory is removed, `latest` (moved only once a step is complete) still names the previous checkpoint,
        each node's first rank says so in one line, and the run stops with CheckpointError or, under
        on_save_error=continue, trains on and saves at the next due step. A `final` save stops it either way: nothing
        would save its steps again."""
        rank, error = first_failure(error)
        rank = dist.get_rank() if rank is None else rank
        if isinstance(error, OSError):
            cause = f"rank {rank}: {write_failure(error, self.dir)}"
        else:
            cause = f"rank {rank}: {type(error).__name__}: {error}"
        if self.is_main:
            shutil.rmtree(path, ignore_errors=True)
        previous = published_step(self.dir)
        kept = f"{self.dir / LATEST_FILE} still names {previous.name}" if previous else "no checkpoint was saved before"
        message = f"checkpoint {path.name} was not saved: {cause}; {kept}"
        if self.cfg.on_save_error == "stop" or final:
            why = "checkpoint.on_save_error=stop" if self.cfg.on_save_error == "stop" else "the run's last save"
            raise CheckpointError(f"{message}; stopping ({why}): make room, then run the same command to resume")
        if self.local_main:
            logger.warning(
                f"{message}; training on, to save again at the next due step (checkpoint.on_save_error=continue)"
            )

    def _published(self, path: Path, total_s: float, blocked_s: float) -> None:
        if self.is_main:
            logger.info(f"saved checkpoint {path} ({total_s:.2f} s, training blocked {blocked_s:.2f} s)")
            prune(self.dir, self.cfg.keep_last, self.said_held)


def prune(ckpt_dir: Path, keep_last: int, said: set[Path]) -> None:
    """Remove all but the `keep_last` newest published checkpoints (0: keep all), except those another run holds
    (holds.py): a line says which run holds each, once a run (`said`: the hold files said so far)."""
    if not keep_last:
        return
    latest = published_step(ckpt_dir).name
    published = sorted(p.name for p in ckpt_dir.iterdir() if STEP_DIR.match(p.name) and p.name <= latest)
    for name in published[:-keep_last]:
        held = step_holds(ckpt_dir / name)  # read just before the delete: a hold made a moment ago counts
        if not held:
            delete_step(ckpt_dir / name)
        for h in held:
            if h.file not in said:
                said.add(h.file)
                logger.warning(f"checkpoint.keep_last={keep_last} {h.kept()}")


def run_attachments(recipe: Recipe, starts: list[Start]) -> dict[str, bytes]:
    """The files every checkpoint of a run carries: its recipe, its tokenizer and its start records (until load() says
    otherwise, every Start holds the recipe's seeded init)."""
    return {
        RECIPE_FILE: recipe_to_yaml(recipe).encode(),
        **{name: path.read_bytes() for name, path in tokenizer_files(recipe.data.tokenizer_path).items()},
        **{start.record: start_record(None) for start in starts},
    }


class Checkpointer:
    """Saves and restores a dict of Stateful objects under `train.out_dir/checkpoints`, when due.

    Each checkpoint carries the recipe and the tokenizer of the run, so tools/consolidate.py can turn it into an HF
    model on its own. With `async_save`, save() returns once the state is copied off the training tensors, and the
    files are written by a background thread; `latest` moves to that step once the write has finished (checked
    without blocking at each later step, and waited for by the next save and by close()).
    """

    def __init__(
        self,
        recipe: Recipe,
        env: DistEnv,
        states: dict[str, Stateful],
        starts: list[Start],
        resumes: Callable[[Path], bool],
    ):
        """`states` are saved and restored whole; `starts` are the models holding the weights the run started from
        (recorded, not saved); `resumes(path)` says whether a checkpoint is of this run's kind, to be resumed whole,
        rather than weights to start from (see restore.py)."""
        self.cfg = recipe.checkpoint
        self.dir = Path(recipe.train.out_dir) / CHECKPOINTS_DIR
        self.states = states
        self.attachments = run_attachments(recipe, starts)
        self.last_saved: int | None = None
        self.resumed_from: Path | None = None  # the step directory load() resumed from; its attachments are read back
        self.preempted = False
        # The checkpointer's own CPU round trips (the preemption flag each step, what verification found), on a gloo
        # group apart from training's collectives.
        self._control = dist.new_group(backend="gloo", timeout=env.timeout)
        self._preemption: PreemptionFlag | None = PreemptionFlag(self._control)
        self._writes = Writes(self.cfg, self.dir, states, self.attachments, env)
        # A step saved again (after a resume fell back past a corrupted copy of it) replaces that copy, as it should.
        warnings.filterwarnings("ignore", "Detected an existing checkpoint")
        precision = recipe.parallel.mixed_precision  # resolved: what this run computes in
        self._restorer = Restorer(
            self.dir, states, starts, self.attachments, resumes, self._control, env.is_main, precision
        )

    def load(self) -> int | None:
        """Restore according to `checkpoint.resume` (restore.py); returns the step resumed from, or None for a run
        that starts at step 0."""
        path = self._restorer.load(self.cfg.resume)
        if path is None:
            return None
        step = self.states["train"].step
        self.last_saved, self.resumed_from = step, path
        logger.info(f"resumed from {path} at step {step}")
        return step

    def save_if_due(self, step: int, last: bool = False) -> None:
        """Save `step` if it is a `checkpoint.every` step, or the `last` of the run (unless saved already), or if
        SIGTERM reached any rank; then `preempted` says the run must stop. Also settles a background write that every
        rank has finished since the last call."""
        # One tiny CPU all-reduce per step (see PreemptionFlag): SIGTERM on any rank, a background write still going on
        # any rank. Settled once no rank writes, so that every rank sees a failed write at the same step.
        self.preempted, writing = self._preemption.agreed(self._writes.busy())
        if self._writes.pending is not None and not writing:
            self._writes.settle(final=False)
        every = self.cfg.every
        due = self.preempted or (bool(every) and (step % every == 0 or last))
        if due and self.last_saved != step:
            if self.preempted:  # every rank saves this step, then the run exits 0; a restart resumes here
                logger.info(f"SIGTERM: saving step {step} and stopping")
            self.last_saved = step
            self._writes.save(step, final=last or self.preempted)

    def close(self, wait: bool = True) -> None:
        """Wait for a background write and settle it (unless not `wait`: after a failure that may have broken its
        collectives), and give SIGTERM back."""
        try:
            if self._writes.pending is not None and wait:
                self._writes.settle(final=True)
        finally:
            self._writes.pending = None
            if self._preemption is not None:
                self._preemption.close()
                self._preemption = None
                dist.destroy_process_group(self._control)  # now, not at interpreter exit (see close_distributed)
                self._control = None
