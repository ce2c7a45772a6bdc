"""Next-token prediction: pretraining on token windows and supervised fine-tuning on packed examples (their
assistant tokens). The loss is the sum of the cross-entropy of every target in the global batch (all micro-batches,
all ranks) divided by the number of targets in it, so a micro-batch with few targets (fine-tuning: few assistant
tokens) weighs as little as it holds."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.runtime import DistEnv, sum_over_ranks
from fsdp_trainer.loss import NextTokenLoss
from fsdp_trainer.steps.base import Step


class NextTokenStep(Step):
    """Next-token cross-entropy, averaged over the targets of the global batch; for packed data it also reports the
    batch's supervised tokens."""

    name = "next-token"
    chosen_by = "ask for no other kind"
    trains_on = "tokens"
    prepared_with = "tools/prepare_data.py (--format text or chat)"
    splits_windows = True

    def __init__(self, chunks: int = 1):
        super().__init__()
        self.chunks = chunks

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return True  # the kind of every run that asks for no other

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> NextTokenStep:
        return cls(recipe.train.loss_chunks)

    def units(self, micro_batches: list[MicroBatch], world: int) -> torch.Tensor | float:
        """The global number of targets: for packed data a device tensor (one all-reduce), for plain windows a Python
        number (a tensor made from it would be a host-to-device copy every step)."""
        if micro_batches[0].documents is None:
            return float(sum(batch.targets.numel() for batch in micro_batches) * world)
        return sum_over_ranks(sum(self.batch_units(batch) for batch in micro_batches).float())

    def batch_units(self, batch: MicroBatch) -> torch.Tensor:
        return NextTokenLoss(batch.targets).count()

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        objective = NextTokenLoss(batch.targets, self.chunks, batch.trained)  # over its targets
        loss = model(batch.inputs, batch.documents, loss=objective, context=batch.context)
        return loss, loss.new_zeros(0)

    def extra(self, micro_batches: list[MicroBatch], units: torch.Tensor | float) -> dict[str, torch.Tensor | float]:
        return {"supervised_tokens": units} if micro_batches[0].documents is not None else {}
