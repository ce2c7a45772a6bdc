"""Muon for FSDP2-sharded matrices: momentum, then the quintic Newton-Schulz iteration that makes each matrix's
update nearly orthogonal, computed once per matrix by an owner rank (optim.py chooses it, for the blocks' 2-D
weights; AdamW for the rest runs in the same optimizer)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.optim.adamw import adamw

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
                adamw_step(self.state, group, params, found_inf)

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
        # Whole matrices: gather each to its owner, orthogonalize there, scatter the rows back. Newton-Schulz runs on
        # the mesh's device, the GPU also when parallel.cpu_offload keeps the shards on the host (where it would take
        # seconds a step).
        if not params:
            return
        first = params[0]
        device = torch.device(first.device_mesh.device_type) if isinstance(first, DTensor) else first.device
        dtype = self.ns_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        updates = _orthogonalize_sharded(params, names, directions, dtype, device)
        for p, update in zip(params, updates, strict=True):
            rows, cols = p.shape
            w = _local(p)
            new_w = w * (1 - lr * decay) - update * (lr * math.sqrt(max(1.0, rows / cols)))
            w.copy_(torch.where(found_inf > 0, w, new_w) if skip else new_w)


def adamw_step(state: dict, group: dict, params: list, found_inf: torch.Tensor | None) -> None:
    """AdamW (fused, decoupled weight decay) on `params` of a group, with its moments in the optimizer's `state`."""
    for p in params:
        if not state[p]:
            state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
    states = [state[p] for p in params]
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


def _orthogonalize_sharded(params, names, directions, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """orthogonalize() of each whole matrix on `device`, given this rank's rows of it; returns this rank's rows of the
    results, where the rows were.

    Memory: all gathers are in flight at once (they overlap), so each input row block is dropped from `directions`
    once its padded copy is made, and an owner's gathered matrix once orthogonalized; what stays is about 12 bytes
    per matrix weight / N (sent rows, gathered matrices, received rows) plus one matrix's iteration.
    """
    out: list[torch.Tensor | None] = [None] * len(params)
    groups = [_shard_group(p) for p in params]
    sizes = {dist.get_world_size(group) for group in groups if group is not None}  # one mesh: one size
    owners = assign_owners(names, [tuple(p.shape) for p in params], sizes.pop()) if sizes else []
    pending = []
    for i, (p, group) in enumerate(zip(params, groups, strict=True)):
        local, directions[i] = directions[i], None
        if group is None:
            out[i] = orthogonalize(local.to(device), dtype=dtype).to(local.device)
            continue
        world, me, owner = dist.get_world_size(group), dist.get_rank(group), owners[i]
        rows_per_rank = -(-p.shape[0] // world)  # FSDP splits rows like torch.chunk: the last ranks may hold fewer
        padded = F.pad(local, (0, 0, 0, rows_per_rank - local.shape[0])).contiguous()
        del local
        pieces = [torch.empty_like(padded) for _ in range(world)] if me == owner else None
        work = dist.gather(padded, pieces, group=group, group_dst=owner, async_op=True)
        pending.append((i, p, group, world, me, owner, padded, pieces, work))
    scatters = []
    for k in range(len(pending)):
        (i, p, group, world, me, owner, padded, pieces, work), pending[k] = pending[k], None
        work.wait()
        chunks = None
        if me == owner:
            whole = torch.cat(pieces)[: p.shape[0]]
            del pieces
            full = orthogonalize(whole.to(device), dtype=dtype).to(whole.device)
            del whole
            chunks = list(F.pad(full, (0, 0, 0, padded.shape[0] * world - p.shape[0])).chunk(world))
            del full
        received = torch.empty_like(padded)
        del padded
        work = dist.scatter(received, chunks, group=group, group_src=owner, async_op=True)
        scatters.append((i, received, work, _local(p).shape[0]))
    for i, received, work, rows in scatters:
        work.wait()
        out[i] = received[:rows]
    return out
