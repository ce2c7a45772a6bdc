"""The reference model the DPO family and KTO measure an answer's reward against: the model the run started from,
held as the policy with its adapters off (LoRA: no second copy of the weights) or as a frozen, sharded copy; and what
the kinds that hold one answer alike (how they are built, what the reference costs the planner)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn

from fsdp_trainer.adapters import has_adapters
from fsdp_trainer.adapters.lora import adapters_disabled
from fsdp_trainer.checkpoint.starts import Start
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import reshard, uses_flex_attention
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.loss import SequenceLogProbs
from fsdp_trainer.steps.base import Kind, Step, frozen_copy

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
            logps = model(batch.inputs, batch.documents, loss=objective, shared=batch.shared)
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


class AgainstReference(Kind):
    """A kind whose step measures against a Reference (its constructor takes the preference section, the reference and
    the loss's chunks): how it is built, and the frozen copy the planner prices."""

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> Step:
        return cls(recipe.preference, Reference.build(recipe, env, policy), recipe.train.loss_chunks)

    @classmethod
    def frozen_params(cls, recipe: Any, n_params: int, adapted: bool) -> int:
        if recipe.preference.reference == "cache":
            return 0  # freed once its log-probabilities are cached, before the first step
        return 0 if adapted else n_params  # with adapters, the reference is the policy's own weights


def held(estimates: list) -> str:
    """How the reference is held, for the planner's note (planner.memory.Estimate rows)."""
    sharded = min((e for e in estimates if not e.offload), key=lambda e: e.reference_gb)
    if sharded.reference_gb == 0:
        return "the policy with its adapters off: no memory of its own"
    return f"a frozen copy in the compute dtype, {sharded.reference_gb:.2f} GB per rank sharded (`reference`)"
