"""Preference tuning against a reference (DPO and its variants): the reference's log-probabilities of each pair's
answers (no gradient), then the policy's, and loss.PreferenceLoss turns the four numbers of each pair into its loss
and TRL's reward metrics. The reference is the model the run started from: the policy with its adapters off, or a
frozen copy (pairs.py says what every pair kind shares)."""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_trainer.adapters import has_adapters
from fsdp_trainer.adapters.lora import adapters_disabled
from fsdp_trainer.checkpoint.starts import LORA_BASE_FILE, Start
from fsdp_trainer.config import PreferenceConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import reshard, uses_flex_attention
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.loss import PREFERENCE_LOSSES, PreferenceLoss, SequenceLogProbs
from fsdp_trainer.steps.base import frozen_copy
from fsdp_trainer.steps.pairs import REWARD_METRICS, PairStep, answer_logps, answers_objective, reward_sums
from fsdp_trainer.steps.reference_cache import CACHE_DIR, ReferenceCache, data_fingerprint

METRICS = REWARD_METRICS
logger = logging.getLogger("fsdp_trainer")


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
        self.reference, self.chunks, self.cached = reference, chunks, cfg.reference == "cache"
        self.starts += reference.starts()
        self.caches: dict[str, ReferenceCache] = {}
        self.split = "train"

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return recipe.preference.loss in PREFERENCE_LOSSES

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> PreferenceStep:
        return cls(recipe.preference, Reference.build(recipe, env, policy), recipe.train.loss_chunks)

    @classmethod
    def check(cls, recipe: Any) -> None:
        if recipe.preference.reference == "cache" and recipe.data.mixture:
            raise ValueError(
                "preference.reference=cache keeps the log-probabilities of one train file's windows; data.mixture "
                "draws from several: set data.train_path, or preference.reference model"
            )

    @classmethod
    def frozen_params(cls, recipe: Any, n_params: int, adapted: bool) -> int:
        if recipe.preference.reference == "cache":
            return 0  # freed once its log-probabilities are cached, before the first step
        return 0 if adapted else n_params  # with adapters, the reference is the policy's own weights

    @classmethod
    def forward_params(cls, recipe: Any, n_params: int) -> int:
        return 0 if recipe.preference.reference == "cache" else n_params  # the reference's forward

    def prepare(self, recipe: Any, env: DistEnv, files: dict[str, Any], records: dict[str, bytes]) -> None:
        """With a cached reference: its log-probabilities of every pair of each split, read from train.out_dir or
        computed (one sharded forward pass) and stored there; then the frozen copy's weights are freed."""
        if not self.cached:
            return
        record = records.get(REFERENCE_FILE, records.get(LORA_BASE_FILE))
        for split, tokens in files.items():
            if tokens is None:
                continue
            made_from = {"reference": json.loads(record), "data": data_fingerprint(tokens)}
            path = Path(recipe.train.out_dir) / CACHE_DIR / f"{split}.npz"
            if path.is_file():
                self.caches[split] = ReferenceCache.load(path, made_from)
                if env.is_main:
                    logger.info(f"preference.reference=cache: the reference's log-probabilities read from {path}")
                continue
            data, began = recipe.data, time.perf_counter()
            if env.is_main:
                logger.info(f"preference.reference=cache: one pass of the reference over {tokens.path} first")

            def logps_of(batch: MicroBatch) -> torch.Tensor:
                return self.reference.logps(batch, answers_objective(batch, self.chunks))

            self.caches[split] = ReferenceCache.compute(logps_of, tokens, data.seq_len, data.micro_batch_size, env)
            if env.is_main:
                self.caches[split].save(path, made_from)
                logger.info(
                    f"preference.reference=cache: the reference's log-probabilities of {split}'s "
                    f"{len(self.caches[split].values):,} answers computed in {time.perf_counter() - began:.1f} s, "
                    f"stored in {path}"
                )
        if self.reference.frozen is not None:
            self.reference.frozen.to_empty(device="meta")  # no longer read: the cache stands for it

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
