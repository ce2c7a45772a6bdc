"""Train a model from a recipe.

    torchrun --standalone --nproc_per_node=N -m fsdp_trainer.train --recipe recipes/debug.yaml [--section.key value]
    python -m fsdp_trainer.train --recipe recipes/debug.yaml          # one process, same code path

main() reads as the data flow: recipe -> process group -> model on meta -> parallelize -> materialize -> optimizer,
data, checkpoint -> loop. train_step() is one optimizer step with gradient accumulation.
"""

from __future__ import annotations

import gc

# Importing torch and the package makes about a million objects and no garbage: no collection walks them meanwhile
# (0.3 s of a worker's start). Dynamo too, which building the model on the meta device would import (torch._refs' ops
# disable it).
_collecting = gc.isenabled()
gc.disable()
import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.elastic.multiprocessing.errors import record

from fsdp_trainer.build import (
    build_checkpointer,
    build_loader,
    build_model,
    build_scores,
    build_step,
    check_run,
    lock_out_dir,
    model_state,
)
from fsdp_trainer.checkpoint.checkpointer import OptimState
from fsdp_trainer.checkpoint.storage import CheckpointError
from fsdp_trainer.config import Recipe, fail, parse_recipe, write_config
from fsdp_trainer.convert import export_hf_sharded
from fsdp_trainer.data.format import Tokens
from fsdp_trainer.data.loader import MicroBatch, Mixture, TokenLoader, eval_batches
from fsdp_trainer.distributed.parallelize import (
    SHARDING,
    ShardingPlan,
)
from fsdp_trainer.distributed.runtime import (
    DistEnv,
    close_distributed,
    die_with_launcher,
    init_distributed,
    resolve_precision,
    silent_ranks,
)
from fsdp_trainer.errors import follows_a_peer, say
from fsdp_trainer.files import RunDirInUse
from fsdp_trainer.metrics import Metrics
from fsdp_trainer.optim import build_loss_scaler, build_optimizer, clip_grad_norm_, lr_at, set_lr
from fsdp_trainer.steps.base import Step
from fsdp_trainer.steps.next_token import NextTokenStep

if _collecting:
    gc.enable()

