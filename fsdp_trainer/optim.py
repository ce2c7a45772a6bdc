"""AdamW and Muon, the learning-rate schedule, gradient clipping that is correct for sharded gradients, and fp16's
loss scaler."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_trainer.config import OptimConfig
from fsdp_trainer.muon import Muon

# Bytes of training state per parameter, whatever the compute dtype: the fp32 master weight, its fp32 gradient and
# AdamW's two fp32 moments (Muon's matrices: one fp32 momentum buffer). The ZeRO formulas of the planner and the size
# of a checkpoint are read off these.
MASTER_WEIGHT_BYTES = 4
GRADIENT_BYTES = 4
OPTIMIZER_STATE_BYTES = 8
MUON_STATE_BYTES = 4


def updated_by_muon(name: str, param: torch.Tensor) -> bool:
    """Whether Muon (optim.name=muon) updates a parameter: the 2-D weights inside the blocks (q/k/v/o, gate/up/down),
    whatever wrappers add to their names. Embeddings, the output layer and the norms stay on AdamW."""
    return param.ndim == 2 and ".layers." in name


def optimizer_state_bytes(cfg: OptimConfig, model: nn.Module) -> int:
    """Bytes of optimizer state for a model's trainable parameters (a model on the meta device will do)."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # tied weights once
    muon = sum(p.numel() for name, p in params if cfg.name == "muon" and updated_by_muon(name, p))
    return MUON_STATE_BYTES * muon + OPTIMIZER_STATE_BYTES * (sum(p.numel() for _, p in params) - muon)


def optimizer_step_bytes(cfg: OptimConfig, model: nn.Module, shard_group: int) -> int:
    """Bytes one rank allocates for the length of an optimizer step (a model on the meta device will do): none for
    fused AdamW, which updates in place. Muon's exchange of whole matrices (muon.py) holds the rows it sends, the
    matrices it owns and the rows it receives, fp32, about 12 bytes per matrix weight / shard_group (one process:
    each direction and result, 4 + 4), and one matrix's Newton-Schulz iteration: x and two products of its size,
    three of the Gram's (CPU measurement: docs/benchmarks.md)."""
    if cfg.name != "muon":
        return 0
    shapes = [sorted(p.shape) for name, p in model.named_parameters() if p.requires_grad and updated_by_muon(name, p)]
    matrices = sum(m * n for m, n in shapes)
    held = 12 * matrices // shard_group if shard_group > 1 else 8 * matrices
    return held + max(4 * (3 * m * n + 3 * m * m) for m, n in shapes)


def build_loss_scaler(cfg: OptimConfig, mixed_precision: str, grads_device: torch.device) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaling, starting at optim.loss_scale; disabled (every call a no-op) in bf16 and fp32,
    whose range needs none. GradScaler checks DTensor gradients for inf/NaN with one answer on every rank.

    The scale lives where the gradients do (the host under parallel.cpu_offload): GradScaler would otherwise create it
    on the loss's device and hand the host's unscaling kernel a non-blocking device-to-host copy of it, which that
    kernel can read before it lands. A first scale() of a tensor on that device places it there.
    """
    scaler = torch.amp.GradScaler(grads_device.type, init_scale=cfg.loss_scale, enabled=mixed_precision == "fp16")
    scaler.scale(torch.ones((), device=grads_device))
    return scaler


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over two groups: matrices (embeddings, projections) decay, vectors (norm gains) do not. With
    optim.name=muon, the blocks' matrices form a third group that Muon updates.

    Build it after FSDP has sharded the model: an optimizer over the pre-shard parameters would update stale tensors
    (pytorch#149205).
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    muon = {name for name, p in named if cfg.name == "muon" and updated_by_muon(name, p)}
    groups = [
        {"params": [p for n, p in named if p.ndim >= 2 and n not in muon], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    if cfg.name == "adamw":
        # fused: one kernel for the whole update (CUDA and CPU, DTensor shards included), and the only implementation
        # that can skip a step on the device from a `found_inf` flag, which train_step uses for non-finite gradients.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    matrices = {
        "params": [p for n, p in named if n in muon],
        "names": [n for n, p in named if n in muon],  # which rank orthogonalizes a matrix follows from names and shapes
        "muon": True,
        "lr": cfg.muon_lr,
        "lr_scale": cfg.muon_lr / cfg.lr,  # set_lr: Muon's rate follows the schedule of lr
        "weight_decay": cfg.muon_weight_decay,
    }
    return Muon(
        [*groups, matrices],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
    )


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
    """The schedule's rate for AdamW's groups, scaled for a group with its own peak rate (Muon's)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of gradients that share a mesh (or are plain tensors), reduced over their shards. Where each element
    is held by one rank of a mesh of every rank (the experts' (dp_mod_ep, ep), sharded on both), the local shards'
    squares are summed in one all-reduce: DTensor's own reduction takes one a mesh dimension (and warns on every
    rank that it does)."""
    if not isinstance(grads[0], DTensor):
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    mesh = grads[0].device_mesh
    placements = {p for g in grads for p in g.placements}  # FSDP's over an expert's split: a _StridedShard
    if mesh.ndim > 1 and mesh.size() == dist.get_world_size() and not any(p.is_replicate() for p in placements):
        local = torch.nn.utils.get_total_norm([g.to_local() for g in grads], foreach=True)
        return funcol.all_reduce(local.square(), "sum", dist.group.WORLD).sqrt()
    return torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor()  # all-reduces the shards' sums


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm to max_norm (0 = measure only) and return the norm before clipping.

    The norm of DTensor gradients is reduced across their shards, so every rank sees the global norm and scales by
    the same factor. Returns a device tensor: reading it is the caller's (log-step) host sync.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    # By mesh: expert parallelism shards the experts over a mesh of their own (distributed/expert_parallel.py)
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [total_norm([p.grad for p in group]) for group in by_mesh.values()]
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:  # every element scaled alike, so each rank scales its local shards: no DTensor dispatch
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grads_with_norm_
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        for dtype in {g.dtype for g in grads}:
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], scale)
    return norm
