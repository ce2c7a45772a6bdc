"""What a run reports: tokens/s, MFU, memory; one JSON line per logged step, and a log line on rank 0."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time

import torch

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


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocated by the caching allocator on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


class Metrics:
    """Turns per-step tensors into numbers on log steps, on rank 0: a log line and a line of metrics.jsonl."""

    def __init__(
        self,
        out_dir: str,
        model_cfg: ModelConfig,
        seq_len: int,
        tokens_per_step: int,
        world_size: int,
        device: torch.device,
        is_main: bool,
        append: bool = False,
    ):
        self.is_main = is_main
        self.tokens_per_step = tokens_per_step
        self.world_size = world_size
        self.flops_per_token = flops_per_token(model_cfg, seq_len)
        self.peak = peak_flops(device)
        self.device = device
        self.start = self.last_time = time.perf_counter()
        self.last_step: int | None = None
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a" if append else "w") if is_main else None

    def reset_clock(self, step: int) -> None:
        """Start the throughput window at `step` (after start-up, a resume, or an evaluation)."""
        self.last_time, self.last_step = time.perf_counter(), step

    def log(self, step: int, loss: float, lr: float, grad_norm: float, peak_mem_gb: float) -> dict:
        now = time.perf_counter()
        steps = step - (self.last_step if self.last_step is not None else step - 1)
        tokens_per_s = steps * self.tokens_per_step / max(now - self.last_time, 1e-9)
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
            "elapsed_s": now - self.start,
        }
        if self.is_main:
            mfu_text = f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""
            logger.info(
                f"step {step:>6} | loss {loss:.4f} | lr {lr:.2e} | grad_norm {grad_norm:.3f} | "
                f"{tokens_per_s:,.0f} tok/s{mfu_text} | mem {peak_mem_gb:.2f} GB"
            )
            self._write(record)
        return record

    def log_eval(self, step: int, val_loss: float) -> None:
        if self.is_main:
            logger.info(f"step {step:>6} | val_loss {val_loss:.4f}")
            self._write({"step": step, "val_loss": val_loss, "elapsed_s": time.perf_counter() - self.start})

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
