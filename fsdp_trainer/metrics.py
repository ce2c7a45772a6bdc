"""What a run reports: tokens/s, MFU, memory and step times, as records on rank 0 for the sinks (sinks.py).

Read top to bottom: FLOP accounting -> memory probes -> step timing -> Metrics, which turns the loop's device tensors
into one record per log step and hands it to every sink.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from fsdp_trainer.config import ModelConfig, Recipe
from fsdp_trainer.distributed.runtime import DistEnv, max_over_ranks
from fsdp_trainer.files import METRICS_FILE, TENSORBOARD_DIR
from fsdp_trainer.model import count_params
from fsdp_trainer.sinks import (
    STATE_KEYS,
    WANDB_RUN_FILE,
    JsonlFile,
    LogLine,
    ProgressBar,
    TensorBoard,
    WandbRun,
    uses_wandb,
)

if TYPE_CHECKING:
    from fsdp_trainer.data.loader import TokenLoader

logger = logging.getLogger("fsdp_trainer")

# --- FLOP accounting --------------------------------------------------------------------------------------------------


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4) plus causal-free attention scores.

    The embedding lookup is no matmul and is left out; the output projection always is one, tied or not. Attention
    adds 12 * n_layers * n_heads * head_dim * seq_len (QK^T and AV, forward and backward), the convention of PaLM
    and torchtitan, which does not halve for the causal mask.
    """
    head_dim = cfg.resolved_head_dim
    attn = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * cfg.dim * cfg.ffn_dim
    matmul_params = cfg.n_layers * (attn + mlp) + cfg.dim * cfg.vocab_size
    return 6.0 * matmul_params + attention_flops_per_token(cfg, seq_len)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """flops_per_token's attention scores and their use (QK^T and AV, forward and backward): no weights involved."""
    return 12.0 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len


# Dense peak FLOP/s per device and compute dtype, from the vendors' datasheets (no sparsity): the tensor cores' for
# bf16 and fp16, the plain FP32 units' for fp32 (torch leaves TF32 off for matmuls unless a user turns it on). A
# dtype a device lacks (bf16 before compute capability 8.0) and an unknown device (and every CPU) get MFU null.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 75e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "L40": {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "MI300X": {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163.4e12},
    "V100-PCIE": {"fp16": 112e12, "fp32": 14e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},  # SXM2
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s in the (resolved) compute dtype, or None where unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS.items():  # most specific names come first
        if key in name:
            return flops.get(precision)
    return None


# --- memory probes ----------------------------------------------------------------------------------------------------


