"""Where a run's records go, on rank 0: a log line, metrics.jsonl, TensorBoard, Weights & Biases, a progress bar.

A sink is a class with write(record) and close(); Metrics (metrics.py) makes the records and hands each to every sink.
A new sink is a class here, added in Metrics.__init__.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_trainer.config import Recipe
from fsdp_trainer.files import METRICS_FILE, TENSORBOARD_DIR, write_atomic

logger = logging.getLogger("fsdp_trainer")


STATE_KEYS = ("params_gb", "grads_gb", "optimizer_gb")
"""The training state each rank holds, logged once, with their sum as `state_gb`."""


class LogLine:
    """A line on stdout per record, through the `fsdp_trainer` logger; `shown` ({metric: label}) are the training
    kind's metrics the line carries beside the loss (a preference run's reward accuracy and margin), on training and
    validation lines alike."""

    def __init__(self, shown: dict[str, str] | None = None):
        self.shown = shown or {}

    def _shown(self, record: dict, prefix: str = "") -> str:
        return "".join(
            f" | {prefix}{label} {record[prefix + name]:.3f}"
            for name, label in self.shown.items()
            if prefix + name in record
        )

    def write(self, record: dict) -> None:
        if "loss" in record:
            mfu = f" | mfu {100 * record['mfu']:.1f}%" if record["mfu"] is not None else ""
            logger.info(
                f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad_norm "
                f"{record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s{mfu} | "
                f"mem {record['peak_mem_gb']:.2f} GB"
                + (f" | scale {record['loss_scale']:g}" if "loss_scale" in record else "")
                + self._shown(record)
            )
        elif any(key.startswith("val_") for key in record):  # online RL's evaluation scores rewards, not a loss
            loss = f" | val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
            logger.info(f"step {record['step']:>6}{loss}" + self._shown(record, "val_"))
        elif any(key.startswith("eval/") for key in record):
            logger.info(f"step {record['step']:>6} | " + " | ".join(score_lines(record)))
        elif "state_gb" in record:
            parts = ", ".join(f"{k.removesuffix('_gb')} {record[k]:.3f}" for k in STATE_KEYS)
            logger.info(f"training state per rank: {record['state_gb']:.3f} GB ({parts})")

    def close(self) -> None:
        pass


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a disk (or quota) with no room left: the sinks that write files hold or skip records, not stop."""


class JsonlFile:
    """OUT_DIR/metrics.jsonl, a JSON object per line. On resume, the records the interrupted attempt wrote after the
    checkpoint are dropped first, so each step appears once. A full disk does not stop the run: what it refuses is
    held in memory (a warning says so, once) and written, in order, as soon as there is room."""

    def __init__(self, path: str, start_step: int):
        if start_step and os.path.exists(path):
            with open(path) as f:
                # A line cut short by a kill has no newline and no value.
                kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= start_step]
            write_atomic(path, "".join(kept))
        self.path, self.held, self.warned = path, b"", False
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if start_step else os.O_TRUNC), 0o644)

    def write(self, record: dict) -> None:
        # NaN and inf are not JSON; null keeps the file readable by strict parsers (jq, JavaScript).
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.held += (json.dumps(record) + "\n").encode()
        self._write_held()

    def _write_held(self) -> bool:
        """Write what is held; False (and a warning the first time) when the disk is full."""
        try:
            while self.held:
                self.held = self.held[os.write(self.fd, self.held) :]
        except OSError as e:
            if e.errno not in FULL_DISK:
                raise
            if not self.warned:
                logger.warning(f"{self.path}: {e.strerror}; its records are held in memory until there is room")
                self.warned = True
            return False
        self.warned = False
        return True

    def close(self) -> None:
        if not self._write_held():
            logger.warning(f"{self.path}: {len(self.held):,} bytes of records were lost: the disk stayed full")
        os.close(self.fd)


# TensorBoard groups scalars by the part before the slash.
TENSORBOARD_TAGS = {
    "loss": "loss/train",
    "val_loss": "loss/val",
    "tokens_per_s": "speed/tokens_per_s",
    "tokens_per_s_per_device": "speed/tokens_per_s_per_device",
    "mfu": "speed/mfu",
    "step_time_s": "speed/step_time_s",
    "step_time_max_s": "speed/step_time_max_s",
    "peak_mem_gb": "memory/peak_gb",
    "peak_host_mem_gb": "memory/peak_host_gb",
    "params_gb": "memory/params_gb",
    "grads_gb": "memory/grads_gb",
    "optimizer_gb": "memory/optimizer_gb",
    "state_gb": "memory/state_gb",
}


