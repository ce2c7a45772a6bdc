"""AdamW and Muon, the learning-rate schedule, gradient clipping that is correct for sharded gradients, and fp16's
loss scaler."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.optim.adamw import adamw

from fsdp_trainer.config import OptimConfig

# Bytes of training state per parameter, whatever the compute dtype: the fp32 master weight, its fp32 gradient and
# AdamW's two fp32 moments (Muon's matrices: one fp32 momentum buffer). The ZeRO formulas of the planner and the size
# of a checkpoint are read off these.
MASTER_WEIGHT_BYTES = 4
GRADIENT_BYTES = 4
OPTIMIZER_STATE_BYTES = 8
MUON_STATE_BYTES = 4


def optimizer_state_bytes(cfg: OptimConfig, n_params: int, n_block_matrix_params: int) -> int:
    """Bytes of optimizer state of a model of n_params, n_block_matrix_params of them in the blocks' 2-D weights."""
    if cfg.name == "muon":
        return MUON_STATE_BYTES * n_block_matrix_params + OPTIMIZER_STATE_BYTES * (n_params - n_block_matrix_params)
    return OPTIMIZER_STATE_BYTES * n_params


def build_loss_scaler(cfg: OptimConfig, mixed_precision: str, device: torch.device) -> torch.amp.GradScaler:
    """fp16's dynamic loss scaling, starting at optim.loss_scale; disabled (every call a no-op) in bf16 and fp32,
    whose range needs none. GradScaler checks DTensor gradients for inf/NaN with one answer on every rank."""
    return torch.amp.GradScaler(device.type, init_scale=cfg.loss_scale, enabled=mixed_precision == "fp16")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over two groups: matrices (embeddings, projections) decay, vectors (norm gains) do not. With
    optim.name=muon, the blocks' matrices form a third group that Muon updates.

    Build it after FSDP has sharded the model: an optimizer over the pre-shard parameters would update stale tensors
    (pytorch#149205).
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    muon = {name for name, p in named if cfg.name == "muon" and p.ndim == 2 and ".layers." in name}
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


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz iteration of Keller Jordan's Muon (nanochat's, torch.optim.Muon's): a steep slope at zero
that moves small singular values fast, at the price of leaving them in about [0.5, 1.5] rather than at 1."""


def newton_schulz_flops(shape: tuple[int, ...], steps: int = 5) -> int:
    """FLOPs of orthogonalize() on a matrix: per step, two (m x m x n) products and one (m x m x m), m <= n."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def assign_owners(names: list[str], shapes: list[tuple[int, ...]], world: int) -> list[int]:
    """The rank that orthogonalizes each matrix: largest first, each to the rank with the least work so far (ties:
    the lower rank; equal sizes: in name order). Every rank computes the same answer from names and shapes alone;
    the busiest rank gets about 1/world of the work (a hash of the name gave 2.2x that on 8 ranks for 125m)."""
    load, owners = [0] * world, [0] * len(names)
    order = sorted(range(len(names)), key=lambda i: (-newton_schulz_flops(shapes[i]), names[i]))
    for i in order:
        owner = min(range(world), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += newton_schulz_flops(shapes[i])
    return owners


def orthogonalize(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """About U V^T of a matrix's SVD U S V^T (singular values near 1 instead of exactly), by the quintic
    Newton-Schulz iteration in `dtype`; returned in g's dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T  # iterate on the smaller Gram matrix
    x = x / x.norm().clamp(min=1e-7)  # the Frobenius norm bounds the spectral norm: singular values <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.T).to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked `muon` (2-D weights), AdamW (fused, decoupled weight decay) for the others.

    Muon, as torch.optim.Muon and nanochat write it: buf = lerp(buf, grad, 1 - momentum), the update is
    orthogonalize(lerp(grad, buf, momentum)) with Nesterov (else of buf), scaled by sqrt(max(1, rows / cols));
    w = w * (1 - lr * weight_decay) - lr * update. Newton-Schulz runs in `ns_dtype`: bf16 on GPUs, fp32 on CPUs
    (where bf16 matmuls are slower).

    Under FSDP each rank holds a block of rows of each matrix, and Newton-Schulz on a block is not Muon on the matrix.
    So each matrix has one owner rank in its shard group (assign_owners: balanced, from names and shapes alone):
    every rank sends its rows of the
    momentum-corrected gradient to the owner (gather), the owner orthogonalizes the whole matrix and sends each rank
    its rows back (scatter). A rank does about 1/N of the Newton-Schulz work, and the momentum buffer stays sharded
    like the weight (a DTensor: checkpoints reshard it). Everything else is elementwise on the local rows.

    A `found_inf` attribute (a device tensor, set by train_step) skips the whole step on the device, as for AdamW.
    """

    ns_dtype: torch.dtype | None = None
    """Newton-Schulz's dtype; None: bf16 on CUDA, fp32 elsewhere."""

    def __init__(self, groups, lr, betas, eps, momentum, nesterov):
        super().__init__(
            groups,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, momentum=momentum, nesterov=nesterov, muon=False),
        )

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                names = [n for n, p in zip(group["names"], group["params"], strict=True) if p.grad is not None]
                self._muon(group, params, names, found_inf)
            elif params:
                self._adamw(group, params, found_inf)

    def _adamw(self, group, params, found_inf):
        for p in params:
            if not self.state[p]:
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=True,
            found_inf=found_inf,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _muon(self, group, params, names, found_inf):
        momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        skip = found_inf is not None
        directions = []
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf, grad = _local(state["momentum_buffer"]), _local(p.grad)
            new_buf = buf.lerp(grad, 1 - momentum)
            if skip:
                new_buf = torch.where(found_inf > 0, buf, new_buf)
            buf.copy_(new_buf)
            directions.append(grad.lerp(new_buf, momentum) if group["nesterov"] else new_buf)
        # Whole matrices: gather each to its owner, orthogonalize there, scatter the rows back.
        dtype = self.ns_dtype or (torch.bfloat16 if params and params[0].is_cuda else torch.float32)
        updates = _orthogonalize_sharded(params, names, directions, dtype)
        for p, update in zip(params, updates, strict=True):
            rows, cols = p.shape
            w = _local(p)
            new_w = w * (1 - lr * decay) - update * (lr * math.sqrt(max(1.0, rows / cols)))
            w.copy_(torch.where(found_inf > 0, w, new_w) if skip else new_w)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_group(p: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group over which a parameter's rows are split (FSDP's Shard(0) mesh dimension), or None when
    this rank holds the whole matrix (one process, DDP)."""
    if not isinstance(p, DTensor):
        return None
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard) and placement.dim == 0 and p.device_mesh.size(dim) > 1:
            return p.device_mesh.get_group(dim)
    return None


def _orthogonalize_sharded(params, names, directions, dtype: torch.dtype) -> list[torch.Tensor]:
    """orthogonalize() of each whole matrix, given this rank's rows of it; returns this rank's rows of the results."""
    out: list[torch.Tensor | None] = [None] * len(params)
    groups = [_shard_group(p) for p in params]
    sizes = {dist.get_world_size(group) for group in groups if group is not None}  # one mesh: one size
    owners = assign_owners(names, [tuple(p.shape) for p in params], sizes.pop()) if sizes else []
    pending = []
    for i, (p, group, local) in enumerate(zip(params, groups, directions, strict=True)):
        if group is None:
            out[i] = orthogonalize(local, dtype=dtype)
            continue
        world, me, owner = dist.get_world_size(group), dist.get_rank(group), owners[i]
        rows_per_rank = -(-p.shape[0] // world)  # FSDP splits rows like torch.chunk: the last ranks may hold fewer
        padded = F.pad(local, (0, 0, 0, rows_per_rank - local.shape[0])).contiguous()
        pieces = [torch.empty_like(padded) for _ in range(world)] if me == owner else None
        work = dist.gather(padded, pieces, group=group, group_dst=owner, async_op=True)
        pending.append((i, p, group, world, me, owner, padded, pieces, work))
    scatters = []
    for i, p, group, world, me, owner, padded, pieces, work in pending:
        work.wait()
        chunks = None
        if me == owner:
            full = orthogonalize(torch.cat(pieces)[: p.shape[0]], dtype=dtype)
            chunks = list(F.pad(full, (0, 0, 0, padded.shape[0] * world - p.shape[0])).chunk(world))
        received = torch.empty_like(padded)
        work = dist.scatter(received, chunks, group=group, group_src=owner, async_op=True)
        scatters.append((i, received, work, _local(p).shape[0]))
    for i, received, work, rows in scatters:
        work.wait()
        out[i] = received[:rows]
    return out


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
