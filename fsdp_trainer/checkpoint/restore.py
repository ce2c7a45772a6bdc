"""Where a run starts, as `checkpoint.resume` says: from nothing (the recipe's seeded init), from its own newest
checkpoint that verifies, or from a checkpoint it names. A named checkpoint of the run's own kind (the same training
kind, with or without adapters alike, and, from another run's directory, the same training data) is resumed whole:
weights, optimizer, data position, step. Any other checkpoint of this trainer (a pretraining, SFT, DPO or LoRA run's,
an import) gives its weights only, a LoRA checkpoint's adapters merged into its base, and the run starts at step 0
with its own optimizer and data.

Either way, the models that hold the weights the run started from (its Starts: a LoRA base, a reference) are filled
and recorded, and a resume fills them again from where they were recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_trainer.adapters.nf4 import fill_shard, quantized_weights
from fsdp_trainer.checkpoint.holds import hold
from fsdp_trainer.checkpoint.starts import Start, is_adapters_only, recorded_start, start_record
from fsdp_trainer.checkpoint.storage import (
    CheckpointError,
    checkpoint_recipe,
    load_state,
    resolve_checkpoint,
    saved_entries,
)
from fsdp_trainer.checkpoint.verify import SharedVerification
from fsdp_trainer.checkpoint.weights import (
    ModelState,
    check_model_shapes,
    check_shapes,
    iter_model_weights,
    read_saved_model,
    weight_stream,
)
from fsdp_trainer.config import AUTO, load_sections
from fsdp_trainer.files import published_step
from fsdp_trainer.model import unwrapped_name
from fsdp_trainer.tokenizer import HF_GENERATION_CONFIG

logger = logging.getLogger("fsdp_trainer")


def load_weights(path: Path, model: nn.Module) -> None:
    """Every weight a checkpoint's model computes with, into `model` (sharded or not), whatever kind of run saved it:
    its own weights, or a LoRA checkpoint's base with its adapters merged. The model's own adapters keep their values;
    its NF4 weights (QLoRA) are each read whole and quantized whole on every rank, which keeps its rows."""
    if is_adapters_only(path):  # the frozen weights are its base's: merged one tensor at a time as they pass
        params = {unwrapped_name(name): param for name, param in model.named_parameters()}
        shapes, tensors = weight_stream(read_saved_model(path))
        check_shapes(path, {name: tuple(shape) for name, shape in shapes.items()}, params, adapters_optional=True)
        for name, values in tensors:
            if name in params:  # a tied output layer is the embedding
                fill_shard(params[name], values.to(params[name].dtype))
        return
    weights = ModelState(model)
    quantized = quantized_weights(model)
    check_model_shapes(path, {**weights.state_dict(), **quantized}, adapters_optional=True)
    load_state({"model": weights}, path, partial=True)
    for name, values in iter_model_weights(path, {name: p.shape for name, p in quantized.items()}):
        fill_shard(quantized[name], values)


def carry_generation_config(path: Path, attachments: dict[str, bytes]) -> None:
    """An imported model's generation_config.json goes on with every checkpoint of the runs that start from it, so
    that consolidate.py exports it again."""
    if (path / HF_GENERATION_CONFIG).is_file():
        attachments[HF_GENERATION_CONFIG] = (path / HF_GENERATION_CONFIG).read_bytes()


def check_precision(path: Path, precision: str, is_main: bool) -> None:
    """A resume in another precision than the checkpoint was trained in (auto resolved otherwise on this hardware,
    or an override) goes on from the same state, but not as the original run would have: one warning says so.
    Into fp16 from another precision it cannot: fp16's loss scale is part of the training state."""
    try:
        saved = load_sections(checkpoint_recipe(path))["parallel"].mixed_precision
    except (FileNotFoundError, ValueError):
        return  # a checkpoint without a readable recipe: nothing recorded to compare with
    if saved in (AUTO, precision):
        return
    if precision == "fp16":
        raise CheckpointError(
            f"checkpoint {path} was trained in {saved} and holds no fp16 loss scale to resume with; set "
            f"parallel.mixed_precision {saved}"
        )
    if is_main:
        logger.warning(
            f"checkpoint {path} was trained in {saved}, and this run computes in {precision}: it goes on from "
            f"the same state, not bitwise as the original run would have; set parallel.mixed_precision {saved} to "
            "keep it (if this hardware runs it natively)"
        )