def _tag(key: str) -> str:
    """train/KEY; a kind's evaluated metrics (val_rewards/chosen, val_nll_loss) as eval/rewards/chosen, eval/nll_loss,
    the names TRL's trainers log them under; benchmark scores (eval/TASK/METRIC) as they are."""
    if key.startswith("eval/"):
        return key
    return f"eval/{key.removeprefix('val_')}" if key.startswith("val_") else f"train/{key}"


def scores_by_task(record: dict) -> dict[str, str]:
    """A record's benchmark scores (eval/TASK/METRIC[,FILTER]), as {TASK: `METRIC value (+-stderr), ...`}."""
    tasks: dict[str, list[str]] = {}
    for key, value in record.items():
        if not key.startswith("eval/") or "_stderr" in key or value is None:
            continue
        _, task, metric = key.split("/", 2)
        name, comma, kept = metric.partition(",")
        error = record.get(f"eval/{task}/{name}_stderr{comma}{kept}")
        spread = f" (+-{error:.3f})" if error is not None and math.isfinite(error) else ""
        tasks.setdefault(task, []).append(f"{metric} {value:.4f}{spread}")
    return {task: ", ".join(shown) for task, shown in tasks.items()}


def score_lines(record: dict) -> list[str]:
    """A record's benchmark scores, a `TASK METRIC value (+-stderr), ...` per task, for the log line."""
    return [f"{task} {shown}" for task, shown in scores_by_task(record).items()]


def scalars(record: dict) -> dict[str, float]:
    """A record's finite numbers under their TensorBoard / W&B names, the mixture's per-source counts included."""
    out = {
        TENSORBOARD_TAGS.get(key, _tag(key)): value
        for key, value in record.items()
        if key not in ("step", "elapsed_s", "cpu_s") and isinstance(value, (int, float)) and math.isfinite(value)
    }
    for source, drawn in record.get("mixture", {}).items():
        out.update({f"data/{source}/{key}": value for key, value in drawn.items()})
    return out


class TensorBoard:
    """OUT_DIR/tensorboard/: the records' numbers as scalars. Made by `open` only when the optional `tensorboard`
    package is installed (metrics.jsonl has it all anyway). A full disk does not stop the run: its writer, which
    writes from a thread of its own and fails for good once a write fails, is dropped (a warning says so, once) and a
    new one, in a new events file, takes the records as soon as one can be made; what the old one had queued is
    TensorBoard's loss, not metrics.jsonl's."""

    @classmethod
    def open(cls, log_dir: str, start_step: int) -> TensorBoard | None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        _quiet_writer_threads_on_a_full_disk()
        # purge_step drops events a previous attempt wrote past the step this run resumes from.
        return cls(SummaryWriter(log_dir, purge_step=start_step or None), lambda: SummaryWriter(log_dir), log_dir)

    def __init__(self, writer, reopen: Callable[[], Any], log_dir: str):
        self.writer, self.reopen, self.log_dir, self.warned = writer, reopen, log_dir, False

    def write(self, record: dict) -> None:
        try:
            if self.writer is None:
                self.writer = self.reopen()
            for tag, value in scalars(record).items():
                self.writer.add_scalar(tag, value, record["step"])
        except OSError as e:
            self._drop(e)
            return
        self.warned = False

    def _drop(self, error: OSError) -> None:
        if error.errno not in FULL_DISK:
            raise error
        if not self.warned:
            logger.warning(f"{self.log_dir}: {error.strerror}; TensorBoard gets no records until there is room "
                           "(metrics.jsonl keeps them all)")  # fmt: skip
            self.warned = True
        writer, self.writer = self.writer, None
        try:
            if writer is not None:
                writer.close()
        except OSError:
            pass  # the failed writer's queue: gone with it

    def close(self) -> None:
        writer, self.writer = self.writer, None  # closed once, whatever its close raises
        try:
            if writer is not None:
                writer.close()
        except OSError as e:
            self._drop(e)


def _quiet_writer_threads_on_a_full_disk() -> None:
    """TensorBoard's writer thread keeps a failed write for the writer's next call (which `TensorBoard._drop` turns
    into one warning) and raises it again as it ends, which threading's hook would print as a traceback beside that
    line. Those, on a full disk, are left unprinted; any other thread's exception is printed as before. Once a
    process."""
    previous = threading.excepthook
    if getattr(previous, "quiet_on_a_full_disk", False):
        return

    def hook(args) -> None:
        error, thread = args.exc_value, type(args.thread)
        if not (
            isinstance(error, OSError) and error.errno in FULL_DISK and thread.__module__.startswith("tensorboard")
        ):
            previous(args)

    hook.quiet_on_a_full_disk = True
    threading.excepthook = hook


WANDB_RUN_FILE = "wandb_run.json"
"""Saved with every checkpoint (an attachment of its step directory): the W&B run id a resumed run continues."""