def local_gb(tensors: Iterable[torch.Tensor | None]) -> float:
    """GB this rank holds of these tensors: its local shard of a DTensor, all of a plain tensor."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        total += _stored_bytes(t)
    return total / 1e9


def _stored_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor stores: for a wrapper subclass (QLoRA's NF4), those of the tensors it is made of."""
    if hasattr(t, "__tensor_flatten__"):
        return sum(_stored_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def optimizer_state_gb(optimizer: torch.optim.Optimizer) -> float:
    """GB of optimizer state on this rank (AdamW's moments and step counts, Muon's momentum)."""
    return local_gb(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocated by the caching allocator on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return peak_host_memory_gb()


def peak_host_memory_gb() -> float:
    """Peak resident set size of this process: host memory (with parallel.cpu_offload, the training state's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


# --- step timing ------------------------------------------------------------------------------------------------------


class StepTimer:
    """How long each step of a log window took, measured without a host sync.

    On CUDA an event is recorded on the compute stream after every step and read at the log step, which syncs anyway;
    the host's clock would say when the CPU queued the step, not when the GPU finished it. Elsewhere the host's clock
    is the device's.
    """

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.cuda = device.type == "cuda"
        self.clock = clock
        self.marks: list = []

    def restart(self) -> None:
        """Open a window here (after start-up, a log step or an evaluation, whose time is no step's)."""
        self.marks = []
        self.mark()

    def mark(self) -> None:
        """Call when a step has been queued: on the device, the time between two marks is one step's."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(self.clock())

    def durations(self) -> list[float]:
        """Seconds each step since restart() took (host sync on CUDA: waits for the last step to finish)."""
        if len(self.marks) < 2:
            return []
        pairs = zip(self.marks[:-1], self.marks[1:], strict=True)
        if self.cuda:
            self.marks[-1].synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in pairs]
        return [end - start for start, end in pairs]


# --- Metrics: the loop's numbers -> records -> sinks ------------------------------------------------------------------


class Metrics:
    """Measures the run and turns the loop's device tensors into numbers on log steps only (the host syncs of a
    step), as one record per log step that every sink on rank 0 receives. Every rank calls it alike: the cross-rank
    maxima are collectives."""

    def __init__(
        self,
        recipe: Recipe,
        env: DistEnv,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: TokenLoader | None = None,
        start_step: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        resumed_from: str | os.PathLike | None = None,
        shown: dict[str, str] | None = None,
    ):
        """`shown`: the training kind's metrics the log line carries ({metric: label})."""
        data = recipe.data
        self.env, self.model, self.optimizer, self.loader, self.clock = env, model, optimizer, loader, clock
        self.tokens_per_step = data.micro_batch_size * data.grad_accum_steps * env.world_size * data.seq_len
        self.flops_per_token = flops_per_token(recipe.model, data.seq_len)
        self.precision = recipe.parallel.mixed_precision  # resolved (auto is decided at start-up)
        self.peak = peak_flops(env.device, self.precision)
        self.start = self.clock()
        self.cpu_start = time.process_time()
        self.first_step = start_step + 1
        self.step_timer = StepTimer(env.device, clock)
        self.total_steps, self.progress_every_s = recipe.train.steps, recipe.train.progress_every_s
        self.sinks: list = []
        self.bar: ProgressBar | None = None
        self.wandb: WandbRun | None = None
        self.restart_clock(start_step)
        if not env.is_main:
            return
        out_dir = recipe.train.out_dir
        tensorboard = TensorBoard.open(os.path.join(out_dir, TENSORBOARD_DIR), start_step)
        if recipe.train.progress_bar and sys.stdout.isatty():
            self.bar = ProgressBar(recipe.train.steps, start_step)
        self.wandb = WandbRun(recipe, resumed_from, start_step) if uses_wandb(recipe) else None
        self.sinks = [
            LogLine(shown),
            JsonlFile(os.path.join(out_dir, METRICS_FILE), start_step),
            tensorboard,
            self.wandb,
        ]
        self.sinks = [sink for sink in [*self.sinks, self.bar] if sink is not None]
        n_params = count_params(recipe.model)
        logger.info(
            f"{recipe.model.family} model, {n_params / 1e6:.1f}M params | {env.world_size} rank(s), "
            f"{recipe.parallel.sharding}, {recipe.parallel.mixed_precision} | global batch "
            f"{self.tokens_per_step // data.seq_len} x {data.seq_len} tokens | {recipe.train.steps} steps -> {out_dir}"
        )

    def restart_clock(self, step: int) -> None:
        """Start the throughput window at `step` (after start-up, a resume, a log step or an evaluation)."""
        self.last_time, self.last_step = self.clock(), step
        self.last_line = self.last_time
        self.step_timer.restart()

    def _progress_line(self, step: int) -> None:
        """Off a terminal, where no bar moves: a line when progress_every_s pass without one (host clock, no sync)."""
        now = self.clock()
        if not self.progress_every_s or now - self.last_line < self.progress_every_s or step <= self.last_step:
            return
        self.last_line = now
        per_step = (now - self.last_time) / (step - self.last_step)
        eta = round(per_step * (self.total_steps - step))
        logger.info(
            f"step {step:>6} of {self.total_steps} | {per_step:.2f} s/step | eta {eta // 3600}h{eta // 60 % 60:02d}m"
            f"{eta % 60:02d}s"
        )

    def step_done(self, step: int) -> None:
        """Called after every step: times it and moves the progress bar (no sync). After this process's first step,
        while the gradients are alive (train_step frees them at its start), records the training state each rank
        holds."""
        self.step_timer.mark()
        if self.bar is not None:
            self.bar.update(step)
        elif self.env.is_main:
            self._progress_line(step)
        if step == self.first_step:
            local = [
                local_gb(self.model.parameters()),
                local_gb(p.grad for p in self.model.parameters()),
                optimizer_state_gb(self.optimizer),
            ]
            state = dict(zip(STATE_KEYS, max_over_ranks(local, self.env.device), strict=True))  # host sync, once
            self._write({"step": step, **state, "state_gb": sum(state.values()), "mixed_precision": self.precision})

    def log(
        self,
        step: int,
        stats: dict[str, torch.Tensor],
        lr: float,
        skipped_steps: int = 0,
        loss_scaling: dict[str, float] | None = None,
    ) -> dict:
        """One record of the steps since the last: loss, gradient norm (host syncs), throughput, peak memory (the
        largest rank's) and the median and largest step time."""
        cuda = self.env.device.type == "cuda"  # else the device's memory is the host's
        probes = [peak_memory_gb(self.env.device), *([peak_host_memory_gb()] if cuda else [])]
        peaks = max_over_ranks(probes, self.env.device)
        now = self.clock()
        tokens_per_s = (step - self.last_step) * self.tokens_per_step / max(now - self.last_time, 1e-9)
        step_times = self.step_timer.durations()
        self.restart_clock(step)
        mfu = tokens_per_s * self.flops_per_token / (self.peak * self.env.world_size) if self.peak else None
        record = {
            "step": step,
            "loss": stats["loss"].item(),
            "lr": lr,
            "grad_norm": stats["grad_norm"].item(),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.env.world_size,
            "mfu": mfu,
            "peak_mem_gb": peaks[0],
            **({"peak_host_mem_gb": peaks[1]} if cuda else {}),
            # The spread of the window's step times: a slow data read, a checkpoint or a straggler shows in the max.
            "step_time_s": statistics.median(step_times) if step_times else None,
            "step_time_max_s": max(step_times) if step_times else None,
            "skipped_steps": skipped_steps,
            **(loss_scaling or {}),  # fp16: loss_scale and overflow_steps
            # Packed fine-tuning data: the tokens of this step's global batch the loss is over (the assistant's).
            **({"supervised_tokens": int(stats["supervised_tokens"].item())} if "supervised_tokens" in stats else {}),
            # Preference pairs: how many the global batch held, and TRL's reward metrics (rewards/..., logps/...).
            **({"pairs": int(stats["pairs"].item())} if "pairs" in stats else {}),
            **{name: value.item() for name, value in stats.items() if "/" in name},
            "elapsed_s": now - self.start,
            # Rank 0's CPU seconds (all its threads): unlike elapsed_s, blind to time other processes take from it.
            "cpu_s": time.process_time() - self.cpu_start,
        }
        mixture = self.loader.mixture_report() if self.loader is not None else None
        if mixture is not None:  # per source: a small source repeating shows in its epochs
            record["mixture"] = mixture
        self._write(record)
        return record

    def log_eval(self, step: int, results: dict[str, torch.Tensor]) -> None:
        """One record of an evaluation (`loss`, and a preference run's reward metrics), each as `val_` + its name; its
        time counts toward no step's."""
        values = torch.stack(list(results.values())).tolist()  # one host sync
        record = {f"val_{name}": value for name, value in zip(results, values, strict=True)}
        self._write({"step": step, **record, "elapsed_s": self.clock() - self.start})
        self.restart_clock(step)

    def attachments(self) -> dict[str, bytes]:
        """Files for the checkpointer to save with every checkpoint: the W&B run id, when there is a W&B run."""
        return {WANDB_RUN_FILE: json.dumps({"id": self.wandb.run_id}).encode()} if self.wandb is not None else {}

    def _write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
