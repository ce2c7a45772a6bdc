"""Next-token prediction (pretraining and supervised fine-tuning): what a training step computes on token windows."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import (
    ShardingPlan,
    set_gradient_sync,
)
from fsdp_trainer.distributed.runtime import (
    sum_over_ranks,
)
from fsdp_trainer.loss import NextTokenLoss, share_of_global_mean


class NextTokenStep:
    """The losses of one optimizer step's micro-batches for train_step: next-token cross-entropy, averaged over the
    targets of the global batch."""

    def __init__(self, chunks: int = 1):
        self.chunks = chunks

    def __call__(
        self,
        model: torch.nn.Module,
        micro_batches: list[MicroBatch],
        plan: ShardingPlan,
        backward: Callable[[torch.Tensor], None],
        world: int,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the global batch's mean loss, and for packed data its supervised tokens), after backward of every
        micro-batch."""
        device = micro_batches[0].inputs.device
        packed = micro_batches[0].documents is not None
        # The global number of targets: a device tensor, or for plain windows a Python number (a tensor made from it
        # would be a host-to-device copy every step).
        objectives = [NextTokenLoss(batch.targets, self.chunks) for batch in micro_batches]
        if packed:
            targets = sum_over_ranks(sum(objective.count() for objective in objectives).float())
        else:
            targets = float(sum(batch.targets.numel() for batch in micro_batches) * world)
        loss_sum = torch.zeros((), device=device)
        for i, (batch, objective) in enumerate(zip(micro_batches, objectives, strict=True)):
            # Reduce gradients across ranks only after the last micro-batch; before that they accumulate locally.
            set_gradient_sync(model, plan, i == len(micro_batches) - 1)
            loss = model(batch.inputs, batch.documents, loss=objective)  # summed over this micro-batch's targets
            backward(share_of_global_mean(loss, targets, world))
            loss_sum += loss.detach()
        loss = sum_over_ranks(loss_sum) / targets
        return loss, {"supervised_tokens": targets} if packed else {}
