"""Expert parallelism: a mixture of experts' experts split over the `degree` ranks of a group, each rank holding
E / degree whole experts, and every token copy moved to the rank holding its expert and back by all-to-all.

moe.MixtureOfExperts routes and sorts its token copies by expert as without it; its `dispatch` hook then sends each
rank the copies of its experts (the counts exchanged first: the all-to-all's sizes are read on the host, the one sync
it costs), computes them in one grouped matmul a projection over its own experts, and sends the outputs back in the
order they came, so the combine that follows is unchanged. Gradients take the same way back (the all-to-alls are
differentiable).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

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
        sent, got = per_expert.view(n, local).sum(1).tolist(), received.sum(1).tolist()  # the host sync
        arrived = funcol.all_to_all_single_autograd(rows, got, sent, self.group)  # by source, then expert
        expert = torch.arange(local, device=rows.device).repeat(n).repeat_interleave(received.flatten())
        order = torch.argsort(expert, stable=True)  # by expert, then source
        offsets = torch.cumsum(received.sum(0), dim=0, dtype=torch.int32)
        computed = torch.empty_like(arrived).index_copy(0, order, experts(arrived[order], offsets))
        return funcol.all_to_all_single_autograd(computed, sent, got, self.group)


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Keep this rank's experts of each of `model`'s mixture of experts layers (rank r of the group: experts
    r x E / degree ... (r + 1) x E / degree - 1) and dispatch its token copies over the group."""
    rank, dispatch = dist.get_rank(group), ExpertDispatch(group)
    for layer in routed_layers(model):
        if layer.n_experts % dispatch.degree:
            raise ValueError(f"{layer.n_experts} experts do not split over {dispatch.degree} ranks")
        local = layer.n_experts // dispatch.degree
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            mine = param.detach()[rank * local : (rank + 1) * local].clone()
            setattr(layer.experts, name, nn.Parameter(mine, requires_grad=param.requires_grad))
        layer.dispatch = dispatch
