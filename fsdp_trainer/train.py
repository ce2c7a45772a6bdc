"""Train a model from a recipe.

    torchrun --standalone --nproc_per_node=N -m fsdp_trainer.train --recipe recipes/debug.yaml [--section.key value]
    python -m fsdp_trainer.train --recipe recipes/debug.yaml          # one process, same code path

main() reads as the data flow: recipe -> process group -> model on meta -> parallelize -> materialize -> optimizer,
data, checkpoint -> loop. train_step() is one optimizer step with gradient accumulation.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FSDPModule

from fsdp_trainer.checkpoint import Checkpointer, CheckpointError, ModelState, OptimState, TrainState
from fsdp_trainer.config import Recipe, parse_recipe, recipe_to_yaml
from fsdp_trainer.data import TokenFile, TokenLoader
from fsdp_trainer.metrics import Metrics, local_gb, optimizer_state_gb, peak_memory_gb, setup_logging
from fsdp_trainer.model import Transformer, count_params
from fsdp_trainer.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from fsdp_trainer.parallel import (
    DistEnv,
    close_distributed,
    init_distributed,
    materialize,
    parallelize,
    set_gradient_sync,
    silent_ranks,
)
from fsdp_trainer.tokenizer import file_sha256

logger = logging.getLogger("fsdp_trainer")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss, in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    grad_clip: float,
    after_backward: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; returns global loss, grad norm and the non-finite flag as
    device tensors (no host sync).

    The loss of each micro-batch is divided by their number and FSDP averages gradients over ranks, so the gradient
    is that of the mean loss over the whole global batch, however it is split.

    A step whose global loss or gradient norm is not finite leaves weights and AdamW state untouched, decided on the
    device: the fused AdamW kernel skips its update where `found_inf` is set (the mechanism torch.amp.GradScaler
    uses). Both numbers are global, so every rank takes the same decision.
    """
    set_lr(optimizer, lr)
    loss_sum = torch.zeros((), device=micro_batches[0][0].device)
    for i, (inputs, targets) in enumerate(micro_batches):
        # Reduce gradients across ranks only after the last micro-batch; before that they accumulate locally.
        set_gradient_sync(model, i == len(micro_batches) - 1)
        loss = cross_entropy(model(inputs), targets)
        (loss / len(micro_batches)).backward()
        loss_sum += loss.detach()
    grad_norm = clip_grad_norm_(model, grad_clip)
    # One scalar all-reduce a step (queued on the device, no host sync) gives every rank the global loss, for the
    # non-finite check and for logging; a NaN loss does not always make the gradients NaN.
    loss = mean_over_ranks(loss_sum / len(micro_batches))
    nonfinite = ~(torch.isfinite(grad_norm) & torch.isfinite(loss))
    if after_backward is not None:
        after_backward()
    optimizer.found_inf = nonfinite.float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": grad_norm, "nonfinite": nonfinite}


class NonFiniteError(RuntimeError):
    """A step had a NaN/inf loss or gradient norm and train.on_nonfinite is `stop`."""


class NonFiniteSteps:
    """Counts skipped (non-finite) steps on the device, and reads the count only at log steps and before saves, so
    watching for them costs no host sync of its own."""

    def __init__(self, mode: str, state: TrainState, device: torch.device):
        self.mode, self.state = mode, state
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.first = torch.full((), -1, dtype=torch.int64, device=device)

    def add(self, step: int, nonfinite: torch.Tensor) -> None:
        self.count += nonfinite
        self.first = torch.where(nonfinite & (self.first < 0), step, self.first)

    def settle(self, last_saved: int | None) -> None:
        """Host sync: fold the device count into the training state; with `stop`, raise naming the first bad step."""
        count, first = torch.stack([self.count, self.first]).tolist()
        if not count:
            return
        self.count.zero_()
        self.first.fill_(-1)
        if self.mode == "stop":
            kept = f"checkpoint step {last_saved} is the newest" if last_saved is not None else "no checkpoint saved"
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {first}; its update was not applied and training stopped "
                f"(train.on_nonfinite=stop; {kept}). Lower optim.lr or set train.on_nonfinite=skip"
            )
        self.state.skipped_steps += count
        logger.warning(f"skipped {count} step(s) with a non-finite loss or gradient norm, the first at step {first}")


@torch.no_grad()
def evaluate(model: torch.nn.Module, val_file: TokenFile, recipe: Recipe, env: DistEnv) -> torch.Tensor:
    """Mean loss over the first train.eval_steps global micro-batches of the validation file (the same every time)."""
    data = recipe.data
    loader = TokenLoader(
        val_file, data.seq_len, data.micro_batch_size, 1, env.rank, env.world_size, shuffle=False, device=env.device
    )
    total = torch.zeros((), device=env.device)
    for _ in range(recipe.train.eval_steps):
        ((inputs, targets),) = loader.next_batch()
        total += cross_entropy(model(inputs), targets)
    for module in model.modules():  # SHARD_GRAD_OP keeps params gathered after a forward that has no backward
        if isinstance(module, FSDPModule):
            module.reshard()
    return mean_over_ranks(total / recipe.train.eval_steps)


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return x / dist.get_world_size()


