"""AdamW, the learning-rate schedule, gradient clipping that is correct for sharded gradients, and fp16's loss
scaler."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_trainer.config import OptimConfig

# Bytes of training state per parameter, whatever the compute dtype: the fp32 master weight, its fp32 gradient and
# AdamW's two fp32 moments. The ZeRO formulas of the planner and the size of a checkpoint are read off these.
MASTER_WEIGHT_BYTES = 4
GRADIENT_BYTES = 4
OPTIMIZER_STATE_BYTES = 8


def build_loss_scaler(cfg: OptimConfig, mixed_precision: str, device: torch.device) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaling, starting at optim.loss_scale; disabled (every call a no-op) in bf16 and fp32,
    whose range needs none. GradScaler checks DTensor gradients for inf/NaN with one answer on every rank."""
    return torch.amp.GradScaler(device.type, init_scale=cfg.loss_scale, enabled=mixed_precision == "fp16")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over two groups: matrices (embeddings, projections) decay, vectors (norm gains) do not.

    Build it after FSDP has sharded the model: an optimizer over the pre-shard parameters would update stale tensors
    (pytorch#149205).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel for the whole update (CUDA and CPU, DTensor shards included), and the only implementation that
    # can skip a step on the device from a `found_inf` flag, which train_step uses for non-finite gradients.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to lr, then cosine decay to min_lr at the end.

    A pure function of the step, so resuming needs no scheduler state.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm to max_norm (0 = measure only) and return the norm before clipping.

    The norm of DTensor gradients is reduced across their shards, so every rank sees the global norm and scales by
    the same factor. Returns a device tensor: reading it is the caller's (log-step) host sync.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # all-reduces the partial squared sums of the shards
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