def reload_starts(
    path: Path,
    starts: list[Start],
    attachments: dict[str, bytes],
    started_from: Path | None,
    hold: Callable[[Path, list[str]], None],
) -> None:
    """Resuming from `path`: every Start takes the weights its record there names (the weights the run started from,
    not its latest), checked against the checkpoint the command names (`started_from`), and held; the record goes on."""
    for start in starts:
        recorded = recorded_start(path, start.record, start.what)
        if start.source is not None and recorded != start.source.resolve():
            raise CheckpointError(
                f"this run's {start.what} {recorded}, not {start.source}; name that one again, or start a new run in "
                "another train.out_dir"
            )
        if started_from is not None and start.source is None and recorded != started_from.resolve():
            raise CheckpointError(
                f"this run's {start.what} {recorded}, not {started_from}; resume with --checkpoint.resume "
                f"{recorded}, or start a new run in another train.out_dir"
            )
        if recorded is not None:
            hold(recorded, [start.use])
            load_weights(recorded, start.model)
        attachments[start.record] = (path / start.record).read_bytes()


def load_whole(path: Path, states: dict[str, Stateful], precision: str, is_main: bool) -> None:
    """Every state of a run from its checkpoint `path`, once its model's shapes and precision are checked."""
    check_model_shapes(path, states["model"].state_dict())
    check_precision(path, precision, is_main)
    missing = set(states) - saved_entries(path)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {sorted(missing)}: it was not written by this trainer")
    load_state(states, path)


class Restorer:
    """What Checkpointer.load does, over the run's `states`, `starts` and `attachments` (which it updates with the
    start records); `resumes(path)` says whether a checkpoint is of this run's kind."""

    def __init__(
        self,
        ckpt_dir: Path,
        states: dict[str, Stateful],
        starts: list[Start],
        attachments: dict[str, bytes],
        resumes: Callable[[Path], bool],
        group: dist.ProcessGroup,
        is_main: bool,
        precision: str,
    ):
        self.dir, self.states, self.starts, self.attachments = ckpt_dir, states, starts, attachments
        self.resumes, self.is_main, self.precision = resumes, is_main, precision
        self.verification = SharedVerification(ckpt_dir, group, is_main)
        self.hold = partial(hold, ckpt_dir.parent) if is_main else lambda path, uses: None  # the first rank records

    def load(self, resume: str) -> Path | None:
        """Restore the run as `resume` (auto | none | PATH) says; returns the step directory whose whole state it
        loaded, or None for a run that starts at step 0."""
        has_own = published_step(self.dir) is not None
        if resume == "none" or (resume == "auto" and not has_own):
            self.fill_own_sources()
            return None
        verify = self.verification
        if resume == "auto":
            path = verify.newest_verified()
        else:
            path = verify.verified(resolve_checkpoint(resume, "checkpoint.resume"))
        carry_generation_config(path, self.attachments)
        started_from = None  # a checkpoint of another kind named again, when the run goes on from its own
        if not self.resumes(path):
            if resume == "auto":
                raise CheckpointError(
                    f"{self.dir} holds the checkpoints of a run of another kind than this recipe trains; choose "
                    "another train.out_dir, or set --checkpoint.resume to start from their weights in a new one"
                )
            if not has_own:
                self.start_from(path)
                return None
            # The same command again after a preemption or a torchrun restart: the run goes on from its own latest
            # instead of starting over from the weights (and losing every step since).
            logger.info(f"{path} holds the weights this run started from; continuing the run from its own checkpoints")
            started_from, path = path, self.verification.newest_verified()
        else:  # a run's own steps are not held
            self.hold(path, ["resume"])
        reload_starts(path, self.starts, self.attachments, started_from, self.hold)
        load_whole(path, self.states, self.precision, self.is_main)
        return path

    def fill_own_sources(self) -> None:
        """A run from the recipe's seeded init: the Starts with weights of their own (a teacher) take them."""
        for start in self.starts:
            if start.source is not None:
                self.hold(start.source, [start.use])
                load_weights(start.source, start.model)
                self.attachments[start.record] = start_record(start.source)

    def start_from(self, path: Path) -> None:
        """The weights of `path` into the model and every Start, recorded: fresh optimizer, data stream and step."""
        policy = self.states["model"].model
        self.hold(path, [start.use for start in self.starts if start.source is None] or ["start"])
        load_weights(path, policy)
        for start in self.starts:
            source = start.source or path
            if source != path:
                self.hold(source, [start.use])
            if start.model is not policy or source != path:
                load_weights(source, start.model)
            self.attachments[start.record] = start_record(source)
        merged = " (a LoRA checkpoint: its adapters merged into its base)" if is_adapters_only(path) else ""
        logger.info(
            f"loaded weights from {path}{merged}; starting at step 0 with this run's own optimizer and data: it is "
            "no checkpoint of this run to go on with (another kind, other data, an import), so only its weights "
            "carry over"
        )
