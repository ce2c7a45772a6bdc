"""The Checkpointer: when a run saves, what it restores, and the training states it saves."""

from __future__ import annotations

import logging
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_trainer.adapters.lora import apply_lora, is_adapter
from fsdp_trainer.adapters.nf4 import fill_shard, is_nf4, quantized_weights
from fsdp_trainer.checkpoint.starts import LORA_BASE_FILE, REFERENCE_FILE, lora_base, preference_reference, start_record
from fsdp_trainer.checkpoint.storage import (
    RECIPE_FILE,
    STEP_DIR,
    CheckpointError,
    ChecksummedWriter,
    checkpoint_recipe,
    first_failure,
    is_complete,
    load_state,
    resolve_checkpoint,
    saved_entries,
)
from fsdp_trainer.checkpoint.verify import accepted, verify_checkpoint
from fsdp_trainer.checkpoint.weights import check_model_shapes, iter_model_weights
from fsdp_trainer.config import AUTO, Recipe, load_sections, recipe_to_yaml
from fsdp_trainer.distributed.runtime import DistEnv, PreemptionFlag
from fsdp_trainer.files import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    published_step,
    write_failure,
)
from fsdp_trainer.model import Transformer
from fsdp_trainer.optim import MASTER_WEIGHT_BYTES, optimizer_state_bytes
from fsdp_trainer.tokenizer import HF_GENERATION_CONFIG, tokenizer_files

logger = logging.getLogger("fsdp_trainer")


class ModelState(Stateful):
    """The model's (sharded) weights under their HF names, whatever wrappers the model carries; with `adapters_only`
    (a LoRA run), its adapters alone: the frozen weights are the base's, recorded in LORA_BASE_FILE, not saved again."""

    def __init__(self, model: nn.Module, adapters_only: bool = False):
        self.model, self.adapters_only = model, adapters_only

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        if self.adapters_only:
            return {name: t for name, t in state.items() if is_adapter(name)}
        # NF4 weights (QLoRA) are never saved and not loaded by DCP: Checkpointer._load_base quantizes them
        return {name: t for name, t in state.items() if not is_nf4(t)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict = not self.adapters_only and not any(is_nf4(p) for p in self.model.parameters())
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=strict))


class OptimState(Stateful):
    """The optimizer's state (AdamW's moments and step counts, Muon's momentum), keyed by parameter name so it
    reshards to another world size."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def check_disk_room(recipe: Recipe) -> None:
    """Fail before any collective, naming the directory, if its disk lacks room for one checkpoint of the recipe's
    model: fp32 weights and the optimizer's state, as the planner counts it (gradients are not saved)."""
    out_dir = recipe.train.out_dir
    with torch.device("meta"):
        model = Transformer(recipe.model)
        if recipe.lora.rank is not None:  # its checkpoints hold the adapters and their state only
            apply_lora(model, recipe.lora)
    saved = sum(p.numel() for p in model.parameters() if p.requires_grad)
    need = MASTER_WEIGHT_BYTES * saved + optimizer_state_bytes(recipe.optim, model)
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise ValueError(
            f"train.out_dir={out_dir} has {free / 1e9:.1f} GB free, and one checkpoint of this model takes "
            f"{need / 1e9:.1f} GB; free space or choose another directory"
        )


