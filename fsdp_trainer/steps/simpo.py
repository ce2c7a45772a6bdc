"""SimPO (Meng et al. 2024): preference tuning with no reference model, as TRL's CPOTrainer computes it with
loss_type="simpo". Each answer's reward is beta x its log-probability averaged over its tokens; a pair's loss is
-log sigmoid(beta (chosen - rejected) - gamma), gamma the target margin, with label smoothing e:
-(1 - e) log sigmoid(x) - e log sigmoid(-x). With preference.nll_weight (CPO's cpo_alpha) the chosen answers'
negative log-likelihood, a mean over their tokens, is added. No second model is built, held or priced."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.loss import label_smoothed, pair_rewards
from fsdp_trainer.steps.pairs import (
    REWARD_METRICS,
    PairStep,
    answer_logps,
    length_normalized,
    reward_sums,
)


class SimPOStep(PairStep):
    """SimPO's loss and TRL's CPO metrics, means over the global batch's pairs."""

    name = "simpo"
    chosen_by = "set preference.loss simpo"
    metrics = REWARD_METRICS
    shown = {"rewards/accuracies": "reward accuracy", "rewards/margins": "margin"}

    def __init__(self, beta: float, gamma: float, label_smoothing: float, nll_weight: float, chunks: int = 1):
        super().__init__(nll_weight)
        self.beta, self.gamma, self.label_smoothing, self.chunks = beta, gamma, label_smoothing, chunks

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return recipe.preference.loss == "simpo"

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> SimPOStep:
        cfg = recipe.preference
        return cls(cfg.beta, cfg.simpo_gamma, cfg.label_smoothing, cfg.nll_weight, recipe.train.loss_chunks)

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        """Each pair's loss from its answers' averaged log-probabilities (pairs,)."""
        return label_smoothed(self.beta * (chosen - rejected) - self.gamma, self.label_smoothing)

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logps, lengths = answer_logps(model, batch, self.chunks)
        chosen, rejected = length_normalized(logps, lengths)
        metrics = reward_sums(pair_rewards(self.beta, chosen, rejected))
        return self.loss_terms(self.pair_losses(chosen, rejected), logps[0::2]), metrics
