"""Expert parallelism: a mixture of experts' experts split over the `degree` ranks of a group, each rank holding
E / degree whole experts, and every token copy moved to the rank holding its expert and back by all-to-all.

moe.MixtureOfExperts routes and sorts its token copies by expert as without it; its `dispatch` hook then sends each
rank the copies of its experts (the counts exchanged first: the all-to-all's sizes are read on the host, the one sync
it costs), computes them in one grouped matmul a projection over its own experts, and sends the outputs back in the
order they came, so the combine that follows is unchanged. Gradients take the same way back (the all-to-alls are
differentiable). A compiled block traces the sizes read on the host as symbolic integers (parallelize.apply_compile).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp_trainer.moe import routed_layers


class ExpertDispatch:
    """A group's all-to-all of token copies: called by each MixtureOfExperts of a model it was applied to."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.degree = group, dist.get_world_size(group)

    def __call__(self, experts: nn.Module, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """`rows` (copies, dim) sorted by expert, `per_expert` (E,) their counts -> the experts' outputs, same order."""
        n = self.degree
        local = len(per_expert) // n
        # Each rank learns how many copies of each of its experts every rank sends: (sources, local experts).
        received = funcol.all_to_all_single(per_expert, None, None, self.group).view(n, local)
        offsets = torch.cumsum(received.sum(0), dim=0, dtype=torch.int32)  # the rows each local expert ends at
        # The planner's step on fake tensors (no counts to read): the copies spread evenly
        if not torch.compiler.is_compiling() and is_fake(rows):
            even = [len(rows) // n] * (n - 1) + [len(rows) - (n - 1) * (len(rows) // n)]
            computed = experts(funcol.all_to_all_single_autograd(rows, even, even, self.group), offsets)
            return funcol.all_to_all_single_autograd(computed, even, even, self.group)
        sent, got = per_expert.view(n, local).sum(1).tolist(), received.sum(1).tolist()  # the host sync
        arrived = funcol.all_to_all_single_autograd(rows, got, sent, self.group)  # by source, then expert
        expert = torch.arange(local, device=rows.device).repeat(n)
        expert = expert.repeat_interleave(received.flatten(), output_size=sum(got))  # a size compile cannot infer
        order = torch.argsort(expert, stable=True)  # by expert, then source
        computed = torch.empty_like(arrived).index_copy(0, order, experts(arrived[order], offsets))
        return funcol.all_to_all_single_autograd(computed, sent, got, self.group)


def experts_mesh(degree: int, world_size: int, device_type: str) -> DeviceMesh | None:
    """The (dp_mod_ep, ep) mesh of the world (None at degree 1): groups of `degree` consecutive ranks split the
    experts (ep), and FSDP shards each rank's experts over the ranks holding the same ones (dp_mod_ep, torchtitan's
    dp_shard_mod_ep), so the experts' memory stays ZeRO-3's. Made once per process group (every rank makes it, its
    groups made collectively) and shared by every model of the run: the policy and the frozen ones beside it."""
    if degree == 1:
        return None
    key = (degree, world_size, device_type, id(dist.distributed_c10d._get_default_group()))
    if key not in _MESHES:
        _MESHES.clear()  # a process group's meshes die with it (the planner's fake worlds)
        mesh = init_device_mesh(device_type, (world_size // degree, degree), mesh_dim_names=("dp_mod_ep", "ep"))
        mesh["dp_mod_ep"], mesh["ep"]  # sliced once, here: torch keeps them (the planner's fake step cannot slice)
        _MESHES[key] = mesh
    return _MESHES[key]


_MESHES: dict[tuple, DeviceMesh] = {}


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make each of `model`'s experts' weights a DTensor of every expert sharded over the mesh's `ep` dimension (rank
    r of a group of N: experts r x E / N ... (r + 1) x E / N - 1, its local part), their LoRA adapters' too (stacked
    experts first alike), and dispatch its token copies over that group. Checkpoints see the whole (experts, ...)
    tensors, as without expert parallelism. Before FSDP (which then shards each rank's experts over `dp_mod_ep`); on a
    meta model, or on real weights every rank holds whole."""
    dispatch = ExpertDispatch(mesh["ep"].get_group())
    for layer in routed_layers(model):
        if layer.n_experts % dispatch.degree:
            raise ValueError(f"{layer.n_experts} experts do not split over {dispatch.degree} ranks")
        for name, param in list(layer.experts.named_parameters()):  # the weights, and LoRA's adapters on them
            owner, _, attr = name.rpartition(".")
            split = distribute_tensor(param.detach(), mesh["ep"], [Shard(0)], src_data_rank=None)
            setattr(layer.experts.get_submodule(owner), attr, nn.Parameter(split, requires_grad=param.requires_grad))
        layer.dispatch = dispatch


SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OP")
"""The shardings expert parallelism runs under: the experts' FSDP is a 1-D shard group."""


def check_expert_parallel(recipe: Any) -> None:
    """What expert parallelism needs of a recipe, before any process starts: ValueError naming the field."""
    degree, moe, parallel = recipe.parallel.expert_parallel, recipe.model.moe, recipe.parallel
    if degree == 1:
        return
    what = f"parallel.expert_parallel={degree}"
    if moe is None:
        raise ValueError(f"{what} splits a mixture of experts' experts; model.family={recipe.model.family} has none")
    if moe.experts % degree:
        raise ValueError(f"{what}: model.moe.experts ({moe.experts}) must be a multiple of it")
    if parallel.sharding not in SHARDINGS:
        raise ValueError(f"{what} runs under {', '.join(SHARDINGS)}, not {parallel.sharding} yet")
    if parallel.cpu_offload:
        raise ValueError(f"{what} does not run with parallel.cpu_offload yet; set one of them off")
    if parallel.context_parallel > 1:
        raise ValueError(f"{what} does not run with parallel.context_parallel yet; set one of them to 1")
