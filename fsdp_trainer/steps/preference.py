"""Preference tuning against a reference (DPO and its variants): the reference's log-probabilities of each pair's
answers (no gradient), then the policy's, and loss.PreferenceLoss turns the four numbers of each pair into its loss
and TRL's reward metrics. The reference is the model the run started from: the policy with its adapters off, or a
frozen copy (pairs.py says what every pair kind shares)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn

from fsdp_trainer.adapters import has_adapters
from fsdp_trainer.adapters.lora import adapters_disabled
from fsdp_trainer.checkpoint.starts import Start
from fsdp_trainer.config import PreferenceConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import reshard, uses_flex_attention
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.loss import PREFERENCE_LOSSES, PreferenceLoss, SequenceLogProbs
from fsdp_trainer.steps.base import frozen_copy
from fsdp_trainer.steps.pairs import REWARD_METRICS, PairStep, answer_logps, answers_objective, reward_sums

METRICS = REWARD_METRICS


def held(estimates: list) -> str:
    """How the reference is held, for the planner's note (planner.plan.Estimate rows)."""
    sharded = min((e for e in estimates if not e.offload), key=lambda e: e.reference_gb)
    if sharded.reference_gb == 0:
        return "the policy with its adapters off: no memory of its own"
    return f"a frozen copy in the compute dtype, {sharded.reference_gb:.2f} GB per rank sharded (`reference`)"


REFERENCE_FILE = "reference.json"
"""In a full fine-tuning preference run's step directory: where its frozen reference model's weights came from, the
model the run started from (checkpoint/starts.py)."""


class Reference:
    """The model the rewards are measured against: the policy with its adapters off (LoRA: no second copy of the
    weights), or `frozen`, a copy of the model the run started from with no gradients and no optimizer state."""

    def __init__(self, policy: nn.Module, frozen: nn.Module | None = None):
        self.policy, self.frozen = policy, frozen

    @torch.no_grad()
    def logps(self, batch: MicroBatch, objective: SequenceLogProbs) -> torch.Tensor:
        """Each answer's summed log-probability under the reference (`objective`'s, e.g. 2 x pairs, chosen and rejected
        alternating)."""
        model = self.frozen if self.frozen is not None else self.policy
        with adapters_disabled(self.policy) if self.frozen is None else nullcontext():
            logps = model(batch.inputs, batch.documents, loss=objective)
        if self.frozen is not None:
            reshard(self.frozen)
        return logps

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> Reference:
        """With adapters, the policy itself with them switched off; otherwise a frozen copy of the model, built and
        sharded as the policy is, held in the compute dtype (what FSDP gathers anyway, so its forward is the policy's
        at step 0, bitwise), no gradients, no optimizer state; the checkpointer loads the weights the run started from
        into it (`starts`)."""
        frozen = None
        if not has_adapters(policy):  # on meta: build.build_step materializes it
            frozen = frozen_copy(
                recipe.model, recipe.parallel, env.mesh, uses_flex_attention(recipe.parallel, env.device)
            )
        return cls(policy, frozen)

    def starts(self) -> list[Start]:
        """The frozen copy, which holds the weights the run started from, as a start of the run."""
        return [] if self.frozen is None else [Start(REFERENCE_FILE, self.frozen, "reference model is")]


class PreferenceStep(PairStep):
    """The losses of one optimizer step's micro-batches of preference pairs: the reference's log-probabilities
    (no gradient), then the policy's forward and backward, micro-batch by micro-batch; the loss and TRL's reward
    metrics are means over the global batch's pairs."""

    name = "preference"
    chosen_by = "set preference.loss (sigmoid for DPO, ipo or robust)"
    metrics = METRICS
    shown = {"rewards/accuracies": "reward accuracy", "rewards/margins": "margin"}

    def __init__(self, cfg: PreferenceConfig, reference: Reference, chunks: int = 1):
        super().__init__(cfg.nll_weight)
        self.loss = PreferenceLoss(cfg.loss, cfg.beta, cfg.label_smoothing)
        self.reference, self.chunks = reference, chunks
        self.starts += reference.starts()

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return recipe.preference.loss in PREFERENCE_LOSSES

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> PreferenceStep:
        return cls(recipe.preference, Reference.build(recipe, env, policy), recipe.train.loss_chunks)

    @classmethod
    def frozen_params(cls, recipe: Any, n_params: int, adapted: bool) -> int:
        return 0 if adapted else n_params  # with adapters, the reference is the policy's own weights

    @classmethod
    def forward_params(cls, recipe: Any, n_params: int) -> int:
        return n_params  # the reference's forward

    @classmethod
    def plan_note(cls, recipe: Any, estimates: list) -> str:
        """What the reference costs in the planner's rows, and what the other way of having it would."""
        return (
            f"preference.loss {recipe.preference.loss}: the reference model is {held(estimates)}; its forward each "
            "micro-step "
            "gathers the weights again (in `sent`) and adds a third of a step's compute (in the predicted step time). "
            "Log-probabilities computed once before training and stored beside the data (8 bytes a pair) would cost "
            "neither during training, but one forward pass over every pair first; this trainer does not offer it yet."
        )

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's loss terms (pairs.PairStep.loss_terms) and its sums of METRICS: the reference's
        log-probabilities of its answers (no gradient), then the policy's (with gradient, where enabled)."""
        reference = self.reference.logps(batch, answers_objective(batch, self.chunks))
        policy, lengths = answer_logps(model, batch, self.chunks)
        chosen, rejected, ref_chosen, ref_rejected = policy[0::2], policy[1::2], reference[0::2], reference[1::2]
        losses = self.loss(chosen, rejected, ref_chosen, ref_rejected, lengths[0::2], lengths[1::2])
        rewards = self.loss.rewards(chosen, rejected, ref_chosen, ref_rejected)
        return self.loss_terms(losses, chosen), reward_sums(rewards)
