"""What a run reports: tokens/s, MFU, memory and step times, as records on rank 0 for the sinks (sinks.py).

Read top to bottom: FLOP accounting -> memory probes -> step timing -> Metrics, which turns the loop's device tensors
into one record per log step and hands it to every sink.
"""

from __future__ import annotations

import logging
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from fsdp_trainer.config import ModelConfig, Recipe
from fsdp_trainer.distributed.runtime import DistEnv, max_over_ranks
from fsdp_trainer.model import count_params
from fsdp_trainer.moe import moe_layers
from fsdp_trainer.sinks import STATE_KEYS, Sinks

if TYPE_CHECKING:
    from fsdp_trainer.data.loader import TokenLoader

logger = logging.getLogger("fsdp_trainer")

# --- FLOP accounting --------------------------------------------------------------------------------------------------


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4) plus causal-free attention scores. Of a
    mixture of experts, the weights a token goes through: its router and its top_k experts.

    The embedding lookup is no matmul and is left out; the output projection always is one, tied or not. Attention
    adds 12 * n_layers * n_heads * head_dim * seq_len (QK^T and AV, forward and backward), the convention of PaLM
    and torchtitan, which does not halve for the causal mask.
    """
    head_dim = cfg.resolved_head_dim
    attn = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * cfg.dim * cfg.ffn_dim
    # A mixture of experts' layer: the router, and the top_k experts a token goes through (expert_flops_per_token).
    router = 0 if cfg.moe is None else cfg.dim * cfg.moe.experts
    n_moe = len(moe_layers(cfg))
    matmul_params = cfg.n_layers * attn + (cfg.n_layers - n_moe) * mlp + n_moe * router + cfg.dim * cfg.output_size
    return 6.0 * matmul_params + expert_flops_per_token(cfg) + attention_flops_per_token(cfg, seq_len)


def expert_flops_per_token(cfg: ModelConfig) -> float:
    """flops_per_token's routed experts: the top_k a token goes through in each mixture of experts layer, their three
    projections each, 6 FLOPs a weight (0 for a dense model)."""
    if cfg.moe is None:
        return 0.0
    return 6.0 * len(moe_layers(cfg)) * 3 * cfg.dim * cfg.moe.top_k * cfg.moe.ffn_dim


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


def training_state_gb(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict:
    """The largest rank's GB of parameters, gradients and optimizer state, and their sum (one host sync)."""
    local = [local_gb(model.parameters()), local_gb(p.grad for p in model.parameters()), optimizer_state_gb(optimizer)]
    state = dict(zip(STATE_KEYS, max_over_ranks(local, device), strict=True))
    return {**state, "state_gb": sum(state.values())}


def peak_memories_gb(device: torch.device) -> dict[str, float]:
    """The largest rank's peak memory, and on CUDA its peak host memory too (one host sync)."""
    cuda = device.type == "cuda"  # else the device's memory is the host's
    peaks = max_over_ranks([peak_memory_gb(device), *([peak_host_memory_gb()] if cuda else [])], device)
    return {"peak_mem_gb": peaks[0], **({"peak_host_mem_gb": peaks[1]} if cuda else {})}


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


# --- the log window: throughput and step times since the last record ----------------------------------------------


class Window:
    """The steps since the last log record: their throughput, MFU and step times (no host sync until the record),
    and, off a terminal where no progress bar moves, a line when `progress_every_s` pass without a record."""

    def __init__(self, recipe: Recipe, env: DistEnv, start_step: int, clock: Callable[[], float]):
        data = recipe.data
        self.clock, self.world_size = clock, env.world_size
        self.tokens_per_step = data.micro_batch_size * data.grad_accum_steps * env.data_world * data.seq_len
        self.flops_per_token = flops_per_token(recipe.model, data.seq_len)
        self.peak = peak_flops(env.device, recipe.parallel.mixed_precision)  # resolved (auto is decided at start-up)
        self.step_timer = StepTimer(env.device, clock)
        self.total_steps, self.progress_every_s = recipe.train.steps, recipe.train.progress_every_s
        self.steady: tuple[float, int] | None = None  # (time, step) after this process's first step: ETAs from there
        self.restart(start_step)

    def restart(self, step: int) -> None:
        """Open the window at `step` (after start-up, a resume, a log step or an evaluation)."""
        self.last_time, self.last_step = self.clock(), step
        self.last_line = self.last_time
        self.step_timer.restart()

    def progress_line(self, step: int) -> None:
        """A line when progress_every_s passed since the last (host clock, no sync)."""
        now = self.clock()
        if not self.progress_every_s or now - self.last_line < self.progress_every_s or step <= self.last_step:
            return
        if self.steady is None or step <= self.steady[1]:  # timed from the steady steps: not a compiling first one
            return
        self.last_line = now
        per_step = (now - self.steady[0]) / (step - self.steady[1])
        eta = round(per_step * (self.total_steps - step))
        logger.info(
            f"step {step:>6} of {self.total_steps} | {per_step:.2f} s/step | eta {eta // 3600}h{eta // 60 % 60:02d}m"
            f"{eta % 60:02d}s"
        )

    def close(self, step: int) -> dict[str, float | None]:
        """The window's numbers up to `step` (a host sync on CUDA), and a new window from there."""
        now = self.clock()
        tokens_per_s = (step - self.last_step) * self.tokens_per_step / max(now - self.last_time, 1e-9)
        step_times = self.step_timer.durations()
        self.restart(step)
        mfu = tokens_per_s * self.flops_per_token / (self.peak * self.world_size) if self.peak else None
        return {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "mfu": mfu,
            # The spread of the window's step times: a slow data read, a checkpoint or a straggler shows in the max.
            "step_time_s": statistics.median(step_times) if step_times else None,
            "step_time_max_s": max(step_times) if step_times else None,
        }