def max_over_ranks(value: float, device: torch.device) -> float:
    x = torch.tensor(value, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def open_data(recipe: Recipe) -> tuple[TokenFile, TokenFile | None]:
    """Open and cross-check the token files and tokenizer; raises ValueError / FileNotFoundError naming the file."""
    data = recipe.data
    train_file = TokenFile(data.train_path)
    val_file = TokenFile(data.val_path) if data.val_path and recipe.train.eval_every else None
    tokenizer_sha = file_sha256(data.tokenizer_path) if os.path.isfile(data.tokenizer_path) else None
    if tokenizer_sha is None:
        raise FileNotFoundError(f"data.tokenizer_path={data.tokenizer_path} does not exist")
    for f in filter(None, (train_file, val_file)):
        if f.vocab_size > recipe.model.vocab_size:
            raise ValueError(
                f"{f.path} was tokenized with vocab_size={f.vocab_size}, more than model.vocab_size="
                f"{recipe.model.vocab_size}"
            )
        if f.tokenizer_sha256 != tokenizer_sha:
            raise ValueError(f"{f.path} was not made with data.tokenizer_path={data.tokenizer_path}; prepare it again")
    return train_file, val_file


def check_out_dir(recipe: Recipe, rank: int) -> None:
    """Fail before any collective, naming train.out_dir, if it cannot take this run's files: it cannot be created or
    written (a probe file per rank, as every rank writes checkpoint shards), or, with checkpoints on, its disk lacks
    room for one checkpoint (fp32 weights and two AdamW moments: 12 bytes per parameter)."""
    out_dir = recipe.train.out_dir
    probe = os.path.join(out_dir, f".write_test.rank{rank}")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(bytes(4096))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ValueError(f"train.out_dir={out_dir} is not writable ({e.strerror}); choose another directory") from e
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    if recipe.checkpoint.every:
        need = 12 * count_params(recipe.model)
        free = shutil.disk_usage(out_dir).free
        if free < need:
            raise ValueError(
                f"train.out_dir={out_dir} has {free / 1e9:.1f} GB free, and one checkpoint of this model takes "
                f"{need / 1e9:.1f} GB; free space or choose another directory"
            )


class PreemptionFlag:
    """SIGTERM (what Slurm, Kubernetes and torchrun send before killing) asks the run to stop after the current step.

    Ranks can receive the signal steps apart, so they agree once per step with a MAX all-reduce of one integer on a
    gloo group of its own: a CPU round trip that never waits on the GPU, unlike reading a device tensor would.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.received = False
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def agreed(self) -> bool:
        flag = torch.tensor([int(self.received)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def close(self) -> None:
        """Give SIGTERM back and free the group now: the handler would keep the group alive until interpreter exit,
        where freeing it can abort the process (see close_distributed)."""
        signal.signal(signal.SIGTERM, self._previous_handler)
        dist.destroy_process_group(self.group)
        self.group = None


def write_config(recipe: Recipe) -> None:
    os.makedirs(recipe.train.out_dir, exist_ok=True)
    path = os.path.join(recipe.train.out_dir, "config.yaml")
    with open(path + ".tmp", "w") as f:
        f.write(recipe_to_yaml(recipe))
    os.replace(path + ".tmp", path)


def train(recipe: Recipe, env: DistEnv, train_file: TokenFile, val_file: TokenFile | None) -> None:
    cfg, data = recipe.train, recipe.data
    torch.manual_seed(cfg.seed)

    # Model: shapes on meta, then AC / compile / FSDP from outside, then each rank allocates and fills its shards.
    with torch.device("meta"):
        model = Transformer(recipe.model)
    parallelize(model, recipe.parallel, env.mesh)
    materialize(model, env.device, cfg.seed)
    optimizer = build_optimizer(model, recipe.optim)

    loader = TokenLoader(
        train_file,
        data.seq_len,
        data.micro_batch_size,
        data.grad_accum_steps,
        env.rank,
        env.world_size,
        seed=cfg.seed,
        device=env.device,
    )
    state = TrainState()
    ckpt = Checkpointer(
        recipe.checkpoint,
        cfg.out_dir,
        {"model": ModelState(model), "optim": OptimState(model, optimizer), "data": loader, "train": state},
        env.is_main,
        # A checkpoint carries what tools/consolidate.py needs to turn it into an HF model on its own.
        attachments={
            "recipe.yaml": recipe_to_yaml(recipe).encode(),
            "tokenizer.model": Path(data.tokenizer_path).read_bytes(),
        },
        timeout=env.timeout,
    )
    ckpt.load()

    if env.is_main:
        write_config(recipe)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info(
            f"{recipe.model.family} model, {n_params / 1e6:.1f}M params | {env.world_size} rank(s), "
            f"{recipe.parallel.sharding}, {recipe.parallel.mixed_precision} | global batch "
            f"{loader.global_batch_size} x {data.seq_len} tokens | {cfg.steps} steps -> {cfg.out_dir}"
        )
        if recipe.parallel.expandable_segments and env.device.type != "cuda":
            logger.info(f"parallel.expandable_segments: CUDA's allocator only, nothing to do on {env.device.type}")
    metrics = Metrics(
        cfg.out_dir,
        recipe.model,
        data.seq_len,
        loader.global_batch_size * data.seq_len,
        env.world_size,
        env.device,
        env.is_main,
        total_steps=cfg.steps,
        start_step=state.step,
        progress_bar=cfg.progress_bar,
    )
    metrics.reset_clock(state.step)
    preemption = PreemptionFlag(env.timeout)
    nonfinite = NonFiniteSteps(cfg.on_nonfinite, state, env.device)
    first_step = state.step
    state_gb: dict[str, float] = {}  # what the sharded training state costs this rank, measured on the first step

    def measure_grads() -> None:
        state_gb["grads_gb"] = local_gb(p.grad for p in model.parameters())

    def save(step: int) -> None:
        nonfinite.settle(ckpt.last_saved)  # under `stop`, nothing at or after a non-finite step is saved
        ckpt.save(step)

    try:
        while state.step < cfg.steps:
            lr = lr_at(state.step, recipe.optim, cfg.steps)
            measure = state.step == first_step
            stats = train_step(
                model, optimizer, loader.next_batch(), lr, recipe.optim.grad_clip, measure_grads if measure else None
            )
            state.step += 1
            last = state.step == cfg.steps
            nonfinite.add(state.step, stats["nonfinite"])
            metrics.advance(state.step)
            if measure:
                state_gb.update(params_gb=local_gb(model.parameters()), optimizer_gb=optimizer_state_gb(optimizer))
                metrics.log_state_memory(state.step, {k: max_over_ranks(v, env.device) for k, v in state_gb.items()})

            if state.step % cfg.log_every == 0 or last:
                # The only host syncs of a step: on log steps, loss, grad norm, skipped steps and peak memory.
                nonfinite.settle(ckpt.last_saved)
                mem = max_over_ranks(peak_memory_gb(env.device), env.device)
                metrics.log(state.step, stats["loss"].item(), lr, stats["grad_norm"].item(), mem, state.skipped_steps)

            if val_file is not None and (state.step % cfg.eval_every == 0 or last):
                metrics.log_eval(state.step, evaluate(model, val_file, recipe, env).item())
                metrics.reset_clock(state.step)

            if preemption.agreed():  # every rank saves this step, then exits 0; a restart resumes here
                logger.info(f"SIGTERM: saving step {state.step} and stopping")
                save(state.step)
                break
            if ckpt.is_due(state.step):
                save(state.step)
        if ckpt.final_save_due(state.step):
            save(state.step)
    except NonFiniteError:
        ckpt.close()  # publish a background save of an earlier, good step before failing
        raise
    finally:
        preemption.close()
    ckpt.close()
    metrics.close()
    if env.is_main:
        logger.info(f"done: run written to {cfg.out_dir}")


@record
def main(argv: list[str] | None = None) -> None:
    recipe = parse_recipe(argv)  # bad recipe: one `error:` line, exit 1
    try:
        train_file, val_file = open_data(recipe)
        check_out_dir(recipe, int(os.environ.get("RANK", 0)))
        env = init_distributed(recipe.parallel)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")  # still before any collective: one line, exit 1
    setup_logging(env.rank)
    try:
        train(recipe, env, train_file, val_file)
    except (CheckpointError, NonFiniteError) as e:  # every rank finds the same problem: one line each, naming the rank
        sys.exit(f"error: rank {env.rank}: {e}")
    except Exception as e:
        # Typically a collective that failed because a peer died or hung: say which peers went silent. The traceback
        # follows, and torchrun's summary names the rank that failed first.
        silent = silent_ranks(env.rank, env.world_size)
        who = ", ".join(map(str, silent))
        hint = f"; rank {who} reported no failure of its own: it exited or hangs, look there first" if silent else ""
        cause = str(e).splitlines()[0] if str(e) else ""
        print(f"error: rank {env.rank}: {type(e).__name__}: {cause}{hint}", file=sys.stderr, flush=True)
        raise
    finally:
        close_distributed()


if __name__ == "__main__":
    main()