def uses_wandb(recipe: Recipe) -> bool:
    return recipe.wandb.project is not None and recipe.wandb.mode != "disabled"


def require_wandb(recipe: Recipe) -> None:
    """Before any process group: naming a W&B project without the package installed is one line, not a traceback
    after the first step."""
    if not uses_wandb(recipe):
        return
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"wandb.project={recipe.wandb.project} needs the wandb package ({e}): pip install wandb, or pip install "
            "-e '.[wandb]'; or drop wandb.project"
        ) from None


class WandbRun:
    """Weights & Biases, on rank 0: the scalars TensorBoard gets, under the same names, and the resolved recipe as the
    run's config. The run id is saved with every checkpoint (WANDB_RUN_FILE), so a run resumed from one (after
    SIGTERM, a torchrun restart, a requeued Slurm job) continues the same W&B run. W&B keeps a run's steps increasing
    and drops what is logged at a step it already has, so the steps an interrupted attempt logged after its checkpoint
    keep their first values and appear once; with an exact resume they are the same numbers (speed aside)."""

    def __init__(self, recipe: Recipe, resumed_from: str | os.PathLike | None, start_step: int = 0):
        import wandb

        cfg, out_dir = recipe.wandb, recipe.train.out_dir
        saved = os.path.join(resumed_from, WANDB_RUN_FILE) if resumed_from is not None else None
        previous = json.loads(Path(saved).read_text())["id"] if saved and os.path.isfile(saved) else None
        self.run_id = previous or uuid.uuid4().hex[:12]  # W&B ids are lowercase letters and digits
        os.makedirs(out_dir, exist_ok=True)
        if previous and cfg.rewind:  # the same run, its history cut back to the checkpoint's step
            continuing = {"resume_from": f"{previous}?_step={start_step}"}
        else:
            continuing = {"id": self.run_id, "resume": "allow" if previous else None}
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or os.path.basename(os.path.abspath(out_dir)),
            mode=cfg.mode,
            tags=list(cfg.tags),
            dir=out_dir,
            config=dataclasses.asdict(recipe),
            **continuing,
        )

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class ProgressBar:
    """On a terminal, a tqdm bar with ETA, moved every step; log lines print above it, never through it."""

    def __init__(self, total_steps: int, start_step: int):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        # Log lines go through tqdm.write while the bar is up, so the two never interleave mid-line.
        self._redirect = logging_redirect_tqdm()  # the root logger, where setup_logging put the handler
        self._redirect.__enter__()
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stdout)

    def update(self, step: int) -> None:
        self.bar.update(step - self.bar.n)

    def steady(self, step: int) -> None:
        """Rate and ETA from `step` on: a first step that compiles or warms up would have them say hours for minutes."""
        self.bar.reset(total=self.bar.total)
        self.bar.initial = self.bar.n = self.bar.last_print_n = step

    def write(self, record: dict) -> None:
        if "loss" in record:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)

    def close(self) -> None:
        self.bar.close()
        self._redirect.__exit__(None, None, None)


class Sinks:
    """Where rank 0's records go: the log line, metrics.jsonl, TensorBoard, W&B (when the recipe names a project)
    and, on a terminal, the progress bar. Other ranks hold none."""

    def __init__(
        self,
        recipe: Recipe,
        is_main: bool,
        start_step: int,
        shown: dict[str, str] | None,
        resumed_from: str | os.PathLike | None,
    ):
        """`shown`: the training kind's metrics the log line carries ({metric: label})."""
        self.sinks, self.bar, self.wandb = [], None, None
        if not is_main:
            return
        out_dir, train = recipe.train.out_dir, recipe.train
        self.bar = ProgressBar(train.steps, start_step) if train.progress_bar and sys.stdout.isatty() else None
        self.wandb = WandbRun(recipe, resumed_from, start_step) if uses_wandb(recipe) else None
        sinks = [
            LogLine(shown),
            JsonlFile(os.path.join(out_dir, METRICS_FILE), start_step),
            TensorBoard.open(os.path.join(out_dir, TENSORBOARD_DIR), start_step),
            self.wandb,
            self.bar,
        ]
        self.sinks = [sink for sink in sinks if sink is not None]

    def steady(self, step: int) -> None:
        """The first step is done: the progress bar's rate and ETA count from here."""
        if self.bar is not None:
            self.bar.steady(step)

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def attachments(self) -> dict[str, bytes]:
        """Files for the checkpointer to save with every checkpoint: the W&B run id, when there is a W&B run."""
        return {WANDB_RUN_FILE: json.dumps({"id": self.wandb.run_id}).encode()} if self.wandb is not None else {}

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