class Checkpointer:
    """Saves and restores a dict of Stateful objects under `train.out_dir/checkpoints`, when due.

    Each checkpoint carries the recipe and the tokenizer of the run, so tools/consolidate.py can turn it into an HF
    model on its own. With `async_save`, save() returns once the state is copied off the training tensors, and the
    files are written by a background thread; `latest` moves to that step once the write has finished (checked
    without blocking at each later step, and waited for by the next save and by close()).
    """

    def __init__(self, recipe: Recipe, env: DistEnv, states: dict[str, Stateful], reference: nn.Module | None = None):
        self.cfg = recipe.checkpoint
        self.preference = recipe.preference.loss is not None
        self.reference = reference  # a full fine-tuning preference run's frozen reference model
        self.dir = Path(recipe.train.out_dir) / CHECKPOINTS_DIR
        self.states = states
        self.is_main = env.is_main
        self.local_main = env.local_rank == 0  # says what every rank of its node found
        self.precision = recipe.parallel.mixed_precision  # resolved: what this run computes in
        self.attachments = {
            RECIPE_FILE: recipe_to_yaml(recipe).encode(),
            **{name: path.read_bytes() for name, path in tokenizer_files(recipe.data.tokenizer_path).items()},
        }
        self.adapters_only = getattr(states.get("model"), "adapters_only", False)
        if self.adapters_only:  # until load() says otherwise: the adapters apply to the recipe's seeded init
            self.attachments[LORA_BASE_FILE] = start_record(None)
        if reference is not None:  # likewise the reference holds the seeded init until load() loads other weights
            self.attachments[REFERENCE_FILE] = start_record(None)
        self.last_saved: int | None = None
        self.resumed_from: Path | None = None  # the step directory load() resumed from; its attachments are read back
        self.preempted = False
        # The checkpointer's own CPU round trips (the preemption flag each step, what verification found), on a gloo
        # group apart from training's collectives.
        self._control = dist.new_group(backend="gloo", timeout=env.timeout)
        self._preemption: PreemptionFlag | None = PreemptionFlag(self._control)
        self._pending: tuple[Future, Path, float, float] | None = None  # future, path, start time, blocked seconds
        # The background write runs its own collectives; on the default group they would interleave with training's
        # and deadlock (gloo hangs until its timeout), so it gets a group of its own.
        self._async_group = dist.new_group(backend="gloo", timeout=env.timeout) if self.cfg.async_save else None
        # A step saved again (after a resume fell back past a corrupted copy of it) replaces that copy, as it should.
        warnings.filterwarnings("ignore", "Detected an existing checkpoint")

    def load(self) -> int | None:
        """Restore according to `checkpoint.resume`; returns the step resumed from, or None for a fresh start."""
        resume = self.cfg.resume
        has_own = published_step(self.dir) is not None
        if resume == "none" or (resume == "auto" and not has_own):
            return None
        path = self._newest_verified() if resume == "auto" else self._verified(resolve_checkpoint(resume))
        self._carry_generation_config(path)
        started_from = None  # the weights-only checkpoint named again, when the run goes on from its own
        if saved_entries(path) == {"model"} or self._starts_preference(path):  # where this run starts: weights only
            if not has_own:  # fresh optimizer, data stream and step; LoRA adapters as initialised, on this base
                self._load_base(path)
                if self.reference is not None:
                    self._load_reference(path)
                logger.info(f"loaded weights from {path}; starting at step 0")
                return None
            # The same command again after a preemption or a torchrun restart: the run goes on from its own latest
            # instead of starting over from the weights (and losing every step since).
            logger.info(f"{path} holds the weights this run started from; continuing the run from its own checkpoints")
            started_from, path = path, self._newest_verified()
        if self.adapters_only:  # the frozen weights come from the base the adapters were trained on
            base = lora_base(path)
            if started_from is not None and base != started_from.resolve():
                raise CheckpointError(
                    f"this run's adapters were trained on {base}, not on {started_from}; resume with "
                    f"--checkpoint.resume {base}, or start a new run in another train.out_dir"
                )
            if base is not None:
                self._load_base(base)
            self.attachments[LORA_BASE_FILE] = (path / LORA_BASE_FILE).read_bytes()
        if self.reference is not None:  # the reference holds the weights the run started from, not its latest
            reference = preference_reference(path)
            if reference is not None:
                self._load_reference(reference)
            self.attachments[REFERENCE_FILE] = (path / REFERENCE_FILE).read_bytes()
        check_model_shapes(path, self.states["model"].state_dict())
        self._check_precision(path)
        saved = saved_entries(path)
        missing = set(self.states) - saved
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {sorted(missing)}: it was not written by this trainer")
        load_state(self.states, path)
        step = self.states["train"].step
        self.last_saved, self.resumed_from = step, path
        logger.info(f"resumed from {path} at step {step}")
        return step

    def _load_base(self, path: Path) -> None:
        """The weights of a weights-only checkpoint into the model; a LoRA run's adapters keep their values, and its
        later checkpoints record which base they apply to."""
        model = ModelState(self.states["model"].model)  # every weight, whatever the run saves
        quantized = quantized_weights(model.model)
        check_model_shapes(path, {**model.state_dict(), **quantized}, adapters_optional=True)
        load_state({"model": model}, path, partial=True)
        # QLoRA's NF4 weights: each read whole and quantized whole on every rank, which keeps its rows (adapters/nf4.py)
        for name, values in iter_model_weights(path, {name: p.shape for name, p in quantized.items()}):
            fill_shard(quantized[name], values)
        if self.adapters_only:
            self.attachments[LORA_BASE_FILE] = start_record(path)

    def _starts_preference(self, path: Path) -> bool:
        """A preference run named a checkpoint of another kind of run (an SFT run, a pretraining run): it starts from
        that checkpoint's weights, with its own optimizer, data and step."""
        if not self.preference:
            return False
        try:
            return load_sections(checkpoint_recipe(path))["preference"].loss is None
        except (FileNotFoundError, ValueError, KeyError):
            return True  # no recipe, or one from before preference tuning existed: not a preference run's

    def _load_reference(self, path: Path) -> None:
        """The weights of a checkpoint into the frozen reference model, recorded for the run's checkpoints."""
        reference = ModelState(self.reference)
        check_model_shapes(path, reference.state_dict(), adapters_optional=True)
        load_state({"model": reference}, path, partial=True)
        self.attachments[REFERENCE_FILE] = start_record(path)

    def _carry_generation_config(self, path: Path) -> None:
        """An imported model's generation_config.json goes on with every checkpoint of the runs that start from it,
        so that consolidate.py exports it again."""
        if (path / HF_GENERATION_CONFIG).is_file():
            self.attachments[HF_GENERATION_CONFIG] = (path / HF_GENERATION_CONFIG).read_bytes()

    def _check_precision(self, path: Path) -> None:
        """A resume in another precision than the checkpoint was trained in (auto resolved otherwise on this hardware,
        or an override) goes on from the same state, but not as the original run would have: one warning says so.
        Into fp16 from another precision it cannot: fp16's loss scale is part of the training state."""
        try:
            saved = load_sections(checkpoint_recipe(path))["parallel"].mixed_precision
        except (FileNotFoundError, ValueError):
            return  # a checkpoint without a readable recipe: nothing recorded to compare with
        if saved in (AUTO, self.precision):
            return
        if self.precision == "fp16":
            raise CheckpointError(
                f"checkpoint {path} was trained in {saved} and holds no fp16 loss scale to resume with; set "
                f"parallel.mixed_precision {saved}"
            )
        if self.is_main:
            logger.warning(
                f"checkpoint {path} was trained in {saved}, and this run computes in {self.precision}: it goes on from "
                f"the same state, not bitwise as the original run would have; set parallel.mixed_precision {saved} to "
                "keep it (if this hardware runs it natively)"
            )

    def _problems(self, path: Path) -> list[str] | None:
        """verify_checkpoint with the files split over the ranks (each reads 1/N of the bytes), and the problems every
        rank found gathered on all, so that every rank takes the same decision."""
        share = verify_checkpoint(path, dist.get_rank(), dist.get_world_size())
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, share, group=self._control)  # gloo: CPU objects, no device involved
        return None if found[0] is None else sorted(problem for share in found for problem in share)

    def _verified(self, path: Path) -> Path:
        return accepted(path, self._problems(path), warn=self.is_main)

    def _newest_verified(self) -> Path:
        """The step `latest` names if it verifies; else, with one warning naming what failed, the newest older
        published step that does (keep_last kept it); CheckpointError if none does."""
        latest = published_step(self.dir).name
        older = [p.name for p in self.dir.iterdir() if STEP_DIR.match(p.name) and p.name < latest]
        failed = []
        for name in [latest, *sorted(older, reverse=True)]:
            path = self.dir / name
            problems = self._problems(path) if is_complete(path) else [f"{path} is missing or has no .metadata"]
            if not problems:  # [] verified, or None: saved before checksums existed
                if failed and self.is_main:
                    logger.warning(f"{failed[0]}; resuming from {name}, the newest checkpoint that verifies")
                return accepted(path, problems, warn=self.is_main)
            failed.append(f"checkpoint {name} is corrupted: {problems[0]}")
        raise CheckpointError(
            f"no checkpoint under {self.dir} verifies ({'; '.join(failed)}); copy good ones back, or start over with "
            "--checkpoint.resume none"
        )

    def save_if_due(self, step: int, last: bool = False) -> None:
        """Save `step` if it is a `checkpoint.every` step, or the `last` of the run (unless saved already), or if
        SIGTERM reached any rank; then `preempted` says the run must stop. Also settles a background write that every
        rank has finished since the last call."""
        writing = self._pending is not None and not self._pending[0].done()
        # One tiny CPU all-reduce per step (see PreemptionFlag): SIGTERM on any rank, a background write still going on
        # any rank. Settled once no rank writes, so that every rank sees a failed write at the same step.
        self.preempted, writing = self._preemption.agreed(writing)
        if self._pending is not None and not writing:
            self._finish_pending(final=False)
        every = self.cfg.every
        due = self.preempted or (bool(every) and (step % every == 0 or last))
        if due and self.last_saved != step:
            if self.preempted:  # every rank saves this step, then the run exits 0; a restart resumes here
                logger.info(f"SIGTERM: saving step {step} and stopping")
            self.save(step, final=last or self.preempted)

    def save(self, step: int, final: bool) -> None:
        """Save `step` (in the background with async_save; `latest` moves once it is complete). A `final` save (the
        run's last, or on SIGTERM) that fails stops the run whatever checkpoint.on_save_error says."""
        self.last_saved = step
        path = self.dir / f"step_{step:08d}"
        if self._pending is not None:  # one write in flight at a time
            self._finish_pending(final=False)
        start = time.perf_counter()
        try:
            writer = ChecksummedWriter(path, self.attachments)
            if self.cfg.async_save:
                future = dcp.async_save(self.states, storage_writer=writer, process_group=self._async_group)
                self._pending = (future, path, start, time.perf_counter() - start)
                return
            dcp.save(self.states, storage_writer=writer)
        except (OSError, CheckpointException) as e:
            self._failed(path, e, final)
            return
        # dcp.save returns only after the coordinator wrote .metadata, the checksums and `latest`, on every rank.
        blocked = time.perf_counter() - start
        self._published(path, blocked, blocked)

    def _finish_pending(self, final: bool) -> None:
        future, path, start, blocked = self._pending
        self._pending = None
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
            self._prune()
            logger.info(f"saved checkpoint {path} ({total_s:.2f} s, training blocked {blocked_s:.2f} s)")

    def _prune(self) -> None:
        if not self.cfg.keep_last:
            return
        latest = published_step(self.dir).name
        published = sorted(p.name for p in self.dir.iterdir() if STEP_DIR.match(p.name) and p.name <= latest)
        for name in published[: -self.cfg.keep_last]:
            shutil.rmtree(self.dir / name, ignore_errors=True)

    def close(self, wait: bool = True) -> None:
        """Wait for a background write and settle it (unless not `wait`: after a failure that may have broken its
        collectives), and give SIGTERM back."""
        try:
            if self._pending is not None and wait:
                self._finish_pending(final=True)
        finally:
            self._pending = None
            if self._preemption is not None:
                self._preemption.close()
                self._preemption = None
                dist.destroy_process_group(self._control)  # now, not at interpreter exit (see close_distributed)
                self._control = None
