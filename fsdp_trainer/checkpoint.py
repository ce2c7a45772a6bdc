"""Sharded checkpoints of the whole training state through torch.distributed.checkpoint (DCP).

Layout (this module is the only one that knows it):

    OUT_DIR/checkpoints/step_00000100/   a DCP directory: one file per rank plus `.metadata`, written last, and the
                                         attachments (recipe.yaml, the tokenizer's files: tokenizer.model or
                                         tokenizer.json + tokenizer_config.json) that make it self-describing
    OUT_DIR/checkpoints/latest           text: the name of the newest complete step directory

A weights-only checkpoint (`import_hf`) holds just the `model` entry; loading it starts a fresh optimizer,
data stream and step count.

A step directory counts only once `.metadata` exists and `latest` names it; `latest` is replaced atomically
(temp file + os.replace) after every rank has finished writing, so a crash at any instant leaves `latest` naming a
complete checkpoint. Retention deletes only published steps older than the newest `keep_last`.

The Checkpointer decides when to save: every `checkpoint.every` steps, after the last step, and at once when SIGTERM
reaches any rank (preemption), whatever `every` says.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_trainer.config import Recipe, recipe_to_yaml
from fsdp_trainer.files import CHECKPOINTS_DIR, CONFIG_FILE, write_atomic
from fsdp_trainer.optim import MASTER_WEIGHT_BYTES, OPTIMIZER_STATE_BYTES
from fsdp_trainer.parallel import DistEnv, PreemptionFlag
from fsdp_trainer.tokenizer import tokenizer_files

logger = logging.getLogger("fsdp_trainer")

_STEP_DIR = re.compile(r"^step_(\d{8})$")
RECIPE_FILE = "recipe.yaml"
"""The recipe a checkpoint was saved with, inside its step directory (beside the tokenizer it was trained with)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: missing, incomplete, foreign, or of another model."""


class ModelState(Stateful):
    """The model's (sharded) weights under their HF names, whatever wrappers the model carries."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimState(Stateful):
    """AdamW moments and step counts, keyed by parameter name so they reshard to another world size."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def is_complete(path: str | os.PathLike) -> bool:
    """A DCP directory is complete once its coordinator wrote `.metadata`, which it does last."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory, or a run / checkpoints directory whose `latest` names one; raises with what is wrong."""
    path = Path(path)
    for candidate in (path / "latest", path / CHECKPOINTS_DIR / "latest"):
        if candidate.is_file():
            target = candidate.parent / candidate.read_text().strip()
            if not is_complete(target):
                raise CheckpointError(f"{candidate} names {target}, which is missing or incomplete (no .metadata)")
            return target
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete DCP checkpoint (no .metadata); it is truncated or foreign")
    return path


def check_model_shapes(path: Path, model_state: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model before DCP fails deep inside with a shape error."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, tensor in model_state.items():
        key = f"model.{name}"
        saved = metadata.get(key)
        if saved is None:
            raise CheckpointError(f"checkpoint {path} has no tensor {name}: it was saved from another model")
        if isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path} holds {name} of shape {tuple(saved.size)} but the recipe's model has "
                f"{tuple(tensor.shape)}: the recipe's model section differs from the run that saved it"
            )


def checkpoint_recipe(path: Path) -> Path:
    """The recipe a checkpoint was saved with: its own recipe.yaml, else its run's config.yaml."""
    for candidate in (path / RECIPE_FILE, path.parent.parent / CONFIG_FILE):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{path} has no {RECIPE_FILE} and no run {CONFIG_FILE} two levels up")


def checkpoint_tokenizer(path: Path, tokenizer_path: str) -> Path | None:
    """Where the tokenizer a checkpoint was trained with is: its own copy (the step directory), else the recipe's
    data.tokenizer_path, if either exists."""
    for candidate in (path, Path(tokenizer_path)):
        try:
            tokenizer_files(candidate)
            return candidate
        except FileNotFoundError:
            continue
    return None


