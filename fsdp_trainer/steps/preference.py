"""Preference tuning against a reference (DPO and its variants): the reference's log-probabilities of each pair's
answers (no gradient), then the policy's, and loss.PreferenceLoss turns the four numbers of each pair into its loss
and TRL's reward metrics. The reference is the model the run started from: the policy with its adapters off, or a
frozen copy (pairs.py says what every pair kind shares)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp_trainer.checkpoint.starts import LORA_BASE_FILE
from fsdp_trainer.config import PreferenceConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.loss import PREFERENCE_LOSSES, PreferenceLoss
from fsdp_trainer.steps.pairs import REWARD_METRICS, PairStep, answer_logps, answers_objective, reward_sums
from fsdp_trainer.steps.reference import REFERENCE_FILE, AgainstReference, Reference, held
from fsdp_trainer.steps.reference_cache import ReferenceCache, cached_logps

METRICS = REWARD_METRICS


class Preference(AgainstReference):
    """What the house asks of DPO and its variants before the step is built: the kind, its metrics, the reference's
    price."""

    name = "preference"
    chosen_by = "set preference.loss (sigmoid for DPO, ipo or robust)"
    metrics = METRICS
    shown = {"rewards/accuracies": "reward accuracy", "rewards/margins": "margin"}

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return recipe.preference.loss in PREFERENCE_LOSSES

    @classmethod
    def check(cls, recipe: Any) -> None:
        if recipe.preference.reference == "cache" and recipe.data.mixture:
            raise ValueError(
                "preference.reference=cache keeps the log-probabilities of one train file's windows; data.mixture "
                "draws from several: set data.train_path, or preference.reference model"
            )

    @classmethod
    def forward_params(cls, recipe: Any, n_params: int) -> int:
        return 0 if recipe.preference.reference == "cache" else n_params  # the reference's forward

    @classmethod
    def plan_note(cls, recipe: Any, estimates: list) -> str:
        """What the reference costs in the planner's rows, and what the other way of having it would."""
        loss = f"preference.loss {recipe.preference.loss}"
        if recipe.preference.reference == "cache":
            return (
                f"{loss}, preference.reference cache: before the first step, one forward pass of the reference over "
                "every pair of the train and validation files (its time grows with the data, which the planner does "
                "not read), 8 bytes a pair stored; then no reference is held, gathered or run (none in these rows)"
            )
        frozen = max(e.reference_gb for e in estimates if not e.offload)
        return (
            f"{loss}: the reference model is {held(estimates)}; its forward each micro-step gathers the weights again "
            "(in `sent`) and adds a third of a step's compute (in the predicted step time). With "
            "--preference.reference cache its log-probabilities are computed once before training (one forward pass "
            f"over every pair) and the step holds and runs no reference: up to {frozen:.2f} GB a rank less, and not "
            "that third"
        )


class PreferenceStep(Preference, PairStep):
    """The losses of one optimizer step's micro-batches of preference pairs: the reference's log-probabilities
    (no gradient), then the policy's forward and backward, micro-batch by micro-batch; the loss and TRL's reward
    metrics are means over the global batch's pairs."""

    def __init__(self, cfg: PreferenceConfig, reference: Reference, chunks: int = 1):
        super().__init__(cfg.nll_weight)
        self.loss = PreferenceLoss(cfg.loss, cfg.beta, cfg.label_smoothing)
        self.reference, self.chunks, self.cached = reference, chunks, cfg.reference == "cache"
        self.starts += reference.starts()
        self.caches: dict[str, ReferenceCache] = {}
        self.split = "train"

    def prepare(self, recipe: Any, env: DistEnv, files: dict[str, Any], records: dict[str, bytes]) -> None:
        """With a cached reference: its log-probabilities of every pair of each split, read from train.out_dir or
        computed (one sharded forward pass) and stored there; then the frozen copy's weights are freed."""
        if not self.cached:
            return
        record = records.get(REFERENCE_FILE, records.get(LORA_BASE_FILE))

        def logps_of(batch: MicroBatch) -> torch.Tensor:
            return self.reference.logps(batch, answers_objective(batch, self.chunks))

        self.caches = cached_logps(logps_of, record, files, recipe, env)
        if self.reference.frozen is not None:
            self.reference.frozen.to_empty(device="meta")  # no longer read: the cache stands for it

    @torch.no_grad()
    def evaluate(self, model: nn.Module, micro_batches: list[MicroBatch]) -> dict[str, torch.Tensor]:
        self.split = "val"  # the micro-batches are the validation file's: its cache
        try:
            return super().evaluate(model, micro_batches)
        finally:
            self.split = "train"

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's loss terms (pairs.PairStep.loss_terms) and its sums of METRICS: the reference's
        log-probabilities of its answers (no gradient), then the policy's (with gradient, where enabled)."""
        if self.caches:
            reference = self.caches[self.split].logps(batch)
        elif self.cached:  # a step never prepared (the planner's, on fake tensors): zeros in place of its cache
            reference = torch.zeros(2 * batch.pairs, device=batch.inputs.device)
        else:
            reference = self.reference.logps(batch, answers_objective(batch, self.chunks))
        policy, lengths = answer_logps(model, batch, self.chunks)
        chosen, rejected, ref_chosen, ref_rejected = policy[0::2], policy[1::2], reference[0::2], reference[1::2]
        losses = self.loss(chosen, rejected, ref_chosen, ref_rejected, lengths[0::2], lengths[1::2])
        rewards = self.loss.rewards(chosen, rejected, ref_chosen, ref_rejected)
        return self.loss_terms(losses, chosen), reward_sums(rewards)
