"""What every kind that trains on preference pairs shares: the data, how a global batch's pairs are counted, the
log-probabilities of a micro-batch's answers, and the planner's fake pairs.

A micro-batch of preference data (data/loader.py) is packed windows in which each pair's two conversations sit side
by side, the chosen one first, attended to block-causally, so no answer sees another. Every number a pair kind
reports is a mean over the pairs of the whole global batch, whatever its split over ranks and micro-batches: each
micro-batch's summed loss is scaled by the global number of pairs (share_of_global_mean), counted in one all-reduce
queued before the first backward, and the metrics are summed and all-reduced once, on the device.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.runtime import sum_over_ranks
from fsdp_trainer.loss import IGNORE, SequenceLogProbs
from fsdp_trainer.steps.base import Step


def answers_objective(batch: MicroBatch, chunks: int = 1) -> SequenceLogProbs:
    """Each answer's summed log-probability (2 x pairs,), chosen and rejected alternating, computed in `chunks`."""
    return SequenceLogProbs(batch.targets, batch.sequences, 2 * batch.pairs, chunks, batch.trained)


def answer_logps(model: nn.Module, batch: MicroBatch, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(each answer's summed log-probability under `model`, with gradient where enabled; its trained tokens), both
    (2 x pairs,), chosen and rejected alternating."""
    objective = answers_objective(batch, chunks)
    return model(batch.inputs, batch.documents, loss=objective), objective.count()


REWARD_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""What every pair kind reports, under TRL's names (means over the global batch's pairs): DPO's logps are each
answer's summed log-probability and its rewards beta x the log-ratio to the reference; a reference-free kind's (SimPO,
ORPO) logps are averaged over each answer's tokens, and its rewards beta x those."""


def length_normalized(logps: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each chosen answer's log-probability averaged over its tokens, each rejected one's), (pairs,) each."""
    average = logps / lengths.clamp(min=1)
    return average[0::2], average[1::2]


def reward_sums(rewards: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sums over a micro-batch's pairs of REWARD_METRICS, from their values per pair (loss.pair_rewards)."""
    return torch.stack([rewards[name].sum() for name in REWARD_METRICS])


class PairStep(Step):
    """A kind that trains on preference pairs: its units are the global batch's pairs, and, when the loss adds the
    chosen answers' negative log-likelihood (`nll_weight`), their tokens, over which that term is a mean (TRL's: the
    mean over the batch's chosen tokens, not of each answer's mean)."""

    trains_on = "pairs"
    prepared_with = "tools/prepare_data.py --format preference"

    def __init__(self, nll_weight: float = 0.0):
        super().__init__()
        if nll_weight:
            self.weights, self.terms = (1.0, nll_weight), ("nll_loss",)

    @classmethod
    def fake_batch(cls, batch: MicroBatch) -> MicroBatch:
        """Windows each holding one pair: two sequences of half the window, each a prompt (its first half, untrained)
        and an answer. Attention is left causal over the window: on a GPU the block-causal mask goes through
        flex_attention's kernel, which, like the causal one, makes no scores matrix, while the boolean mask a CPU uses
        would make one per layer (B x heads x T x T), a memory no GPU run has."""
        rows, length = batch.inputs.shape
        half = length // 2
        position = torch.arange(length)
        second = (position >= half).long()
        answer = (position % half) >= half // 2
        sequences = torch.where(answer, 2 * torch.arange(rows)[:, None] + second, -1)
        return MicroBatch(batch.inputs, batch.targets.masked_fill(~answer, IGNORE), None, sequences, rows)

    def units(self, micro_batches: list[MicroBatch], world: int) -> torch.Tensor:
        """The pairs of the global batch (and its chosen answers' tokens), on the device (one all-reduce)."""
        if len(self.weights) == 1:
            pairs = float(sum(self.batch_units(batch) for batch in micro_batches))
            return sum_over_ranks(torch.tensor(pairs, device=micro_batches[0].inputs.device))
        return sum_over_ranks(sum(self.batch_units(batch) for batch in micro_batches))

    def batch_units(self, batch: MicroBatch) -> torch.Tensor | int:
        if len(self.weights) == 1:
            return batch.pairs
        chosen_tokens = answers_objective(batch).count()[0::2].sum()
        return torch.stack([torch.tensor(float(batch.pairs), device=chosen_tokens.device), chosen_tokens.float()])

    def loss_terms(self, pair_losses: torch.Tensor, chosen_logps: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss terms from each pair's loss and each chosen answer's summed log-probability: the
        pairs' summed loss, and with an NLL term the chosen answers' summed negative log-likelihood."""
        if len(self.weights) == 1:
            return pair_losses.sum()
        return torch.stack([pair_losses.sum(), -chosen_logps.sum()])

    def extra(self, micro_batches: list[MicroBatch], units: torch.Tensor | float) -> dict[str, torch.Tensor | float]:
        return {"pairs": units if len(self.weights) == 1 else units[0]}