logger = logging.getLogger("fsdp_trainer")


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    lr: float,
    grad_clip: float,
    loss_chunks: int = 1,
    scaler: torch.amp.GradScaler | None = None,
    plan: ShardingPlan = SHARDING["FULL_SHARD"],
    step_losses: Callable | None = None,
) -> dict[str, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; returns global loss, grad norm and the non-finite flag as
    device tensors (no host sync).

    Gradients are freed at the start of the step, not the end (as torchtitan does), so after it they are there to be
    measured. The loss is the sum of the cross-entropy of every target in the global batch (all micro-batches, all
    ranks) divided by the number of targets in it, so the gradient is the same however the batch is split, and a
    micro-batch with few targets (fine-tuning: few assistant tokens) weighs as little as it holds. Pretraining windows
    have a known number of targets; packed examples count theirs, in one all-reduce queued before backward.

    A step whose global loss or gradient norm is not finite leaves weights and AdamW state untouched, decided on the
    device: the fused AdamW kernel skips its update where `found_inf` is set (the mechanism torch.amp.GradScaler
    uses). Both numbers are global, so every rank takes the same decision.

    `step_losses`, the training kind's step (steps/), computes the micro-batches' losses and runs their backward;
    next-token cross-entropy unless given.

    With an enabled `scaler` (fp16), the loss is scaled before backward and the gradients unscaled before clipping,
    so grad_norm and the clip are in real units. Scaled gradients that overflow are routine: the step is skipped the
    same way, counted as `overflow`, and the scaler backs off; only a non-finite loss counts as `nonfinite`.
    """
    fp16 = scaler is not None and scaler.is_enabled()
    optimizer.zero_grad(set_to_none=True)
    set_lr(optimizer, lr)

    def backward(share: torch.Tensor) -> None:
        (scaler.scale(share) if fp16 else share).backward()

    losses = step_losses if step_losses is not None else NextTokenStep(loss_chunks)
    # The global loss, from one scalar all-reduce queued on the device (no host sync): every rank has it, for the
    # non-finite check and for logging; a NaN loss does not always make the gradients NaN.
    loss, extra = losses(model, micro_batches, plan, backward, dist.get_world_size())
    if fp16:
        scaler.unscale_(optimizer)  # checks for inf/NaN on the device, agreed over ranks for DTensor gradients
    grad_norm = clip_grad_norm_(model, grad_clip)
    # Under parallel.cpu_offload the gradients, so their norm and the optimizer step, are on the host, and the loss's
    # flag joins them there: a wait for the device that the host's optimizer step implies anyway.
    bad_loss, bad_grads = (~torch.isfinite(loss)).to(grad_norm.device), ~torch.isfinite(grad_norm)  # both global
    optimizer.found_inf = (bad_loss | bad_grads).float()
    optimizer.step()
    if fp16:
        scaler.update()  # on the device: halve the scale after an overflow, double it after 2000 clean steps
        nonfinite, overflow = bad_loss, bad_grads & ~bad_loss
    else:
        nonfinite, overflow = bad_loss | bad_grads, torch.zeros_like(bad_loss)
    flags = {"nonfinite": nonfinite.to(loss.device), "overflow": overflow.to(loss.device)}
    return {"loss": loss, "grad_norm": grad_norm, **flags, **extra}


class NonFiniteError(RuntimeError):
    """A step had a NaN/inf loss or gradient norm and train.on_nonfinite is `stop`."""


class TrainState(Stateful):
    """The optimizer step count and the steps skipped as non-finite, checkpointed. Nothing else in training draws
    random numbers, so there is no RNG to restore: the data order is a function of (seed, sample index) and the
    weight init of (seed, parameter name).

    Non-finite steps are counted on the device and read only by settle(), on log steps and when a checkpoint takes
    this state, so watching for them costs no host sync of its own; under `stop`, that is where the run fails, and
    nothing at or after a non-finite step is ever saved.
    """

    def __init__(
        self, on_nonfinite: str = "stop", device: torch.device | str = "cpu", scaler: torch.amp.GradScaler | None = None
    ) -> None:
        self.step = 0
        self.skipped_steps = 0
        self.overflow_steps = 0
        self.on_nonfinite = on_nonfinite
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._count = torch.zeros((), dtype=torch.int64, device=device)
        self._first = torch.full((), -1, dtype=torch.int64, device=device)
        self._overflows = torch.zeros((), dtype=torch.int64, device=device)

    def finish_step(self, stats: dict[str, torch.Tensor]) -> None:
        """Count one more step, and whether it was skipped as non-finite or as an fp16 overflow (on the device)."""
        self.step += 1
        self._count += stats["nonfinite"]
        self._first = torch.where(stats["nonfinite"] & (self._first < 0), self.step, self._first)
        self._overflows += stats["overflow"]

    def settle(self) -> int:
        """Host sync: fold the device counts into skipped_steps and overflow_steps and return skipped_steps; with
        `stop`, raise naming the first bad step."""
        count, first, overflows = torch.stack([self._count, self._first, self._overflows]).tolist()
        if overflows:
            self._overflows.zero_()
            self.overflow_steps += overflows
        if count:
            self._count.zero_()
            self._first.fill_(-1)
            if self.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"non-finite loss or gradient norm at step {first}; its update was not applied and training "
                    "stopped (train.on_nonfinite=stop; nothing from that step on is saved). Lower optim.lr or set "
                    "train.on_nonfinite=skip"
                )
            self.skipped_steps += count
            logger.warning(f"skipped {count} step(s) with a non-finite loss or gradient norm, the first: step {first}")
        return self.skipped_steps

    def loss_scaling(self) -> dict[str, float] | None:
        """fp16: the current loss scale (a host sync) and the overflow steps so far, for metrics; else None."""
        if self.scaler is None:
            return None
        return {"loss_scale": self.scaler.get_scale(), "overflow_steps": self.overflow_steps}

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "skipped_steps": self.settle()}
        # fp16 only, so the state of a bf16 or fp32 run keeps the keys checkpoints had before fp16 existed (DCP refuses
        # to load a key the checkpoint lacks): the scale and growth tracker, for a resume that scales as the original.
        if self.scaler is not None:
            state.update(overflow_steps=self.overflow_steps, loss_scaler=self.scaler.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        if self.scaler is not None:
            self.overflow_steps = int(state_dict["overflow_steps"])
            self.scaler.load_state_dict(state_dict["loss_scaler"])


def evaluate(model: torch.nn.Module, step: Step, val_file: Tokens, recipe: Recipe, env: DistEnv) -> dict:
    """The step's loss and metrics over the first train.eval_steps global micro-batches of the validation file (the
    same every time; no more than it holds whole): over its targets, its supervised tokens or its pairs, as the training
    kind counts them."""
    data = recipe.data
    rows, ranks = data.micro_batch_size, (env.data_rank, env.data_world)
    loader = TokenLoader(val_file, data.seq_len, rows, 1, *ranks, shuffle=False, device=env.device, shard=env.shard)
    n, _ = eval_batches(val_file, data.seq_len, rows, env.data_world, recipe.train.eval_steps)
    return step.evaluate(model, [loader.next_batch()[0] for _ in range(n)])


def train(recipe: Recipe, env: DistEnv, train_file: Tokens | Mixture, val_file: Tokens | None) -> None:
    cfg = recipe.train
    torch.manual_seed(cfg.seed)
    model, applied = build_model(recipe, env)
    optimizer = build_optimizer(model, recipe.optim)
    # fp16 only, else a no-op. The gradients are where the shards are: on the host under parallel.cpu_offload.
    scaler = build_loss_scaler(recipe.optim, recipe.parallel.mixed_precision, next(model.parameters()).device)
    loader = build_loader(recipe, env, train_file)
    state = TrainState(cfg.on_nonfinite, env.device, scaler)
    states = {"model": model_state(model), "optim": OptimState(model, optimizer), "data": loader, "train": state}
    step = build_step(recipe, env, model)  # the training kind's, with the frozen models it holds
    ckpt = build_checkpointer(recipe, env, states, step)
    step.prepare(recipe, env, {"train": train_file, "val": val_file}, ckpt.attachments)
    if env.is_main:
        write_config(recipe)
    metrics = Metrics(
        recipe, env, model, optimizer, loader, start_step=state.step, resumed_from=ckpt.resumed_from, shown=step.shown
    )
    ckpt.attachments.update(metrics.sinks.attachments())  # the W&B run id goes with every checkpoint
    scores = build_scores(recipe, env)  # the eval section's benchmark tasks, or None

    first_step = state.step + 1  # logged whatever log_every says: the first sign of life (and of the loss)
    if recipe.parallel.compile and env.is_main:
        logger.info("parallel.compile: the first step compiles the blocks and takes longer (minutes on a CPU)")
    data = recipe.data
    if val_file is not None and env.is_main:
        _, note = eval_batches(val_file, data.seq_len, data.micro_batch_size, env.data_world, cfg.eval_steps)
        if note:
            logger.warning(note)
    if cfg.eval_on_start and state.step == 0:
        if val_file is not None:
            metrics.log_eval(0, evaluate(model, step, val_file, recipe, env))
        if scores is not None:
            metrics.log_eval(0, scores.score(model), prefix="")
    try:
        while state.step < cfg.steps:
            lr = lr_at(state.step, recipe.optim, cfg.steps)
            step.begin(state.step + 1)
            batches = step.read(loader)
            stats = train_step(
                model, optimizer, batches, lr, recipe.optim.grad_clip, cfg.loss_chunks, scaler, applied.plan, step
            )
            state.finish_step(stats)
            metrics.step_done(state.step)
            last = state.step == cfg.steps
            if state.step % cfg.log_every == 0 or last or state.step == first_step:  # host syncs: log steps only
                metrics.log(state.step, stats, lr, state.settle(), state.loss_scaling())
            if val_file is not None and (state.step % cfg.eval_every == 0 or last):
                metrics.log_eval(state.step, evaluate(model, step, val_file, recipe, env))
            if scores is not None and scores.due(state.step, last):
                metrics.log_eval(state.step, scores.score(model), prefix="")
            ckpt.save_if_due(state.step)
            if ckpt.preempted:
                break
        ckpt.save_if_due(state.step, last=True)
    except BaseException as e:
        # A background save of an earlier, good step is waited for before a non-finite step fails the run; after
        # other failures the collectives it needs may be broken, so it is not.
        ckpt.close(wait=isinstance(e, NonFiniteError))
        raise
    ckpt.close()
    if recipe.checkpoint.export_hf and not ckpt.preempted:
        logger.info(f"exported the model as an HF directory: {export_hf_sharded(model, recipe, env.is_main)}")
    metrics.close()
    logger.info(f"done: run written to {cfg.out_dir}")


@record
def main(argv: list[str] | None = None) -> None:
    die_with_launcher()  # under torchrun: a worker never outlives its launcher
    recipe = parse_recipe(argv)  # bad recipe: one `error:` line, exit 1
    try:  # still before any collective: one line, exit 1
        train_file, val_file = check_run(recipe)
        env = init_distributed(recipe.parallel)
    except (FileNotFoundError, ValueError) as e:
        fail(e)
    # auto -> what the device computes natively; config.yaml, metrics and checkpoints record the resolved value.
    recipe.parallel.mixed_precision = resolve_precision(recipe.parallel.mixed_precision, env)
    lock = None
    try:
        lock = lock_out_dir(recipe.train.out_dir, env)  # before anything is written there
        train(recipe, env, train_file, val_file)
    except (CheckpointError, NonFiniteError, RunDirInUse) as e:  # every rank finds it: said once per node
        say(f"error: rank {env.rank}: {e}", everyone=True)
        sys.exit(1)
    except Exception as e:
        # Often a collective that failed because a peer died or hung: say which peers went silent. The traceback
        # follows (under plain torchrun, whose summary names the rank that failed first).
        peer = follows_a_peer(e)  # else the error is this rank's own: no peer to wait for
        silent = silent_ranks(env.rank, env.world_size, wait_s=5.0 if peer else 0.0)
        who = ", ".join(map(str, silent))
        hint = (
            f"; rank {who} reported no failure of its own: it exited or hangs, look there first"
            if peer and silent
            else ""
        )
        cause = str(e).splitlines()[0] if str(e) else ""
        line = f"error: rank {env.rank}: {type(e).__name__}: {cause}{hint}"
        if say(line, consequential=peer, details=traceback.format_exc()):
            sys.exit(1)  # fsdp-train prints the line and the traceback, the cause's first
        raise
    finally:
        if lock is not None:
            lock.release()
        close_distributed()


if __name__ == "__main__":
    # What the worker imported lives as long as it: out of every later garbage collection, each full one of which
    # would otherwise walk all of torch's objects again (~0.2 s of CPU each, 3/4 of a short run's collecting).
    gc.freeze()
    main()
