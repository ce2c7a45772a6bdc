"""Preference tuning (DPO and its variants): what a training step and an evaluation compute on pairs of answers.

A micro-batch of preference data (data/loader.py) is packed windows in which each pair's two conversations sit side
by side, the chosen one first, attended to block-causally, so no answer sees another. Its forward gives each answer's
summed log-probability (loss.SequenceLogProbs) under the policy (the model being trained) and, with no gradient,
under the reference (the model the run started from); loss.PreferenceLoss turns the four numbers of each pair into
its loss and TRL's reward metrics.

Every number is a mean over the pairs of the whole global batch, whatever its split over ranks and micro-batches:
each micro-batch's summed loss is scaled by the global number of pairs (share_of_global_mean), counted in one
all-reduce queued before the first backward, and the metrics are summed and all-reduced once, on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_trainer.adapters.lora import adapters_disabled
from fsdp_trainer.config import PreferenceConfig, Recipe, compute_dtype
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import ShardingPlan, parallelize, reshard, set_gradient_sync
from fsdp_trainer.distributed.runtime import sum_over_ranks
from fsdp_trainer.loss import PreferenceLoss, SequenceLogProbs, share_of_global_mean
from fsdp_trainer.model import Transformer

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""What a preference step reports beside its loss, under TRL's names (means over the global batch's pairs)."""


def frozen_copy(recipe: Recipe, mesh: DeviceMesh, flex_attention: bool = False) -> Transformer:
    """A full fine-tuning run's reference on the meta device, parallelized as the policy is, to be materialized: every
    parameter frozen and held in the compute dtype (what FSDP gathers anyway, so its forward is the policy's at step 0,
    bitwise); the buffers (RoPE's tables) stay as the policy's."""
    with torch.device("meta"):
        frozen = Transformer(recipe.model, flex_attention=flex_attention)
    frozen.requires_grad_(False)
    for param in frozen.parameters():
        param.data = param.data.to(compute_dtype(recipe.parallel.mixed_precision))
    parallelize(frozen, recipe.parallel, mesh)
    return frozen


class Reference:
    """The model the rewards are measured against: the policy with its adapters off (LoRA: no second copy of the
    weights), or `frozen`, a copy of the model the run started from with no gradients and no optimizer state."""

    def __init__(self, policy: nn.Module, frozen: nn.Module | None = None):
        self.policy, self.frozen = policy, frozen

    @torch.no_grad()
    def logps(self, batch: MicroBatch, chunks: int = 1) -> torch.Tensor:
        """Each answer's summed log-probability under the reference (2 x pairs,), chosen and rejected alternating."""
        model = self.frozen if self.frozen is not None else self.policy
        with adapters_disabled(self.policy) if self.frozen is None else nullcontext():
            logps = model(batch.inputs, batch.documents, loss=_objective(batch, chunks))
        if self.frozen is not None:
            reshard(self.frozen)
        return logps


def _objective(batch: MicroBatch, chunks: int) -> SequenceLogProbs:
    return SequenceLogProbs(batch.targets, batch.sequences, 2 * batch.pairs, chunks)


def global_pairs(micro_batches: list[MicroBatch], device: torch.device) -> torch.Tensor:
    """The pairs of the global batch, on the device (one all-reduce)."""
    return sum_over_ranks(torch.tensor(float(sum(batch.pairs for batch in micro_batches)), device=device))


class PreferenceStep:
    """The losses of one optimizer step's micro-batches, for train.train_step: the reference's log-probabilities
    (no gradient), then the policy's forward and backward, micro-batch by micro-batch."""

    def __init__(self, cfg: PreferenceConfig, reference: Reference, chunks: int = 1):
        self.loss = PreferenceLoss(cfg.loss, cfg.beta, cfg.label_smoothing)
        self.reference, self.chunks = reference, chunks

    def _pair_losses(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(each pair's loss, the sums over the pairs of METRICS) of a micro-batch: the reference's log-probabilities
        of its answers (no gradient), then the policy's (with gradient, where enabled)."""
        reference = self.reference.logps(batch, self.chunks)
        objective = _objective(batch, self.chunks)
        policy = model(batch.inputs, batch.documents, loss=objective)
        lengths = objective.count()
        chosen, rejected, ref_chosen, ref_rejected = policy[0::2], policy[1::2], reference[0::2], reference[1::2]
        losses = self.loss(chosen, rejected, ref_chosen, ref_rejected, lengths[0::2], lengths[1::2])
        rewards = self.loss.rewards(chosen, rejected, ref_chosen, ref_rejected)
        return losses, torch.stack([rewards[name].sum() for name in METRICS])

    def __call__(
        self,
        model: nn.Module,
        micro_batches: list[MicroBatch],
        plan: ShardingPlan,
        backward: Callable[[torch.Tensor], None],
        world: int,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the global batch's mean loss, its metrics and pair count), after backward of every micro-batch."""
        device = micro_batches[0].inputs.device
        pairs = global_pairs(micro_batches, device)
        totals = torch.zeros(1 + len(METRICS), device=device)  # the loss and the metrics, summed over pairs
        for i, batch in enumerate(micro_batches):
            set_gradient_sync(model, plan, i == len(micro_batches) - 1)
            losses, metrics = self._pair_losses(model, batch)
            summed = losses.sum()
            backward(share_of_global_mean(summed, pairs, world))
            totals += torch.cat([summed.detach()[None], metrics])
        totals = sum_over_ranks(totals) / pairs
        return totals[0], {"pairs": pairs, **dict(zip(METRICS, totals[1:], strict=True))}

    @torch.no_grad()
    def sums(self, model: nn.Module, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """This rank's sums over its pairs of the loss and of METRICS, and last its number of pairs; no gradient."""
        device = micro_batches[0].inputs.device
        totals = torch.zeros(2 + len(METRICS), device=device)
        for batch in micro_batches:
            losses, metrics = self._pair_losses(model, batch)
            totals += torch.cat([losses.sum()[None], metrics, torch.tensor([batch.pairs], device=device)])
        return totals

    def evaluate(self, model: nn.Module, micro_batches: list[MicroBatch]) -> dict[str, torch.Tensor]:
        """The mean loss and METRICS over the pairs of every rank's micro-batches (one all-reduce)."""
        totals = sum_over_ranks(self.sums(model, micro_batches))
        reshard(model)
        return dict(zip(("loss", *METRICS), totals[:-1] / totals[-1], strict=True))