# --- Metrics: the loop's numbers -> records -> sinks ------------------------------------------------------------------


HOUSE_STATS = ("loss", "grad_norm", "nonfinite", "overflow")
"""What train_step reports of every step; the rest of its stats are the training kind's (steps/base.py)."""


def kind_numbers(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The training kind's numbers in a step's stats: the global batch's supervised tokens (packed fine-tuning data:
    the tokens the loss is over) or pairs, as integers, and its metrics (TRL's names: rewards/..., nll_loss, ...)."""
    counts = ("supervised_tokens", "pairs")
    return {
        name: int(value) if name in counts else float(value)  # a device tensor or a number
        for name, value in stats.items()
        if name not in HOUSE_STATS
    }


def mixture_numbers(loader: TokenLoader | None) -> dict:
    """Per source of a data mixture, the tokens drawn so far and their epochs: a small source repeating shows."""
    mixture = loader.mixture_report() if loader is not None else None
    return {"mixture": mixture} if mixture is not None else {}


def trained_params(model: torch.nn.Module, cfg: ModelConfig) -> str:
    """What a run trains of its model: `all 494.0M params`, or `2.1M of 494.0M params` (adapters on a frozen base)."""
    total = count_params(cfg)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # a DTensor's numel is the whole tensor's
    return (
        f"all {total / 1e6:.1f}M params" if trained >= total else f"{trained / 1e6:.1f}M of {total / 1e6:.1f}M params"
    )


def run_banner(recipe: Recipe, env: DistEnv, model: torch.nn.Module) -> str:
    """The line a run opens with: the model and what of it trains, the ranks and how they shard, the global batch,
    where it writes."""
    data, parallel = recipe.data, recipe.parallel
    rows = data.micro_batch_size * data.grad_accum_steps * env.data_world
    adapters = f"LoRA r{recipe.lora.rank}, " if recipe.lora.rank is not None else ""
    context = f" (context parallel {env.context.degree})" if env.context else ""
    return (
        f"{recipe.model.family} model, {adapters}training {trained_params(model, recipe.model)} | "
        f"{env.world_size} rank(s){context}, "
        f"{parallel.sharding}, {parallel.mixed_precision} | global batch {rows} x {data.seq_len} tokens | "
        f"{recipe.train.steps} steps -> {recipe.train.out_dir}"
    )


def host_values(numbers: dict[str, torch.Tensor | float]) -> list[float]:
    """The values of `numbers`: device tensors read in one host sync, Python numbers as they are (full precision)."""
    tensors = [v for v in numbers.values() if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else v for v in numbers.values()]


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
        self.env, self.model, self.optimizer, self.loader, self.clock = env, model, optimizer, loader, clock
        self.precision = recipe.parallel.mixed_precision  # resolved (auto is decided at start-up)
        self.start, self.cpu_start = self.clock(), time.process_time()
        self.first_step = start_step + 1
        self.window = Window(recipe, env, start_step, clock)
        self.sinks = Sinks(recipe, env.is_main, start_step, shown, resumed_from)
        if env.is_main:
            logger.info(run_banner(recipe, env, model))

    def step_done(self, step: int) -> None:
        """After every step: times it, moves the progress bar (no sync); after this process's first step, while the
        gradients are alive (train_step frees them at its start), records the training state each rank holds."""
        self.window.step_timer.mark()
        if self.sinks.bar is not None:
            self.sinks.bar.update(step)
        elif self.env.is_main:
            self.window.progress_line(step)
        if step == self.first_step:
            state = training_state_gb(self.model, self.optimizer, self.env.device)  # host sync, once
            self.sinks.write({"step": step, **state, "mixed_precision": self.precision})
            self.window.steady = (self.clock(), step)  # an ETA from the steady steps, not a compiling first one
            self.sinks.steady(step)

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
        record = {
            "step": step,
            "loss": stats["loss"].item(),
            "lr": lr,
            "grad_norm": stats["grad_norm"].item(),
            **self.window.close(step),
            **peak_memories_gb(self.env.device),
            "skipped_steps": skipped_steps,
            **(loss_scaling or {}),  # fp16: loss_scale and overflow_steps
            **kind_numbers(stats),
            "elapsed_s": self.clock() - self.start,
            # Rank 0's CPU seconds (all its threads): unlike elapsed_s, blind to time other processes take from it.
            "cpu_s": time.process_time() - self.cpu_start,
            **mixture_numbers(self.loader),
        }
        self.sinks.write(record)
        return record

    def log_eval(self, step: int, results: dict[str, torch.Tensor | float] | None, prefix: str = "val_") -> None:
        """One record of an evaluation, whose time is no step's: the kind's loss and metrics on the validation data
        (as `val_` + name; device tensors), or with no prefix benchmark scores (eval/TASK/METRIC, Python floats kept
        at full precision; None off rank 0)."""
        if results:
            record = {f"{prefix}{name}": value for name, value in zip(results, host_values(results), strict=True)}
            self.sinks.write({"step": step, **record, "elapsed_s": self.clock() - self.start})
        self.window.restart(step)

    def close(self) -> None:
        self.sinks.close()
