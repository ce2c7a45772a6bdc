"""ORPO (Hong et al. 2024): supervised fine-tuning and preference tuning in one loss, with no reference model, as
TRL's ORPOTrainer computes it. With each answer's log-probability averaged over its tokens (log P), the log odds
of an answer are log P - log(1 - P); a pair's odds-ratio term is -beta log sigmoid(log odds(chosen) - log
odds(rejected)), and the loss adds the chosen answers' negative log-likelihood, a mean over their tokens.

TRL's ORPOTrainer counts the prompt's tokens in that NLL too ("computed over the full prompt and response"); the
paper's L_SFT, and this trainer, count the chosen answer's, as supervised fine-tuning trains on them."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.loss import pair_rewards
from fsdp_trainer.steps.pairs import (
    REWARD_METRICS,
    PairStep,
    answer_logps,
    length_normalized,
    reward_sums,
)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2 (Maechler 2012)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ORPOStep(PairStep):
    """ORPO's loss and TRL's ORPO metrics (log_odds_ratio: the mean log sigmoid of the log odds ratio;
    log_odds_chosen: the mean log odds ratio), means over the global batch's pairs; nll_loss over the chosen tokens."""

    name = "orpo"
    chosen_by = "set preference.loss orpo"
    metrics = (*REWARD_METRICS, "log_odds_ratio", "log_odds_chosen")
    shown = {"rewards/accuracies": "reward accuracy", "log_odds_chosen": "log odds"}

    def __init__(self, beta: float, chunks: int = 1):
        super().__init__(nll_weight=1.0)
        self.beta, self.chunks = beta, chunks

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return recipe.preference.loss == "orpo"

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> ORPOStep:
        return cls(recipe.preference.beta, recipe.train.loss_chunks)

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logps, lengths = answer_logps(model, batch, self.chunks)
        chosen, rejected = length_normalized(logps, lengths)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        odds = torch.stack([ratio.detach().sum(), log_odds.detach().sum()])
        metrics = torch.cat([reward_sums(pair_rewards(self.beta, chosen, rejected)), odds])
        return self.loss_terms(-self.beta * ratio, logps[0::2]), metrics
