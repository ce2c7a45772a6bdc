"""What training minimizes, computed from the model's final hidden states and its output layer.

An objective is an object the model calls at the end of its forward, `loss(hidden, weight)`, with the final hidden
states (B, T, dim) and the output layer's weight (vocab_size, dim). It runs inside the model's forward, so FSDP
gathers and frees the output layer there as it does every other parameter, but it is written here: a second objective
(a preference loss, distillation) is a class in this file, not a branch in the model file. Objectives return a sum;
train_step divides it by the number of targets of the whole global batch (share_of_global_mean), so the gradient is
the same however the batch is split over ranks and micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
"""A target that is not trained on (cross_entropy's ignore_index): a prompt's tokens in fine-tuning, padding."""


def _summed_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int = 1
) -> torch.Tensor:
    """Summed next-token loss of the output layer `weight` on the final hidden states, over the targets that are not
    IGNORE, in fp32 whatever the compute dtype.

    The logits are the model's largest activation (tokens x vocab: 2.1 GB in bf16 for 8k tokens of a 128k vocabulary,
    twice that as fp32 for the loss, and as much again for its gradient). With chunks > 1 the tokens are cut into that
    many slices; each slice's logits are made, reduced to a summed loss and freed, and made again in backward
    (activation checkpointing of the output layer), so one slice's logits exist at a time. The same loss and gradients
    as chunks = 1, to the order of the float sums.
    """
    hidden, targets = hidden.flatten(0, 1), targets.flatten()
    if chunks == 1:
        return _summed_loss(hidden, weight, targets)
    pieces = zip(hidden.chunk(chunks), targets.chunk(chunks), strict=True)
    return sum(checkpoint(_summed_loss, h, weight, t, use_reentrant=False) for h, t in pieces)


@dataclass
class NextTokenLoss:
    """Cross-entropy of the next token, summed over the targets (B, T) that are not IGNORE, with the output layer
    computed in `chunks` slices of the tokens (train.loss_chunks; see chunked_cross_entropy)."""

    targets: torch.Tensor
    chunks: int = 1

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(hidden, weight, self.targets, self.chunks)

    def count(self) -> torch.Tensor:
        """How many targets the sum is over."""
        return (self.targets != IGNORE).sum()


def share_of_global_mean(summed: torch.Tensor, global_count: torch.Tensor | float, world_size: int) -> torch.Tensor:
    """One micro-batch's part of the mean loss over the global batch's `global_count` targets, for backward.

    FSDP averages gradients over the ranks, so the sum is scaled by the world size to undo that division: the
    gradients are then those of the global mean, whatever the split into ranks and micro-batches, and a micro-batch
    with few targets (fine-tuning: few assistant tokens) weighs as little as it holds."""
    return summed * world_size / global_count
