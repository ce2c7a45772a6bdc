"""What a run reports: tokens/s, MFU, memory; one JSON line per logged step, and a log line on rank 0."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from fsdp_trainer.config import ModelConfig

logger = logging.getLogger("fsdp_trainer")


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO; the others only warn, each line tagged with its rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


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
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.n_heads * head_dim * seq_len


# Dense bf16 tensor-core peak FLOP/s per device, from the vendors' datasheets (no sparsity). MFU is reported
# against these for bf16 and fp32 runs alike; an unknown device (and every CPU) gets MFU null.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "MI300X": 1307e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():  # most specific names come first
        if key in name:
            return flops
    return None


def local_gb(tensors: Iterable[torch.Tensor | None]) -> float:
    """GB this rank holds of these tensors: its local shard of a DTensor, all of a plain tensor."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total / 1e9


def optimizer_state_gb(optimizer: torch.optim.Optimizer) -> float:
    """GB of optimizer state (AdamW moments and step counts) on this rank."""
    return local_gb(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocated by the caching allocator on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


class StepTimer:
    """How long each step of a log window took, measured without a host sync.

    On CUDA an event is recorded on the compute stream after every step and read at the log step, which syncs anyway;
    the host's clock would say when the CPU queued the step, not when the GPU finished it. Elsewhere the host's clock
    is the device's.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
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
            self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        """Seconds each step since restart() took (host sync on CUDA: waits for the last step to finish)."""
        if len(self.marks) < 2:
            return []
        pairs = zip(self.marks[:-1], self.marks[1:], strict=True)
        if self.cuda:
            self.marks[-1].synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in pairs]
        return [end - start for start, end in pairs]


class Metrics:
    """Turns per-step tensors into numbers on log steps, on rank 0: a log line, a line of metrics.jsonl, TensorBoard
    scalars (when the `tensorboard` package is installed) and, on a terminal, a progress bar with ETA."""

    def __init__(
        self,
        out_dir: str,
        model_cfg: ModelConfig,
        seq_len: int,
        tokens_per_step: int,
        world_size: int,
        device: torch.device,
        is_main: bool,
        total_steps: int,
        start_step: int = 0,
        progress_bar: bool = True,
    ):
        self.is_main = is_main
        self.tokens_per_step = tokens_per_step
        self.world_size = world_size
        self.flops_per_token = flops_per_token(model_cfg, seq_len)
        self.peak = peak_flops(device)
        self.device = device
        self.start = self.last_time = time.perf_counter()
        self.cpu_start = time.process_time()
        self.last_step: int | None = None
        self.step_timer = StepTimer(device)
        self.file = self.tensorboard = self.bar = None
        if not is_main:
            return
        path = os.path.join(out_dir, "metrics.jsonl")
        if start_step:
            _drop_records_after(path, start_step)
        self.file = open(path, "a" if start_step else "w")
        self.tensorboard = _tensorboard_writer(os.path.join(out_dir, "tensorboard"), start_step)
        if progress_bar and sys.stdout.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            # Log lines go through tqdm.write while the bar is up, so the two never interleave mid-line.
            self._redirect = logging_redirect_tqdm()  # the root logger, where setup_logging put the handler
            self._redirect.__enter__()
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stdout)

    def reset_clock(self, step: int) -> None:
        """Start the throughput window at `step` (after start-up, a resume, or an evaluation)."""
        self.last_time, self.last_step = time.perf_counter(), step
        self.step_timer.restart()

    def advance(self, step: int) -> None:
        """Called after every step: times it and moves the progress bar (no sync)."""
        self.step_timer.mark()
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def log_state_memory(self, step: int, state_gb: dict[str, float]) -> None:
        """One record of the per-rank (largest rank) sizes of parameters, gradients and optimizer state."""
        if self.is_main:
            state_gb = {k: state_gb[k] for k in ("params_gb", "grads_gb", "optimizer_gb")}
            total = sum(state_gb.values())
            parts = ", ".join(f"{k.removesuffix('_gb')} {v:.3f}" for k, v in state_gb.items())
            logger.info(f"training state per rank: {total:.3f} GB ({parts})")
            self._write({"step": step, **state_gb, "state_gb": total})

    def log(
        self, step: int, loss: float, lr: float, grad_norm: float, peak_mem_gb: float, skipped_steps: int = 0
    ) -> dict:
        now = time.perf_counter()
        steps = step - (self.last_step if self.last_step is not None else step - 1)
        tokens_per_s = steps * self.tokens_per_step / max(now - self.last_time, 1e-9)
        step_times = self.step_timer.durations()
        self.reset_clock(step)
        mfu = None
        if self.peak:
            mfu = tokens_per_s * self.flops_per_token / (self.peak * self.world_size)
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "mfu": mfu,
            "peak_mem_gb": peak_mem_gb,
            # The spread of the window's step times: a slow data read, a checkpoint or a straggler shows in the max.
            "step_time_s": statistics.median(step_times) if step_times else None,
            "step_time_max_s": max(step_times) if step_times else None,
            "skipped_steps": skipped_steps,
            "elapsed_s": now - self.start,
            # Rank 0's CPU seconds (all its threads): unlike elapsed_s, blind to time other processes take from it.
            "cpu_s": time.process_time() - self.cpu_start,
        }
        if self.is_main:
            mfu_text = f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""
            logger.info(
                f"step {step:>6} | loss {loss:.4f} | lr {lr:.2e} | grad_norm {grad_norm:.3f} | "
                f"{tokens_per_s:,.0f} tok/s{mfu_text} | mem {peak_mem_gb:.2f} GB"
            )
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self._write(record)
        return record

    def log_eval(self, step: int, val_loss: float) -> None:
        if self.is_main:
            logger.info(f"step {step:>6} | val_loss {val_loss:.4f}")
            self._write({"step": step, "val_loss": val_loss, "elapsed_s": time.perf_counter() - self.start})

    def _write(self, record: dict) -> None:
        # NaN and inf are not JSON; null keeps the file readable by strict parsers (jq, JavaScript).
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "elapsed_s", "cpu_s") and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(TENSORBOARD_TAGS.get(key, f"train/{key}"), value, record["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.file:
            self.file.close()


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
    "params_gb": "memory/params_gb",
    "grads_gb": "memory/grads_gb",
    "optimizer_gb": "memory/optimizer_gb",
    "state_gb": "memory/state_gb",
}


def _tensorboard_writer(log_dir: str, start_step: int):
    """A SummaryWriter when the optional `tensorboard` package is installed, else None (metrics.jsonl has it all)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    # purge_step drops events a previous attempt wrote past the step this run resumes from.
    return SummaryWriter(log_dir, purge_step=start_step or None)


def _drop_records_after(path: str, step: int) -> None:
    """On resume, forget what the interrupted attempt logged after the checkpoint, so each step appears once."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        # A line cut short by a kill has no newline and no value.
        kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
