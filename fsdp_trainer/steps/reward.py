"""A reward model (Bradley-Terry), trained on preference pairs as TRL's RewardTrainer trains one.

The model is the language model's decoder with a score head in place of its output layer (model.num_labels 1;
transformers' *ForSequenceClassification). A conversation's reward is the head at its last token, the position
transformers reads (the rightmost that is not padding): in a packed window, the last position of the conversation's
own example, after its answer's end-of-turn token and whatever the chat template writes after it (ChatML's newline),
as TRL's tokenization of prompt + answer has it. A pair's loss is -log sigmoid(chosen - rejected - margin), its
margin the record's (TRL's optional column; 0 without), plus center_rewards_coefficient x (chosen + rejected)^2; the
loss and TRL's metrics (accuracy, margin, the rewards' mean,
and their standard deviation in place of TRL's min and max) are means over the global batch's pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import ShardingPlan
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.steps.pairs import PairStep


@dataclass
class LastTokenScores:
    """The objective of a reward model's forward: the score head at each conversation's last token (n,), fp32, in
    the order `sequences` numbers them (chosen, rejected alternating)."""

    sequences: torch.Tensor
    """(B, T) the conversation each target belongs to, -1 where there is none (MicroBatch.sequences)."""
    n: int
    documents: torch.Tensor | None = None
    """(B, T) the example each position belongs to; None (the planner's fake pairs): a conversation ends at its last
    target."""

    def last_positions(self) -> torch.Tensor:
        """Each conversation's last position, flat over the (B, T) window (n,). Found on the device: no host sync."""
        B, T = self.sequences.shape
        flat = torch.arange(B * T, device=self.sequences.device)
        # One slot past the last conversation collects the positions of none, so no mask is indexed by.
        slots = torch.where(self.sequences >= 0, self.sequences, self.n).flatten()
        last_target = torch.zeros(self.n + 1, dtype=flat.dtype, device=flat.device)
        last_target = last_target.scatter_reduce(0, slots, flat, "amax", include_self=False)[: self.n]
        if self.documents is None:
            return last_target
        # The last position of each position's example: the first example boundary at or after it.
        position = torch.arange(T, device=flat.device)
        ends = torch.ones_like(self.documents, dtype=torch.bool)
        ends[:, :-1] = self.documents[:, 1:] != self.documents[:, :-1]
        end = torch.where(ends, position, T).flip(1).cummin(1).values.flip(1)
        return (end + T * torch.arange(B, device=flat.device)[:, None]).flatten()[last_target]

    def __call__(self, hidden: torch.Tensor, output: nn.Module) -> torch.Tensor:
        last = hidden.flatten(0, 1)[self.last_positions()]  # (n, dim)
        return output(last).float().sum(-1)  # (n,): one label; the sum is a new tensor, never a view FSDP2 warns of


def rewards(model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(each chosen conversation's reward, each rejected one's), (pairs,) each, with gradient where enabled."""
    objective = LastTokenScores(batch.sequences, 2 * batch.pairs, batch.documents)
    scores = model(batch.inputs, batch.documents, loss=objective)
    return scores[0::2], scores[1::2]


class RewardStep(PairStep):
    """Bradley-Terry's loss and TRL's RewardTrainer metrics, means over the global batch's pairs."""

    name = "reward"
    chosen_by = "set model.num_labels 1"
    metrics = ("accuracy", "margin", "mean_reward", "std_reward")
    shown = {"accuracy": "accuracy", "margin": "margin"}

    def __init__(self, center_rewards_coefficient: float = 0.0):
        super().__init__()
        self.center = center_rewards_coefficient

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return recipe.model.num_labels is not None

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> RewardStep:
        return cls(recipe.reward.center_rewards_coefficient)

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = rewards(model, batch)
        margins = 0.0 if batch.margins is None else batch.margins
        losses = -F.logsigmoid(chosen - rejected - margins) + self.center * (chosen + rejected) ** 2
        with torch.no_grad():
            # Per pair: its share of the batch's accuracy, margin, mean reward and mean squared reward (std_reward's
            # slot, which with_std turns into the deviation once both means are over the global batch).
            per_pair = [chosen > rejected, chosen - rejected, (chosen + rejected) / 2, (chosen**2 + rejected**2) / 2]
            metrics = torch.stack([values.float().sum() for values in per_pair])
        return losses.sum(), metrics

    def __call__(
        self, model: nn.Module, micro_batches: list[MicroBatch], plan: ShardingPlan, backward, world: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        loss, numbers = super().__call__(model, micro_batches, plan, backward, world)
        return loss, with_std(numbers)

    def evaluate(self, model: nn.Module, micro_batches: list[MicroBatch]) -> dict[str, torch.Tensor]:
        return with_std(super().evaluate(model, micro_batches))


def with_std(numbers: dict) -> dict:
    """The rewards' standard deviation over the batch from their mean and their mean square (in std_reward)."""
    squares = numbers["std_reward"]
    return {**numbers, "std_reward": (squares - numbers["mean_reward"] ** 2).clamp(min=0).sqrt()}
