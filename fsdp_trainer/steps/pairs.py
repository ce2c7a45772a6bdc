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
    return SequenceLogProbs(batch.targets, batch.sequences, 2 * batch.pairs, chunks)


def answer_logps(model: nn.Module, batch: MicroBatch, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(each answer's summed log-probability under `model`, with gradient where enabled; its trained tokens), both
    (2 x pairs,), chosen and rejected alternating."""
    objective = answers_objective(batch, chunks)
    return model(batch.inputs, batch.documents, loss=objective), objective.count()


class PairStep(Step):
    """A kind that trains on preference pairs: its units are the global batch's pairs."""

    trains_on = "pairs"
    prepared_with = "tools/prepare_data.py --format preference"

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
        """The pairs of the global batch, on the device (one all-reduce)."""
        pairs = float(sum(self.batch_units(batch) for batch in micro_batches))
        return sum_over_ranks(torch.tensor(pairs, device=micro_batches[0].inputs.device))

    def batch_units(self, batch: MicroBatch) -> int:
        return batch.pairs

    def extra(self, micro_batches: list[MicroBatch], units: torch.Tensor | float) -> dict[str, torch.Tensor | float]:
        return {"pairs": units}