def check_disk_room(out_dir: str, n_params: int) -> None:
    """Fail before any collective, naming the directory, if its disk lacks room for one checkpoint of the model: fp32
    weights and AdamW moments (gradients are not saved)."""
    need = (MASTER_WEIGHT_BYTES + OPTIMIZER_STATE_BYTES) * n_params
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise ValueError(
            f"train.out_dir={out_dir} has {free / 1e9:.1f} GB free, and one checkpoint of this model takes "
            f"{need / 1e9:.1f} GB; free space or choose another directory"
        )


def publish_latest(ckpt_dir: Path, name: str) -> None:
    """Point `latest` at step directory `name` atomically: readers see the old name or the new one, never half."""
    write_atomic(ckpt_dir / "latest", name + "\n")


def saved_entries(path: Path) -> set[str]:
    """The top-level entries (model, optim, data, train) a DCP checkpoint holds."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key.split(".", 1)[0] for key in metadata}


def load_model_weights(path: str | os.PathLike, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The full fp32 model weights of a checkpoint saved at any world size, read without a process group."""
    path = resolve_checkpoint(path)
    check_model_shapes(path, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    state = {"model": {name: torch.empty(shape) for name, shape in shapes.items()}}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["model"]


def save_model_weights(
    state: dict[str, torch.Tensor], out_dir: str | os.PathLike, attachments: dict[str, bytes] | None = None
) -> Path:
    """Write full weights as a weights-only checkpoint `out_dir/checkpoints/step_00000000` and publish it, so that
    `--checkpoint.resume out_dir` starts training from them. Needs no process group."""
    ckpt_dir = Path(out_dir) / CHECKPOINTS_DIR
    path = ckpt_dir / "step_00000000"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    for name, content in (attachments or {}).items():
        (path / name).write_bytes(content)
    publish_latest(ckpt_dir, path.name)
    return path


class Checkpointer:
    """Saves and restores a dict of Stateful objects under `train.out_dir/checkpoints`, when due.

    Each checkpoint carries the recipe and the tokenizer of the run, so tools/consolidate.py can turn it into an HF
    model on its own. With `async_save`, save() returns once the state is copied off the training tensors, and the
    files are written by a background thread; `latest` moves to that step once the write has finished (checked
    without blocking at each later step, and waited for by the next save and by close()).
    """

    def __init__(self, recipe: Recipe, env: DistEnv, states: dict[str, Stateful]):
        self.cfg = recipe.checkpoint
        self.dir = Path(recipe.train.out_dir) / CHECKPOINTS_DIR
        self.states = states
        self.is_main = env.is_main
        self.attachments = {
            RECIPE_FILE: recipe_to_yaml(recipe).encode(),
            **{name: path.read_bytes() for name, path in tokenizer_files(recipe.data.tokenizer_path).items()},
        }
        self.last_saved: int | None = None
        self.preempted = False
        self._preemption: PreemptionFlag | None = PreemptionFlag(env.timeout)
        self._pending: tuple[Future, Path, float, float] | None = None  # future, path, start time, blocked seconds
        # The background write runs its own collectives; on the default group they would interleave with training's
        # and deadlock (gloo hangs until its timeout), so it gets a group of its own.
        self._async_group = dist.new_group(backend="gloo", timeout=env.timeout) if self.cfg.async_save else None

    def load(self) -> int | None:
        """Restore according to `checkpoint.resume`; returns the step resumed from, or None for a fresh start."""
        resume = self.cfg.resume
        has_own = (self.dir / "latest").is_file()
        if resume == "none" or (resume == "auto" and not has_own):
            return None
        path = resolve_checkpoint(self.dir if resume == "auto" else resume)
        if saved_entries(path) == {"model"}:  # weights only (an imported model): where this run starts
            if not has_own:  # fresh optimizer, data stream and step
                check_model_shapes(path, self.states["model"].state_dict())
                dcp.load({"model": self.states["model"]}, checkpoint_id=str(path))
                logger.info(f"loaded weights from {path}; starting at step 0")
                return None
            # The same command again after a preemption or a torchrun restart: the run goes on from its own latest
            # instead of starting over from the weights (and losing every step since).
            logger.info(f"{path} holds the weights this run started from; continuing the run from its own checkpoints")
            path = resolve_checkpoint(self.dir)
        check_model_shapes(path, self.states["model"].state_dict())
        saved = saved_entries(path)
        missing = set(self.states) - saved
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {sorted(missing)}: it was not written by this trainer")
        dcp.load(self.states, checkpoint_id=str(path))
        step = self.states["train"].step
        self.last_saved = step
        logger.info(f"resumed from {path} at step {step}")
        return step

    def save_if_due(self, step: int, last: bool = False) -> None:
        """Save `step` if it is a `checkpoint.every` step, or the `last` of the run (unless saved already), or if
        SIGTERM reached any rank; then `preempted` says the run must stop. Also publishes a background write that has
        finished since the last call."""
        if self._pending is not None and self._pending[0].done():
            self._finish_pending()
        self.preempted = self._preemption.agreed()  # one tiny CPU all-reduce per step; see PreemptionFlag
        every = self.cfg.every
        due = self.preempted or (bool(every) and (step % every == 0 or last))
        if due and self.last_saved != step:
            if self.preempted:  # every rank saves this step, then the run exits 0; a restart resumes here
                logger.info(f"SIGTERM: saving step {step} and stopping")
            self.save(step)

    def save(self, step: int) -> None:
        self.last_saved = step
        path = self.dir / f"step_{step:08d}"
        if self._pending is not None:  # one write in flight at a time
            self._finish_pending()
        start = time.perf_counter()
        try:
            if self.cfg.async_save:
                future = dcp.async_save(self.states, checkpoint_id=str(path), process_group=self._async_group)
                self._pending = (future, path, start, time.perf_counter() - start)
                return
            dcp.save(self.states, checkpoint_id=str(path))
        except (OSError, CheckpointException) as e:
            self._abandon(path, e)
        # dcp.save returns on the coordinator (rank 0) only after gathering every rank's write results and writing
        # .metadata, so the directory is complete here and `latest` may point at it.
        blocked = time.perf_counter() - start
        self._published(path, blocked, blocked)

    def _finish_pending(self) -> None:
        future, path, start, blocked = self._pending
        self._pending = None
        try:
            future.result()  # re-raises a failed background write
        except (OSError, CheckpointException) as e:
            self._abandon(path, e)
        self._published(path, time.perf_counter() - start, blocked)

    def _abandon(self, path: Path, error: BaseException) -> None:
        """A save failed (disk full, quota, permissions) on some rank, and DCP raised it on every rank: remove the
        partial directory and fail with the cause; `latest` was never moved, so it names the previous checkpoint."""
        if isinstance(error, CheckpointException) and error.failures:
            rank, (cause, _) = next(iter(error.failures.items()))
            error = f"rank {rank}: {type(cause).__name__}: {cause}"
        if self.is_main:
            shutil.rmtree(path, ignore_errors=True)
        latest = self.dir / "latest"
        kept = f"{latest} still names {latest.read_text().strip()}" if latest.is_file() else "no checkpoint was saved"
        raise CheckpointError(f"saving checkpoint {path} failed ({error}); {kept}")

    def _published(self, path: Path, total_s: float, blocked_s: float) -> None:
        if self.is_main:
            if not is_complete(path):
                raise CheckpointError(f"{path} was written without .metadata; `latest` still names the previous step")
            for name, content in self.attachments.items():
                (path / name).write_bytes(content)
            publish_latest(self.dir, path.name)
            self._prune()
            logger.info(f"saved checkpoint {path} ({total_s:.2f} s, training blocked {blocked_s:.2f} s)")

    def _prune(self) -> None:
        if not self.cfg.keep_last:
            return
        latest = (self.dir / "latest").read_text().strip()
        published = sorted(p.name for p in self.dir.iterdir() if _STEP_DIR.match(p.name) and p.name <= latest)
        for name in published[: -self.cfg.keep_last]:
            shutil.rmtree(self.dir / name, ignore_errors=True)

    def close(self, publish: bool = True) -> None:
        """Wait for a background write and publish it (unless `publish` is False, after a failure that may have
        broken its collectives), and give SIGTERM back."""
        if self._pending is not None and publish:
            self._finish_pending()
        self._pending = None
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
